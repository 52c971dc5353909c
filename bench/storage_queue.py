"""Storage Queues on Azurite: the kit's processing rate against a plain SDK receive+delete loop.

    .venv/bin/python bench/storage_queue.py [--messages 2000] [--rounds 3]

Both drain the same kind of queue (N pre-sent messages) in the same run, interleaved, with the same
concurrency: at most 32 messages in hand, the next receive as soon as half of them are done (while
the rest are still being handled or deleted), deletes concurrent. That is the kit worker's shape
(max_concurrency 32, prefetch 1, a refill at half); the SDK loop used to receive a page only after
the previous page's deletes had all finished. The kit does more per message: it decodes and
validates the envelope, runs the pipeline, and writes each message's history to Azure Tables.
Target: kit / SDK >= 0.8.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import os
import socket
import statistics
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

from azure.core.exceptions import ResourceExistsError
from azure.storage.queue.aio import QueueClient

from queueing_core import QueueingApp, QueueMessage, QueueNaming, queue
from queueing_core.connections import StorageConnection
from queueing_core.providers.storage_queue import StorageQueueProvider
from queueing_core.runtime import Runtime
from queueing_core.worker import Worker

ROOT = Path(__file__).resolve().parent.parent
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="  # Azurite's
CONCURRENCY = 32


@queue("bench", max_concurrency=CONCURRENCY)
class Tick(QueueMessage):
    n: int


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def start_azurite() -> tuple[subprocess.Popen[bytes], str]:
    blob, q, table = free_ports(3)
    proc = subprocess.Popen(
        [
            str(ROOT / "node_modules/.bin/azurite"),
            "--silent",
            "--location",
            tempfile.mkdtemp(),
            "--loose",
            "--skipApiVersionCheck",
            "--disableTelemetry",
            "--blobPort",
            str(blob),
            "--queuePort",
            str(q),
            "--tablePort",
            str(table),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", q), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.1)
    conn = (
        f"DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;AccountKey={KEY};"
        f"QueueEndpoint=http://127.0.0.1:{q}/devstoreaccount1;"
        f"TableEndpoint=http://127.0.0.1:{table}/devstoreaccount1;"
    )
    return proc, conn


async def fill(conn: str, name: str, n: int, body: str) -> None:
    async with QueueClient.from_connection_string(conn, name) as c:
        with contextlib.suppress(ResourceExistsError):
            await c.create_queue()
        sem = asyncio.Semaphore(64)

        async def one() -> None:
            async with sem:
                await c.send_message(body)

        await asyncio.gather(*(one() for _ in range(n)))


async def sdk_round(conn: str, n: int) -> float:
    """The plain SDK with the kit worker's concurrency: up to 32 messages in hand, a new receive as soon
    as half the slots are free (while the deletes of the others are still running), deletes concurrent."""
    name = f"sdk{uuid.uuid4().hex[:10]}"
    await fill(conn, name, n, base64.b64encode(b'{"n": 1}').decode())
    async with QueueClient.from_connection_string(conn, name) as c:
        done = 0
        in_hand = 0
        freed = asyncio.Event()
        tasks: set[asyncio.Task[None]] = set()

        async def delete(m: object) -> None:
            nonlocal done, in_hand
            await c.delete_message(m)
            done += 1
            in_hand -= 1
            freed.set()

        start = time.perf_counter()
        received = 0
        while received < n:
            while CONCURRENCY - in_hand < CONCURRENCY // 2:
                freed.clear()
                await freed.wait()
            want = CONCURRENCY - in_hand
            page = [
                m
                async for m in c.receive_messages(
                    messages_per_page=want, visibility_timeout=30, max_messages=want
                )
            ]
            received += len(page)
            in_hand += len(page)
            for m in page:
                t = asyncio.create_task(delete(m))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
        while done < n:
            freed.clear()
            await freed.wait()
        elapsed = time.perf_counter() - start
        await c.delete_queue()
    return n / elapsed


async def kit_round(conn: str, n: int) -> float:
    tag = uuid.uuid4().hex[:8]
    app = QueueingApp("bench", naming=QueueNaming(prefix=f"kit{tag}-"))
    handled = 0
    finished = asyncio.Event()

    @app.handler()
    async def handle(msg: Tick) -> None:
        nonlocal handled
        handled += 1
        if handled == n:
            finished.set()

    provider = StorageQueueProvider(
        StorageConnection(conn), control_table=f"ctl{tag}", tracker_table=f"hist{tag}"
    )
    rt = Runtime(app, provider)
    await rt.open()
    for start in range(0, n, 500):
        await app.enqueue_many([Tick(n=i) for i in range(start, min(n, start + 500))])
    worker = Worker(rt, poll_min=0.01, poll_max=0.2, batch_size=CONCURRENCY)
    began = time.perf_counter()
    await worker.start()
    await finished.wait()
    elapsed = time.perf_counter() - began
    await worker.shutdown()
    await rt.close()
    return n / elapsed


async def main(n: int, rounds: int) -> None:
    proc, conn = start_azurite()
    try:
        sdk: list[float] = []
        kit: list[float] = []
        print(
            f"Storage Queues on Azurite; load average at start {os.getloadavg()[0]:.2f} "
            f"on {os.cpu_count()} cores"
        )
        for r in range(rounds):  # interleaved (order alternating), so machine noise hits both alike
            first, second = (sdk_round, kit_round) if r % 2 == 0 else (kit_round, sdk_round)
            for run in (first, second):
                rate = await run(conn, n)
                (sdk if run is sdk_round else kit).append(rate)
                load = os.getloadavg()[0]
                print(
                    f"  round {r + 1}/{rounds}  {run.__name__:<10} {rate:6.0f} msg/s  (load {load:.2f})",
                    flush=True,
                )
    finally:
        proc.terminate()
        proc.wait(10)
    s, k = statistics.median(sdk), statistics.median(kit)
    print(f"{'contender':<34}{'msg/s (median)':>16}  rounds")
    print(f"{'plain SDK receive+delete':<34}{s:>16.0f}  {', '.join(f'{x:.0f}' for x in sdk)}")
    print(f"{'queueing-kit worker (+ history)':<34}{k:>16.0f}  {', '.join(f'{x:.0f}' for x in kit)}")
    print(f"ratio kit/SDK = {k / s:.2f}  (target >= 0.8; {n} messages, concurrency {CONCURRENCY}, Azurite)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 300 messages, 1 round")
    args = parser.parse_args()
    if args.quick:
        args.messages, args.rounds = 300, 1
    asyncio.run(main(args.messages, args.rounds))
