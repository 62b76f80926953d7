"""A throwaway PostgreSQL for the replica tests: `initdb` in a temporary folder, `pg_ctl` on a free loopback
port, stopped and deleted afterwards. Debian's `postgresql` (15) server binaries; `initdb` refuses to run as
root, so as root the server runs as the `postgres` user (`runuser`)."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .ports import free_port

BIN_DIRS = [Path(f"/usr/lib/postgresql/{version}/bin") for version in (17, 16, 15)]


def postgres_bin() -> Path | None:
    found = next((path for path in BIN_DIRS if (path / "initdb").exists()), None)
    if found is None and shutil.which("initdb"):
        found = Path(shutil.which("initdb")).parent
    return found


def missing_reason() -> str | None:
    """Why a PostgreSQL can't be started here, or None."""
    if postgres_bin() is None:
        return "PostgreSQL's server binaries (initdb, pg_ctl) are not installed: apt-get install postgresql"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root without a `postgres` user for initdb"
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return "psycopg is not installed: pip install -e .[serve]"
    return None


@contextmanager
def postgres_server() -> Iterator[str]:
    """`with postgres_server() as admin_url:` a running server; `admin_url` is a SQLAlchemy URL."""
    binaries = postgres_bin()
    folder = Path(tempfile.mkdtemp(prefix="stepbatch-pg-"))
    as_user: list[str] = []
    if os.geteuid() == 0:
        user = pwd.getpwnam("postgres")
        os.chown(folder, user.pw_uid, user.pw_gid)
        as_user = ["runuser", "-u", "postgres", "--"]
    port = free_port()
    data = folder / "data"
    run = dict(check=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
    subprocess.run([*as_user, str(binaries / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres",
                    "--no-sync", "-E", "UTF8"], **run)
    options = f"-p {port} -k {folder} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200"
    subprocess.run([*as_user, str(binaries / "pg_ctl"), "-D", str(data), "-l", str(folder / "log"), "-w",
                    "-o", options, "start"], **run)
    try:
        yield f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run([*as_user, str(binaries / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop"],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60)
        shutil.rmtree(folder, ignore_errors=True)


def fresh_database(admin_url: str, name: str) -> str:
    """A new empty database on that server; its URL."""
    import sqlalchemy as sa

    engine = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with engine.connect() as connection:
        connection.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}"'))
        connection.execute(sa.text(f'CREATE DATABASE "{name}"'))
    engine.dispose()
    return admin_url.rsplit("/", 1)[0] + f"/{name}"
