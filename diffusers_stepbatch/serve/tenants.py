"""Tenants: who a request is, from its Bearer key (`--api-keys FILE`, TOML), and the limits of that key.

```toml
[[keys]]
key = "sk-alice"
tenant = "alice"
requests_per_minute = 120      # also max_concurrent_requests, max_concurrent_video_jobs (429 beyond),
max_priority = 0               # max_pixels, max_frames, max_steps (400 beyond), weight, admin
```

The tenant, not the body, says who a request is: `user` is set to the tenant's name. Another tenant's job is a
404, as if it didn't exist. The single `--api-key` is one tenant ("default") without limits.
"""

from __future__ import annotations

import math
import secrets
import threading
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from .protocol import APIError

_LIMITS = ("requests_per_minute", "max_concurrent_requests", "max_concurrent_video_jobs", "max_priority",
           "max_pixels", "max_frames", "max_steps")


@dataclass
class TenantKey:
    """One key of `--api-keys`: its tenant and limits (None: unlimited).

    Args:
        key, tenant: the Bearer secret and the name it stands for (several keys may share one tenant).
        admin: sees and manages every tenant's jobs and the whole live panel.
        weight: the tenant's share of denoising rows under contention, relative to other tenants.
    """

    key: str
    tenant: str
    admin: bool = False
    weight: float = 1.0
    requests_per_minute: int | None = None
    max_concurrent_requests: int | None = None
    max_concurrent_video_jobs: int | None = None
    max_priority: int | None = None
    max_pixels: int | None = None
    max_frames: int | None = None
    max_steps: int | None = None

    def __post_init__(self):
        if not self.key or not self.tenant:
            raise ValueError(f"key={self.key!r}, tenant={self.tenant!r}: both must be non-empty")
        if not self.weight > 0:
            raise ValueError(f"tenant {self.tenant!r}: weight={self.weight} must be > 0")
        for name in _LIMITS:
            value = getattr(self, name)
            if value is not None and name != "max_priority" and value < 1:
                raise ValueError(f"tenant {self.tenant!r}: {name}={value} must be >= 1 (leave it out: no limit)")


@dataclass
class Tenant:
    """A tenant's running counts: its rate bucket and requests in flight (shared by its keys)."""

    name: str
    tokens: float = math.inf
    refilled: float = field(default_factory=time.monotonic)
    in_flight: int = 0


def load_api_keys(path: str | Path) -> list[TenantKey]:
    """The keys of a `--api-keys` TOML file (`[[keys]]` tables); a ValueError naming the bad entry."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib

    with open(path, "rb") as file:
        data = tomllib.load(file)
    entries = data.get("keys")
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{path}: no [[keys]] tables; each needs `key` and `tenant`")
    known = {f.name for f in fields(TenantKey)}
    keys, seen = [], set()
    for index, entry in enumerate(entries):
        unknown = sorted(set(entry) - known)
        if unknown:
            raise ValueError(f"{path}: keys[{index}] has unknown fields {unknown}; known: {sorted(known)}")
        try:
            key = TenantKey(**entry)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{path}: keys[{index}]: {exc}") from None
        if key.key in seen:
            raise ValueError(f"{path}: keys[{index}] repeats a key of an earlier entry")
        seen.add(key.key)
        keys.append(key)
    return keys


class Tenants:
    """The server's keys: `authenticate` a request, then `admit` it against its key's limits."""

    def __init__(self, keys: list[TenantKey], retry_after_s: int = 1, store: Any = None):
        self.keys = keys
        self.retry_after_s = retry_after_s
        self.store = store  # a shared `JobStore`: rate buckets every replica on that database counts against
        self._tenants = {key.tenant: Tenant(key.tenant) for key in keys}
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, config: Any) -> Tenants | None:
        """`--api-keys FILE`, else `--api-key` as one tenant "default", else None (an open server)."""
        if config.api_keys:
            keys = load_api_keys(config.api_keys)
            store = None
            if config.jobs_db and any(key.requests_per_minute for key in keys):  # NOTE: replicas share the rate
                from .job_store import JobStore

                store = JobStore(config.jobs_db)
            return cls(keys, config.retry_after_s, store)
        if config.api_key:
            return cls([TenantKey(key=config.api_key, tenant="default")], config.retry_after_s)
        return None

    def authenticate(self, header: str) -> TenantKey | None:
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer":
            return None
        given = given.strip().encode()
        found = None
        for key in self.keys:  # NOTE: every key compared, in constant time: no timing hint of which is close
            if secrets.compare_digest(given, key.key.encode()):
                found = key
        return found

    def close(self) -> None:
        if self.store is not None:
            self.store.close()

    def weights(self) -> dict[str, float]:
        """Each tenant's weight (its keys' largest)."""
        weights: dict[str, float] = {}
        for key in self.keys:
            weights[key.tenant] = max(weights.get(key.tenant, 0.0), key.weight)
        return weights

    # --------------------------------------------------------------------------------------- limits
    def take_request(self, key: TenantKey) -> None:
        """Count one request that creates work against the key's `requests_per_minute` (429 over it)."""
        rate = key.requests_per_minute
        if rate is None:
            return
        if self.store is not None:
            wait = self.store.take_token(key.tenant, rate, rate / 60, time.time())
            if wait > 0:
                raise _over(f"tenant {key.tenant!r} sent more than requests_per_minute={rate}; retry in "
                            f"{math.ceil(wait)} s", "requests_per_minute", math.ceil(wait))
            return
        with self._lock:
            tenant = self._tenants[key.tenant]
            now = time.monotonic()
            tenant.tokens = min(rate, tenant.tokens + (now - tenant.refilled) * rate / 60)
            tenant.refilled = now
            if tenant.tokens < 1:
                wait = math.ceil((1 - tenant.tokens) * 60 / rate)
                raise _over(f"tenant {key.tenant!r} sent more than requests_per_minute={rate}; retry in {wait} s",
                            "requests_per_minute", wait)
            tenant.tokens -= 1

    def start_request(self, key: TenantKey, sb: Any = None) -> None:
        """One image request in flight more (429 over `max_concurrent_requests`); `end_request` when it ends."""
        with self._lock:
            tenant = self._tenants[key.tenant]
            limit = key.max_concurrent_requests
            if limit is not None and tenant.in_flight >= limit:
                raise _over(f"tenant {key.tenant!r} has {tenant.in_flight} requests in flight, its "
                            f"max_concurrent_requests={limit}; retry when one has finished",
                            "max_concurrent_requests", self.until_one_ends(sb, key.tenant))
            tenant.in_flight += 1

    def end_request(self, key: TenantKey) -> None:
        with self._lock:
            self._tenants[key.tenant].in_flight -= 1

    def check_video_jobs(self, key: TenantKey, unfinished: int, sb: Any = None) -> None:
        limit = key.max_concurrent_video_jobs
        if limit is not None and unfinished >= limit:
            raise _over(f"tenant {key.tenant!r} has {unfinished} video jobs queued or running, its "
                        f"max_concurrent_video_jobs={limit}; retry when one has finished",
                        "max_concurrent_video_jobs", self.until_one_ends(sb, key.tenant))

    def until_one_ends(self, sb: Any, tenant: str) -> float:
        """Seconds until the tenant's first running request in `sb`'s engine ends (its remaining steps at the
        engine's recent step time), when a concurrency limit frees a slot; else the server's retry hint."""
        scheduler = getattr(getattr(sb, "engine", None), "scheduler", None)
        step_s = getattr(scheduler, "step_seconds", None)
        steps = [r.remaining_steps for r in list(getattr(scheduler, "running", ())) if r.tenant == tenant]
        return math.ceil(min(steps) * step_s) if steps and step_s else self.retry_after_s


def check_shape(key: TenantKey | None, width: int, height: int, steps: int, frames: int | None = None) -> None:
    """A 400 naming the field over the key's `max_pixels` / `max_steps` / `max_frames` (retrying can't help)."""
    if key is None:
        return
    checks = (("max_pixels", width * height, "size", f"size='{width}x{height}' has {width * height} pixels"),
              ("max_steps", steps, "num_inference_steps", f"num_inference_steps={steps}"),
              ("max_frames", frames, "num_frames", f"num_frames={frames}"))
    for limit_name, value, param, what in checks:
        limit = getattr(key, limit_name)
        if limit is not None and value is not None and value > limit:
            raise APIError(400, f"{what}: tenant {key.tenant!r} may ask for at most {limit_name}={limit}",
                           param=param, code=f"{limit_name}_exceeded")


def capped_priority(key: TenantKey | None, priority: int) -> int:
    """The priority a request runs at: its own, at most its key's `max_priority`."""
    if key is None or key.max_priority is None:
        return priority
    return min(priority, key.max_priority)


def owner_filter(key: TenantKey | None) -> str | None:
    """The tenant whose jobs a request may see (None: all of them: an admin key, or an open server)."""
    return None if key is None or key.admin else key.tenant


def _over(message: str, limit: str, retry_after_s: int) -> APIError:
    return APIError(429, message, type="rate_limit_error", param=limit, code=f"{limit}_exceeded",
                    headers={"Retry-After": str(max(1, int(retry_after_s)))})


def admit(tenants: Tenants | None, key: TenantKey | None, generation: Any) -> Any:
    """Hold a planned image request to its key's limits: its rate, sizes and concurrency (429 / 400), its
    priority capped and its `user` the tenant. Returns what releases its slot when it ends."""
    if tenants is None or key is None:
        return lambda: None
    check_shape(key, generation.width, generation.height, generation.num_steps)
    tenants.take_request(key)
    tenants.start_request(key, generation.sb)
    generation.priority = capped_priority(key, generation.priority)
    generation.user = generation.tenant = key.tenant
    released = threading.Event()

    def release() -> None:
        if not released.is_set():
            released.set()
            tenants.end_request(key)

    return release
