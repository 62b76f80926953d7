"""PiD early exit: where a request leaves the main model and how PiD decodes it (`exit.py`), per pipeline family
(`families.py`) and in the generic program (`generic.py`)."""
