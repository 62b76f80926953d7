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


class LiveRequests:
    """In-flight and recently finished HTTP image requests (the last `history` of them)."""

    def __init__(self, history: int = 200):
        self._lock = threading.Lock()
        self._recent: deque[LiveRequest] = deque(maxlen=history)
        self._ids = itertools.count(1)

    def start(self, generation: Any) -> LiveRequest:
        entry = LiveRequest(id=f"r{next(self._ids)}", user=generation.user, kind=generation.kind,
                            task=generation.task, size=f"{generation.width}x{generation.height}",
                            steps=generation.num_steps, started=time.time(), request_ids=generation.request_ids)
        with self._lock:
            self._recent.append(entry)
        return entry

    @staticmethod
    def finish(entry: LiveRequest, status: str) -> None:
        entry.finished, entry.status = time.time(), status

    def snapshot(self, sb: Any, seconds: float) -> dict[str, Any]:
        """Denoise forwards of the last `seconds` (rows, users in flight) and the requests of that window."""
        now = time.time()
        since = now - seconds
        calls = sb.recent_calls(seconds, "denoise")
        with self._lock:
            window = [r for r in self._recent if r.finished is None or r.finished >= since]
        owners = {request_id: r.user or r.id for r in window for request_id in r.request_ids}
        forwards = []
        for call in calls:
            users = sorted({owners[i] for i in call.request_ids if i in owners})
            forwards.append({"ago_s": round(now - call.time, 3), "rows": call.rows,
                             "ms": round(1000 * call.seconds, 1), "users": users})
        return {
            "now": now, "seconds": seconds, "forwards": forwards,
            **sb.queue_lengths(),
            "requests": [{"id": r.id, "user": r.user, "kind": r.kind, "task": r.task, "size": r.size,
                          "steps": r.steps, "status": r.status, "age_s": round(now - r.started, 3)}
                         for r in window],
        }
