"""Input checks before a request enters a batch: `check_call_inputs` (any pipeline, at submit: `call.py`), then
`check_program_call` (every program's checks of its call: `program.py`), built of the generic program's checks
(`generic_call.py`), the pipeline's own `check_inputs` (`pipeline.py`) and the value checks (`values.py`)."""

from .call import check_call_inputs
from .program import ProgramChecks, check_program_call

__all__ = ["ProgramChecks", "check_call_inputs", "check_program_call"]
