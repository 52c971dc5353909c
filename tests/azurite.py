"""A real Azurite (blob, queue, table) for the test session.

Prefers the npm package pinned in package.json (``npm ci``; fast, no Docker). Without it, a Docker
engine is used through testcontainers when that package happens to be installed. Otherwise the tests
that need Azurite are skipped, unless ``QUEUEING_REQUIRE_AZURITE=1`` (CI) turns that into a failure.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import pytest

ROOT = Path(__file__).resolve().parent.parent
AZURITE_BIN = ROOT / "node_modules" / ".bin" / "azurite"
#: the image matching the npm pin (3.35 is the last line that runs on Node 20)
AZURITE_IMAGE = "mcr.microsoft.com/azure-storage/azurite:3.35.0"
#: Azurite's documented development account; public, and only ever used against the emulator
ACCOUNT = "devstoreaccount1"
ACCOUNT_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
HOST = "127.0.0.1"
READY_TIMEOUT = 90.0  # generous: Node starts slowly on a loaded machine


@dataclass(frozen=True)
class AzuriteService:
    blob_endpoint: str
    queue_endpoint: str
    table_endpoint: str

    @property
    def connection_string(self) -> str:
        return (
            f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={ACCOUNT_KEY};"
            f"BlobEndpoint={self.blob_endpoint};QueueEndpoint={self.queue_endpoint};"
            f"TableEndpoint={self.table_endpoint};"
        )

    @classmethod
    def on_ports(cls, host: str, blob: int, queue: int, table: int, scheme: str = "http") -> AzuriteService:
        return cls(
            blob_endpoint=f"{scheme}://{host}:{blob}/{ACCOUNT}",
            queue_endpoint=f"{scheme}://{host}:{queue}/{ACCOUNT}",
            table_endpoint=f"{scheme}://{host}:{table}/{ACCOUNT}",
        )


def _required() -> bool:
    return os.environ.get("QUEUEING_REQUIRE_AZURITE") == "1"


def _free_ports(n: int) -> list[int]:
    # Bind all at once so the n ports differ; Azurite binds them a moment later (a small race).
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind((HOST, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _accepting(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex((HOST, port)) == 0


@contextlib.contextmanager
def _npm_azurite(location: Path, tls: tuple[Path, Path] | None = None) -> Iterator[AzuriteService]:
    """``tls=(cert, key)``: HTTPS, and OAuth bearer tokens accepted (Azurite checks their issuer,
    audience and lifetime, not their signature) besides the account key."""
    blob, queue, table = _free_ports(3)
    log = location / "azurite.log"
    cmd = [
        str(AZURITE_BIN),
        "--silent",
        "--location", str(location),
        "--loose",
        "--skipApiVersionCheck",
        "--disableTelemetry",
        "--blobHost", HOST,
        "--queueHost", HOST,
        "--tableHost", HOST,
        "--blobPort", str(blob),
        "--queuePort", str(queue),
        "--tablePort", str(table),
    ]  # fmt: skip
    if tls is not None:
        cmd += ["--oauth", "basic", "--cert", str(tls[0]), "--key", str(tls[1])]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=location)
    try:
        deadline = time.monotonic() + READY_TIMEOUT
        while not all(_accepting(p) for p in (blob, queue, table)):
            if proc.poll() is not None:
                raise RuntimeError(
                    f"azurite exited with {proc.returncode}: {log.read_text(errors='replace')}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(f"azurite did not listen within {READY_TIMEOUT}s: {log.read_text()}")
            time.sleep(0.05)
        yield AzuriteService.on_ports(HOST, blob, queue, table, "https" if tls else "http")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def _container_class() -> Any | None:
    # testcontainers is optional and not a dependency; its module moved between releases.
    for module in ("testcontainers.azurite", "testcontainers.community.azurite"):
        with contextlib.suppress(ImportError):
            return __import__(module, fromlist=["AzuriteContainer"]).AzuriteContainer
    return None


@contextlib.contextmanager
def _docker_azurite(container_class: Any) -> Iterator[AzuriteService]:
    container = container_class(AZURITE_IMAGE).with_command(
        "azurite --blobHost 0.0.0.0 --queueHost 0.0.0.0 --tableHost 0.0.0.0"
        " --loose --skipApiVersionCheck --disableTelemetry"
    )
    with container as running:
        host = running.get_container_host_ip()
        yield AzuriteService.on_ports(
            host,
            int(running.get_exposed_port(10000)),
            int(running.get_exposed_port(10001)),
            int(running.get_exposed_port(10002)),
        )


def _unavailable(reason: str) -> NoReturn:
    if _required():
        pytest.fail(f"QUEUEING_REQUIRE_AZURITE=1 but Azurite is unavailable: {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def azurite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AzuriteService]:
    """A running Azurite; ``.connection_string``, ``.queue_endpoint``, ``.table_endpoint``."""
    if AZURITE_BIN.exists():
        with _npm_azurite(tmp_path_factory.mktemp("azurite")) as service:
            yield service
        return
    container_class = _container_class()
    if container_class is None:
        _unavailable(f"Azurite is not installed: {AZURITE_BIN} is missing; run `npm ci` in {ROOT}")
    with contextlib.ExitStack() as stack:
        try:
            service = stack.enter_context(_docker_azurite(container_class))
        except Exception as exc:  # DockerException at once when no engine answers
            _unavailable(
                f"Azurite is not installed ({AZURITE_BIN} missing; run `npm ci`) and Docker failed: {exc}"
            )
        yield service


@pytest.fixture(scope="session")
def azurite_oauth(
    tmp_path_factory: pytest.TempPathFactory, test_certificates: Any
) -> Iterator[AzuriteService]:
    """A second Azurite, over HTTPS with OAuth on, for tests that sign in with Entra tokens (npm only)."""
    if not AZURITE_BIN.exists():
        _unavailable(f"Azurite is not installed: {AZURITE_BIN} is missing; run `npm ci` in {ROOT}")
    tls = (test_certificates.cert, test_certificates.key)
    with _npm_azurite(tmp_path_factory.mktemp("azurite-oauth"), tls) as service:
        yield service
