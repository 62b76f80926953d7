"""Input checks before a request enters a batch: `check_call_inputs` (any pipeline, at submit: `call.py`), the
generic program's checks of a call (`generic_call.py`), the pipeline's own `check_inputs` (`pipeline.py`) and the
value checks the programs share (`values.py`)."""

from .call import check_call_inputs

__all__ = ["check_call_inputs"]
