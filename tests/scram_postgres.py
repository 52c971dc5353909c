"""A PostgreSQL server of the test session's own, where passwords are really checked.

The machine's shared PostgreSQL trusts every connection from 127.0.0.1, so a test could never tell a
right password from a wrong one there. This starts the same PostgreSQL binaries on a private data
directory and port, with ``scram-sha-256`` for every connection (what Azure Database for PostgreSQL
does with an Entra token as the password, as far as the wire is concerned), and stops it at the end.
It touches nothing of the shared server.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

HOST = "127.0.0.1"
SUPERUSER = "postgres"


def _bin_dir() -> Path | None:
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
    if found:
        return found[-1].parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class ScramPostgres:
    port: int
    superuser_password: str
    host: str = HOST

    def url(self, user: str, password: str | None = None, database: str = "postgres") -> str:
        auth = user if password is None else f"{user}:{password}"
        return f"postgresql://{auth}@{self.host}:{self.port}/{database}"

    def superuser_conninfo(self, database: str = "postgres") -> str:
        return self.url(SUPERUSER, self.superuser_password, database)

    def run(self, sql: str, *params: Any, database: str = "postgres") -> list[tuple[Any, ...]]:
        """Run statements as the superuser (the stand-in for the server's Entra administrator)."""
        import psycopg

        with psycopg.connect(self.superuser_conninfo(database), autocommit=True) as conn:
            cur = conn.execute(sql, params or None)
            return cur.fetchall() if cur.description else []


@pytest.fixture(scope="session")
def scram_postgres() -> Iterator[ScramPostgres]:
    bin_dir = _bin_dir()
    if bin_dir is None:
        message = "PostgreSQL server binaries (initdb) are not installed"
        if os.environ.get("QUEUEING_REQUIRE_SERVICES") == "1":
            pytest.fail(message)
        pytest.skip(message)
    as_postgres: list[str] = []
    base = Path(tempfile.mkdtemp(prefix="queueing-scram-pg-"))
    if os.geteuid() == 0:  # PostgreSQL refuses to run as root
        as_postgres = ["runuser", "-u", "postgres", "--"]
        shutil.chown(base, "postgres")
    password = os.urandom(12).hex()
    pwfile = base / "pw"
    pwfile.write_text(password)
    if as_postgres:
        shutil.chown(pwfile, "postgres")
    data = base / "data"
    port = _free_port()

    def run(*cmd: str) -> None:
        subprocess.run([*as_postgres, *cmd], check=True, capture_output=True, timeout=120)

    run(
        str(bin_dir / "initdb"), "-D", str(data), "--auth=scram-sha-256", f"--pwfile={pwfile}",
        "-U", SUPERUSER, "--no-sync",
    )  # fmt: skip
    run(
        str(bin_dir / "pg_ctl"), "-D", str(data), "-l", str(base / "server.log"), "-w", "start",
        "-o", f"-p {port} -k {base} -c listen_addresses={HOST} -c fsync=off",
    )  # fmt: skip
    try:
        yield ScramPostgres(port=port, superuser_password=password)
    finally:
        with contextlib.suppress(subprocess.SubprocessError):
            run(str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop")
        shutil.rmtree(base, ignore_errors=True)
