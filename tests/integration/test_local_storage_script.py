"""`make local-storage` (scripts/local-storage.sh) runs the example app on Storage Queues over Azurite
end to end, on the port it is given, and refuses to start when that port is taken."""

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


def need_azurite() -> None:
    if not os.path.exists("node_modules/.bin/azurite"):
        if os.environ.get("QUEUEING_REQUIRE_AZURITE") == "1":
            pytest.fail("node_modules/.bin/azurite is missing: run `npm ci`")
        pytest.skip("Azurite is not installed: run `npm ci`")


def run_script(*args: str, blob: int, queue: int, table: int, timeout: float = 240):
    env = {
        **os.environ,
        "AZURITE_BLOB_PORT": str(blob),
        "AZURITE_QUEUE_PORT": str(queue),
        "AZURITE_TABLE_PORT": str(table),
    }
    return subprocess.run(
        ["scripts/local-storage.sh", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_local_storage_runs_the_example_end_to_end_on_the_given_port():
    need_azurite()
    blob, queue, table, api = free_ports(4)
    done = run_script("--once", "--orders", "4", "--port", str(api), blob=blob, queue=queue, table=table)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "all 12 messages finished on Storage Queues" in done.stdout
    assert f"ops API on http://127.0.0.1:{api}/api/_system/queueing (Storage Queues" in done.stdout


def test_local_storage_stops_with_a_clear_error_when_its_port_is_taken():
    need_azurite()
    blob, queue, table = free_ports(3)
    with socket.socket() as squatter:  # another instance (say `make serve`) holds the port
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        done = run_script("--once", "--port", str(port), blob=blob, queue=queue, table=table, timeout=60)
    assert done.returncode == 1
    assert f"port {port} (ops API) is already in use" in done.stderr
    assert "enqueued" not in done.stdout  # nothing was sent anywhere
    # nothing was started either: Azurite's ports are still free
    for p in (blob, queue, table):
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))
