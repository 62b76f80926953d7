"""The generic program: any pipeline's own `__call__` per request, its model calls intercepted and batched.

`plan.py` plans a call and runs it; `intercept.py` holds the model proxies and the work items of their calls;
`branch_pairs.py` predicts a request's second CFG branch.
"""

from .plan import plan_generic

__all__ = ["plan_generic"]
