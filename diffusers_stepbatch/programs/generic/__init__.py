"""The generic program: any pipeline's own `__call__` per request, its model calls intercepted and batched.

`plan.py` plans a call; `proxies.py` plans and installs the request's model proxies; `work_items.py` makes their
calls work items and runs them; `turns.py` runs the call in turn with its step program; `branch_pairs.py` predicts
a request's second CFG branch.
"""

from .plan import plan_generic

__all__ = ["plan_generic"]
