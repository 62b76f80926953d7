"""`JobStore`: video jobs as rows of a SQL database (SQLAlchemy Core), the truth every replica shares.

SQLite under `--state-dir` by default (embedded, nothing to start); any SQLAlchemy URL with `--jobs-db`
(PostgreSQL for replicas). A row holds what a job needs to run again after a restart (its request, seed
included), its status and progress, and a lease: the replica running it and until when. A replica renews its
leases while it runs; one that dies lets them expire and another claims the job with a conditional UPDATE, so
exactly one replica holds a job at a time, and only the holder of the current attempt can finish it.

>>> store = JobStore("sqlite:///state/jobs.sqlite")
>>> store.get("video_123", tenant="alice")
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

logger = logging.getLogger(__name__)

FINISHED = ("completed", "failed")
CANCEL_CHANNEL = "stepbatch_video_cancel"
UNFINISHED = ("queued", "in_progress")

metadata = sa.MetaData()
SCHEMA = sa.Table("stepbatch_schema", metadata, sa.Column("version", sa.Integer, nullable=False))
JOBS = sa.Table(
    "stepbatch_video_jobs", metadata,
    sa.Column("id", sa.String(64), primary_key=True),
    sa.Column("tenant", sa.String(200), index=True),
    sa.Column("end_user", sa.String(200)),
    sa.Column("model", sa.String(500), nullable=False),
    sa.Column("status", sa.String(16), nullable=False, index=True),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("finished_at", sa.Float),
    sa.Column("expires_at", sa.Float),
    sa.Column("step", sa.Integer, nullable=False, default=0),
    sa.Column("num_steps", sa.Integer, nullable=False),
    sa.Column("error", sa.JSON),
    sa.Column("request", sa.JSON, nullable=False),  # the body as planned (seed and capped priority included)
    sa.Column("summary", sa.JSON, nullable=False),  # prompt, width, height, num_frames, fps, seed
    sa.Column("has_reference", sa.Boolean, nullable=False, default=False),
    sa.Column("output", sa.String(200)),  # the finished attempt's folder, relative to the video root
    sa.Column("lease_owner", sa.String(200)),
    sa.Column("lease_expires_at", sa.Float),
    sa.Column("attempt", sa.Integer, nullable=False, default=0),
    sa.Column("cancel_requested", sa.Boolean, nullable=False, default=False),
)


RATES = sa.Table(  # each tenant's `requests_per_minute` bucket, shared by the servers on one database
    "stepbatch_rate_buckets", metadata,
    sa.Column("tenant", sa.String(200), primary_key=True),
    sa.Column("tokens", sa.Float, nullable=False),
    sa.Column("refilled", sa.Float, nullable=False),
)


def _create_v1(connection: sa.Connection) -> None:
    JOBS.create(connection, checkfirst=True)


def _create_v2(connection: sa.Connection) -> None:
    RATES.create(connection, checkfirst=True)


# NOTE: append only. Migration i takes a database from version i to i + 1; a shipped one never changes, so a
# database written by any older release upgrades in place and keeps its jobs.
MIGRATIONS: tuple[Callable[[sa.Connection], None], ...] = (_create_v1, _create_v2)


def migrate(engine: sa.Engine, migrations: Sequence[Callable[[sa.Connection], None]] = MIGRATIONS) -> int:
    """Bring the database's schema to `len(migrations)`; returns the version it found."""
    with engine.begin() as connection:
        if engine.dialect.name == "postgresql":  # NOTE: replicas starting together migrate one after another
            connection.execute(sa.text("SELECT pg_advisory_xact_lock(5417)"))
        SCHEMA.create(connection, checkfirst=True)
        found = connection.scalar(sa.select(SCHEMA.c.version))
        if found is None:
            found = 0
            connection.execute(SCHEMA.insert().values(version=0))
        if found > len(migrations):
            raise RuntimeError(f"the jobs database is at schema version {found}, newer than this release's "
                               f"{len(migrations)}; upgrade diffusers-stepbatch or use another --jobs-db")
        for version in range(found, len(migrations)):
            migrations[version](connection)
        connection.execute(SCHEMA.update().values(version=len(migrations)))
    return found


@dataclass
class JobRecord:
    """One row, as the routes read it."""

    id: str
    tenant: str | None
    end_user: str | None
    model: str
    status: str
    created_at: float
    finished_at: float | None
    expires_at: float | None
    step: int
    num_steps: int
    error: dict[str, Any] | None
    request: dict[str, Any]
    summary: dict[str, Any]
    has_reference: bool
    output: str | None
    lease_owner: str | None
    lease_expires_at: float | None
    attempt: int
    cancel_requested: bool

    @property
    def finished(self) -> bool:
        return self.status in FINISHED


def _record(row: Any) -> JobRecord:
    return JobRecord(**row._mapping)


class JobStore:
    """The jobs table of one database URL. Every method is one short transaction; safe from any thread."""

    def __init__(self, url: str):
        options: dict[str, Any] = {"future": True}
        if url.startswith("sqlite"):
            options["connect_args"] = {"check_same_thread": False, "timeout": 30}
        else:
            options.update(pool_pre_ping=True, pool_size=4, max_overflow=8)
        self.url = url
        self.engine = sa.create_engine(url, **options)
        if url.startswith("sqlite"):
            sa.event.listen(self.engine, "connect", _sqlite_pragmas)
        migrate(self.engine)

    def close(self) -> None:
        self.engine.dispose()

    # ------------------------------------------------------------------------------------- reads
    def get(self, job_id: str, tenant: str | None = None) -> JobRecord | None:
        """The job, or None if it doesn't exist or (with `tenant`) belongs to another tenant."""
        query = sa.select(JOBS).where(JOBS.c.id == job_id)
        if tenant is not None:
            query = query.where(JOBS.c.tenant == tenant)
        with self.engine.connect() as connection:
            row = connection.execute(query).first()
        return None if row is None else _record(row)

    def page(self, tenant: str | None, limit: int, after: str | None, descending: bool) -> tuple[list[JobRecord], bool]:
        """Up to `limit` jobs after the job `after` in creation order (and whether more follow); KeyError for an
        `after` that isn't one of them."""
        query = sa.select(JOBS)
        if tenant is not None:
            query = query.where(JOBS.c.tenant == tenant)
        if after is not None:
            anchor = self.get(after, tenant)
            if anchor is None:
                raise KeyError(after)
            key = sa.tuple_(JOBS.c.created_at, JOBS.c.id)
            point = sa.tuple_(sa.literal(anchor.created_at), sa.literal(anchor.id))
            query = query.where(key < point if descending else key > point)
        order = (JOBS.c.created_at.desc(), JOBS.c.id.desc()) if descending else (JOBS.c.created_at, JOBS.c.id)
        with self.engine.connect() as connection:
            rows = connection.execute(query.order_by(*order).limit(limit + 1)).all()
        return [_record(row) for row in rows[:limit]], len(rows) > limit

    def count(self, unfinished_only: bool = False, tenant: str | None = None) -> int:
        query = sa.select(sa.func.count()).select_from(JOBS)
        if unfinished_only:
            query = query.where(JOBS.c.status.in_(UNFINISHED))
        if tenant is not None:
            query = query.where(JOBS.c.tenant == tenant)
        with self.engine.connect() as connection:
            return connection.scalar(query)

    def oldest_finished(self) -> JobRecord | None:
        query = sa.select(JOBS).where(JOBS.c.status.in_(FINISHED)).order_by(JOBS.c.finished_at).limit(1)
        with self.engine.connect() as connection:
            row = connection.execute(query).first()
        return None if row is None else _record(row)

    def expired(self, now: float) -> list[JobRecord]:
        query = sa.select(JOBS).where(JOBS.c.status.in_(FINISHED), JOBS.c.expires_at <= now)
        with self.engine.connect() as connection:
            return [_record(row) for row in connection.execute(query)]

    def claimable(self, now: float, adopt: str | None = None, model: str | None = None) -> list[JobRecord]:
        """Unfinished jobs nobody holds (leases expired or released) and, with `adopt`, those that replica
        held (it restarted under the same name: its old leases are its own); with `model`, that model's only."""
        free = sa.or_(JOBS.c.lease_owner.is_(None), JOBS.c.lease_expires_at < now)
        if adopt is not None:
            free = sa.or_(free, JOBS.c.lease_owner == adopt)
        query = sa.select(JOBS).where(JOBS.c.status.in_(UNFINISHED), free).order_by(JOBS.c.created_at, JOBS.c.id)
        if model is not None:  # NOTE: a server of another model leaves them to a server of theirs
            query = query.where(JOBS.c.model == model)
        with self.engine.connect() as connection:
            return [_record(row) for row in connection.execute(query)]

    def cancels_for(self, owner: str) -> list[str]:
        query = sa.select(JOBS.c.id).where(JOBS.c.lease_owner == owner, JOBS.c.cancel_requested.is_(True),
                                           JOBS.c.status.in_(UNFINISHED))
        with self.engine.connect() as connection:
            return list(connection.scalars(query))

    # ------------------------------------------------------------------------------------ writes
    def insert(self, **values: Any) -> None:
        with self.engine.begin() as connection:
            connection.execute(JOBS.insert().values(**values))

    def delete(self, job_id: str, finished_only: bool = True) -> bool:
        query = JOBS.delete().where(JOBS.c.id == job_id)
        if finished_only:
            query = query.where(JOBS.c.status.in_(FINISHED))
        with self.engine.begin() as connection:
            return connection.execute(query).rowcount == 1

    def request_cancel(self, job_id: str) -> bool:
        """Flag an unfinished job for cancelling; False if it is finished. On PostgreSQL the flag is also a
        notification, so the replica running the job aborts it at once (its next step boundary)."""
        query = (JOBS.update().where(JOBS.c.id == job_id, JOBS.c.status.in_(UNFINISHED))
                 .values(cancel_requested=True))
        with self.engine.begin() as connection:
            flagged = connection.execute(query).rowcount == 1
            if flagged and self.notifies:
                connection.execute(sa.select(sa.func.pg_notify(CANCEL_CHANNEL, job_id)))  # sent on commit
        return flagged

    @property
    def notifies(self) -> bool:
        return self.engine.dialect.name == "postgresql"

    def listen_cancels(self, on_cancel: Callable[[str], None], stop: threading.Event) -> None:
        """Call `on_cancel(job_id)` for every cancel made through any replica, until `stop` is set (PostgreSQL's
        LISTEN; blocking: run it in a thread). Reconnects after a lost connection."""
        import psycopg

        dsn = self.engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
        while not stop.is_set():
            try:
                with psycopg.connect(dsn, autocommit=True) as connection:
                    connection.execute(f"LISTEN {CANCEL_CHANNEL}")
                    while not stop.is_set():
                        for notice in connection.notifies(timeout=0.5):
                            on_cancel(notice.payload)
            except psycopg.Error:
                logger.warning("listening for cancels failed; retrying", exc_info=True)
                stop.wait(1.0)

    def claim(self, job: JobRecord, owner: str, lease_s: float, now: float) -> int | None:
        """Take `job` for a new attempt if it is still as `job` read it; the attempt number, or None if another
        replica took it first (the conditional UPDATE is what makes the claim exclusive)."""
        query = (JOBS.update()
                 .where(JOBS.c.id == job.id, JOBS.c.attempt == job.attempt, JOBS.c.status.in_(UNFINISHED))
                 .values(lease_owner=owner, lease_expires_at=now + lease_s, attempt=job.attempt + 1, step=0))
        with self.engine.begin() as connection:
            return job.attempt + 1 if connection.execute(query).rowcount == 1 else None

    def _held(self, job_id: str, owner: str, attempt: int) -> Any:
        return sa.and_(JOBS.c.id == job_id, JOBS.c.lease_owner == owner, JOBS.c.attempt == attempt,
                       JOBS.c.status.in_(UNFINISHED))

    def renew(self, held: Sequence[tuple[str, int, dict[str, Any]]], owner: str, lease_s: float,
              now: float) -> list[str]:
        """Extend the leases of the jobs this replica runs (id, attempt, progress values); the ids whose lease
        was lost (another replica claimed them: this attempt must not finish)."""
        lost = []
        with self.engine.begin() as connection:
            for job_id, attempt, values in held:
                query = JOBS.update().where(self._held(job_id, owner, attempt)).values(
                    lease_expires_at=now + lease_s, **values)
                if connection.execute(query).rowcount != 1:
                    lost.append(job_id)
        return lost

    def finish(self, job_id: str, owner: str, attempt: int, **values: Any) -> bool:
        """End an attempt (completed or failed); False if this replica no longer holds it."""
        query = JOBS.update().where(self._held(job_id, owner, attempt)).values(lease_expires_at=None, **values)
        with self.engine.begin() as connection:
            return connection.execute(query).rowcount == 1

    def fail_unheld(self, job: JobRecord, **values: Any) -> bool:
        """Fail a job nobody runs (a cancelled orphan, `--no-resume`), if it is still as `job` read it."""
        query = (JOBS.update().where(JOBS.c.id == job.id, JOBS.c.attempt == job.attempt,
                                     JOBS.c.status.in_(UNFINISHED))
                 .values(lease_owner=None, lease_expires_at=None, **values))
        with self.engine.begin() as connection:
            return connection.execute(query).rowcount == 1

    def take_token(self, tenant: str, capacity: float, per_second: float, now: float) -> float:
        """Take a token from the tenant's bucket (row-locked): 0.0, or the seconds until one is there."""
        for _ in range(2):  # NOTE: a second try if another server inserted the tenant's first row meanwhile
            try:
                with self.engine.begin() as connection:
                    query = sa.select(RATES).where(RATES.c.tenant == tenant).with_for_update()
                    row = connection.execute(query).first()
                    tokens = capacity if row is None else min(capacity, row.tokens + (now - row.refilled) * per_second)
                    if tokens < 1:
                        return (1 - tokens) / per_second
                    values = {"tokens": tokens - 1, "refilled": now}
                    if row is None:
                        connection.execute(RATES.insert().values(tenant=tenant, **values))
                    else:
                        connection.execute(RATES.update().where(RATES.c.tenant == tenant).values(**values))
                    return 0.0
            except sa.exc.IntegrityError:
                continue
        return 0.0

    def release(self, job_id: str, owner: str, attempt: int) -> None:
        """Give a job back unfinished (shutdown): its lease ends now, so a restart or another replica runs it."""
        query = JOBS.update().where(self._held(job_id, owner, attempt)).values(lease_expires_at=0.0)
        with self.engine.begin() as connection:
            connection.execute(query)


def _sqlite_pragmas(connection: Any, _record: Any) -> None:
    # NOTE: WAL lets readers (the routes) run while the heartbeat writes; NORMAL sync is durable across a crash
    # of the process (not of the machine), which is what a restart needs
    cursor = connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()

