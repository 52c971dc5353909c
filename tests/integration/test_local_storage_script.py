"""The README's local Storage Queues command (SPEC E6) really runs the example app end to end."""

import os
import socket
import subprocess

import pytest

pytestmark = pytest.mark.slow


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def test_local_storage_runs_the_example_end_to_end():
    if not os.path.exists("node_modules/.bin/azurite"):
        if os.environ.get("QUEUEING_REQUIRE_AZURITE") == "1":
            pytest.fail("node_modules/.bin/azurite is missing: run `npm ci`")
        pytest.skip("Azurite is not installed: run `npm ci`")
    blob, queue, table, api = free_ports(4)
    env = {
        **os.environ,
        "AZURITE_BLOB_PORT": str(blob),
        "AZURITE_QUEUE_PORT": str(queue),
        "AZURITE_TABLE_PORT": str(table),
        "API_PORT": str(api),
    }
    done = subprocess.run(
        ["scripts/local-storage.sh", "--once", "--orders", "4"],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "all 12 messages finished on Storage Queues" in done.stdout
