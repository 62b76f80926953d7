"""`LiveRequests`: what the engine is doing now, for the web page's live panel (`GET /v1/engine/live`).

The engine records every batched model call (time, kind, rows, the engine requests in it); the server knows
which engine requests each HTTP request submitted and who sent it (`user`, the web page's tab id). A forward is
shown with the users whose rows it held.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any


@dataclass
class LiveRequest:
    id: str
    user: str | None
    kind: str
    task: str
    size: str
    steps: int
    started: float
    request_ids: list[int]  # the engine requests it submitted
    finished: float | None = None
    status: str = "running"
    tenant: str | None = None


class LiveRequests:
    """In-flight and recently finished HTTP image requests (the last `history` of them)."""

    def __init__(self, history: int = 200):
        self._lock = threading.Lock()
        self._recent: deque[LiveRequest] = deque(maxlen=history)
        self._ids = itertools.count(1)

    def start(self, generation: Any) -> LiveRequest:
        entry = LiveRequest(id=f"r{next(self._ids)}", user=generation.user, kind=generation.kind,
                            task=generation.task, size=f"{generation.width}x{generation.height}",
                            steps=generation.num_steps, started=time.time(), request_ids=generation.request_ids,
                            tenant=getattr(generation, "tenant", None))
        with self._lock:
            self._recent.append(entry)
        return entry

    @staticmethod
    def finish(entry: LiveRequest, status: str) -> None:
        entry.finished, entry.status = time.time(), status

    def snapshot(self, sb: Any, seconds: float, viewer: str | None = None) -> dict[str, Any]:
        """Denoise forwards of the last `seconds` (rows, users in flight) and the requests of that window.

        `viewer`: the tenant asking (None: an admin or an open server, who sees everything). Other tenants'
        requests appear as counts and shapes only: no ids, users or prompts (`others` in a forward).
        """
        now = time.time()
        since = now - seconds
        calls = sb.recent_calls(seconds, "denoise")
        with self._lock:
            window = [r for r in self._recent if r.finished is None or r.finished >= since]

        def visible(r: LiveRequest) -> bool:
            return viewer is None or r.tenant == viewer

        owners = {request_id: r for r in window for request_id in r.request_ids}
        forwards = []
        for call in calls:
            mine = [owners[i] for i in call.request_ids if i in owners]
            users = sorted({r.user or r.id for r in mine if visible(r)})
            others = len({r.id for r in mine if not visible(r)})
            forwards.append({"ago_s": round(now - call.time, 3), "rows": call.rows,
                             "ms": round(1000 * call.seconds, 1), "users": users, "others": others})
        return {
            "now": now, "seconds": seconds, "forwards": forwards,
            **sb.queue_lengths(),
            "requests": [{"id": r.id if visible(r) else None, "user": r.user if visible(r) else None,
                          "kind": r.kind, "task": r.task, "size": r.size, "steps": r.steps, "status": r.status,
                          "age_s": round(now - r.started, 3), "mine": visible(r)}
                         for r in window],
        }
