"""Storage Queues on Azurite behind TCP proxies: how long processing and history take to recover.

    .venv/bin/python bench/outage_recovery.py [--outage 5] [--history-outage 60]

1. Both endpoints (queues and Tables) are cut for ``--outage`` seconds while a backlog drains.
2. Only Tables (the history store) is cut for ``--history-outage`` seconds.

Each prints: the time from the service answering again to the first handler run after it (processing
recovery); how many history records were held during the cut and when the last of them was written
(history recovery); and when every message's history held its outcome (this includes messages whose
receive or settlement was cut off, which the queue shows again only when their lease lapses).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from storage_queue import KEY, start_azurite  # noqa: E402

from queueing_core import MessageStatus, QueueingApp, QueueMessage, QueueNaming, queue  # noqa: E402
from queueing_core.connections import StorageConnection  # noqa: E402
from queueing_core.providers.storage_queue import StorageQueueProvider  # noqa: E402
from queueing_core.runtime import Runtime  # noqa: E402
from queueing_core.worker import Worker  # noqa: E402
from tests.tcp_proxy import TcpProxy  # noqa: E402


@queue("outage", max_concurrency=8)
class Beat(QueueMessage):
    n: int


def port_of(conn: str, key: str) -> int:
    part = next(p for p in conn.split(";") if p.startswith(key + "="))
    return int(part.split(":")[2].split("/")[0])


async def run(conn: str, outage: float, tables_only: bool, messages: int) -> dict[str, float]:
    queues = TcpProxy("127.0.0.1", port_of(conn, "QueueEndpoint"))
    tables = TcpProxy("127.0.0.1", port_of(conn, "TableEndpoint"))
    qport, tport = await queues.start(), await tables.start()
    proxied = (
        f"DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;AccountKey={KEY};"
        f"QueueEndpoint=http://127.0.0.1:{qport}/devstoreaccount1;"
        f"TableEndpoint=http://127.0.0.1:{tport}/devstoreaccount1;"
    )
    tag = uuid.uuid4().hex[:8]
    runs: list[float] = []
    app = QueueingApp("outage", naming=QueueNaming(prefix=f"o{tag}-"))

    @app.handler()
    async def handle(msg: Beat) -> None:
        runs.append(time.monotonic())
        await asyncio.sleep(0.05)

    provider = StorageQueueProvider(
        StorageConnection(proxied), control_table=f"ctl{tag}", tracker_table=f"hist{tag}"
    )
    rt = Runtime(app, provider)
    await rt.open()
    ids = [r.message_id for r in await app.enqueue_many([Beat(n=i) for i in range(messages)])]
    worker = Worker(rt, poll_min=0.05, poll_max=1.0)
    await worker.start()
    await asyncio.sleep(2.0)
    cut = [tables] if tables_only else [queues, tables]
    for p in cut:
        await p.cut()
    held = 0
    ends = time.monotonic() + outage
    while time.monotonic() < ends:
        held = max(held, rt.history.backlog)
        await asyncio.sleep(0.05)
    for p in cut:
        await p.restore()
    back = time.monotonic()
    drained = None
    first_run = None
    while (first_run is None or drained is None) and time.monotonic() - back < 120:
        after = [t for t in runs if t > back]
        first_run = min(after) - back if after else None
        if drained is None and rt.history.backlog == 0:
            drained = time.monotonic() - back
        await asyncio.sleep(0.01)
    # history converged: every message Succeeded (counted from the history table every 0.2 s)
    converged = None
    while converged is None and time.monotonic() - back < 300:
        counts = await rt.tracker.counts()
        if counts.get(("outage", MessageStatus.SUCCEEDED.value), 0) >= len(ids):
            converged = time.monotonic() - back
        else:
            await asyncio.sleep(0.2)
    if converged is None:
        print(f"history did not converge; counts: {await rt.tracker.counts()}", file=sys.stderr)
    await worker.shutdown()
    for q in (provider.physical("outage"), provider.poison_name("outage")):
        await provider.client(q).delete_queue()
    await rt.close()
    await queues.stop()
    await tables.stop()
    return {
        "first_run_after": -1.0 if first_run is None else first_run,
        "held": float(held),
        "backlog_written_after": -1.0 if drained is None else drained,
        "history_converged_after": -1.0 if converged is None else converged,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--outage", type=float, default=5.0)
    ap.add_argument("--history-outage", type=float, default=60.0)
    ap.add_argument("--messages", type=int, default=3000)
    args = ap.parse_args()
    proc, conn = start_azurite()
    try:
        a = asyncio.run(run(conn, args.outage, tables_only=False, messages=args.messages))
        print(
            f"queues+tables cut {args.outage:.0f}s: first handler run {a['first_run_after']:.1f}s after the "
            f"service was back; {a['held']:.0f} history records held during the cut, all written "
            f"{a['backlog_written_after']:.1f}s after; every message's history final "
            f"{a['history_converged_after']:.1f}s after"
        )
        b = asyncio.run(run(conn, args.history_outage, tables_only=True, messages=args.messages))
        print(
            f"tables only cut {args.history_outage:.0f}s: {b['held']:.0f} history records held, all written "
            f"{b['backlog_written_after']:.1f}s after Tables was back; every message's history final "
            f"{b['history_converged_after']:.1f}s after"
        )
    finally:
        proc.terminate()
        proc.wait()


if __name__ == "__main__":
    main()
