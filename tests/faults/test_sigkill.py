"""Real SIGKILLs at chosen steps: a child process prepares one message, runs a sequence, and the kernel
kills it at that step (``Injector`` mode ``kill``); this process then checks what the fault cases
check (the message is found, the history agrees, the operator's action repeats and succeeds)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.contract.harness import Harness
from tests.services import POSTGRES_URL, RABBITMQ_URL, drop_schema, fresh_prefix, require

from .kits import KITS
from .sequences import BY_NAME, Ctx, fault_app
from .table import STEPS
from .test_faults import CONVERGES_WITHIN, _disagreement, _recover, _runtime, _where

pytestmark = pytest.mark.asyncio(loop_scope="session")

#: (provider, sequence, step): a copy or forward made and the original not yet removed, and an
#: operator's retry between its history statement and its transport statement
KILLS = [
    ("sqs", "dead_letter", "sqs.delete_message_batch"),
    ("rabbitmq", "delayed_forward", "delayed.remove"),
    ("storage_queue", "delayed_forward", "delayed.remove"),
    ("sqlite", "operator_retry", "sql.execute"),
]


def provider_for(config: dict[str, Any]) -> Any:
    """The same provider in both processes, from plain settings."""
    name = config["provider"]
    if name == "sqlite":
        from queueing_core.providers.sql import SqlProvider

        return SqlProvider(config["url"], maintenance_interval=0.2)
    from queueing_core.providers.sql.history import SideStores

    if name == "storage_queue":
        from queueing_core.connections import StorageConnection
        from queueing_core.providers.storage_queue import StorageQueueProvider

        return StorageQueueProvider(
            StorageConnection(config["azurite"]),
            delayed_stores=SideStores(config["url"]),
            control_table=config["control_table"],
            tracker_table=config["tracker_table"],
        )
    if name == "sqs":
        import boto3

        from queueing_core.providers.sqs import SqsProvider

        client = boto3.client(
            "sqs",
            endpoint_url=config["endpoint"],
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )
        return SqsProvider(client, stores=SideStores(config["url"]), receive_wait=0)
    from queueing_core.providers.rabbitmq import RabbitMQProvider

    return RabbitMQProvider(
        RABBITMQ_URL, stores=SideStores(POSTGRES_URL, schema=config["schema"]), idle_timeout=0.5
    )


def harness_for(config: dict[str, Any]) -> Harness:
    async def make() -> Any:
        return provider_for(config)

    async def inject(*_: Any) -> None:
        raise NotImplementedError

    h = Harness(config["provider"], make_provider=make, inject_raw=inject)
    h.app = lambda: _app(config)  # type: ignore[method-assign]
    return h


def _app(config: dict[str, Any]) -> Any:
    from queueing_core import QueueingApp, QueueNaming

    return QueueingApp("faults", naming=QueueNaming(prefix=config["prefix"]))


async def child(config: dict[str, Any]) -> None:
    """Runs in the child: prepare, then act until the kernel kills this process at the step."""
    from .inject import Injector

    h = harness_for(config)
    seq, kit = BY_NAME[config["sequence"]], KITS[config["provider"]]
    app = h.app()
    mode: dict[str, str] = {"handler": "ok"}
    sent: list[uuid.UUID] = []
    fault_app(app, mode, [], sent)
    rt = await _runtime(h, app, Path(config["journal"]))
    ctx = Ctx(app, rt, mode)
    await seq.prepare(ctx)
    print(json.dumps({"message_id": str(ctx.mid)}), flush=True)
    injector = Injector(kit.points(), mode="kill", at=config["step"])
    with injector.installed(rt), injector.armed_for():
        await seq.act(ctx)
    print(json.dumps({"survived": injector.calls}), flush=True)


@pytest.mark.parametrize(
    ("provider", "sequence", "step_name"), KILLS, ids=[f"{p}-{s}-{n}" for p, s, n in KILLS]
)
async def test_sigkill_at_a_step(provider: str, sequence: str, step_name: str, tmp_path, request) -> None:
    steps = STEPS[(sequence, provider)]
    step = len(steps) - 1 - list(reversed(steps)).index(step_name)  # its last occurrence
    config: dict[str, Any] = {
        "provider": provider,
        "sequence": sequence,
        "step": step,
        "prefix": fresh_prefix(),
        # the killed process and the one after it keep history journals on one machine: one directory
        "journal": str(tmp_path / "journal"),
    }
    if provider == "rabbitmq":
        require("RabbitMQ", "127.0.0.1", 5672)
        config["schema"] = f"qk_{uuid.uuid4().hex[:10]}"
    else:
        config["url"] = f"sqlite:///{tmp_path}/kill.db"
    if provider == "storage_queue":  # (the delayed store in the SQLite file above, as in the fault suite)
        config["azurite"] = request.getfixturevalue("azurite").connection_string
        config["control_table"] = f"ctl{uuid.uuid4().hex[:10]}"
        config["tracker_table"] = f"hist{uuid.uuid4().hex[:10]}"
    if provider == "sqs":
        from tests.contract.harness_sqs import moto_endpoint

        config["endpoint"] = moto_endpoint()
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "tests.faults.test_sigkill",
            json.dumps(config),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=os.getcwd(),
        )
        out, err = await asyncio.wait_for(proc.communicate(), 120)
        assert proc.returncode == -signal.SIGKILL, (proc.returncode, out.decode(), err.decode()[-3000:])
        mid = uuid.UUID(json.loads(out.decode().splitlines()[0])["message_id"])

        h = harness_for(config)
        seq, kit = BY_NAME[sequence], KITS[provider]
        app = h.app()
        mode: dict[str, str] = {"handler": "ok"}
        fault_app(app, mode, [], [])
        rt = await _runtime(h, app, Path(config["journal"]))
        ctx = Ctx(app, rt, mode, message_id=mid)
        try:
            assert await rt.history.settle(CONVERGES_WITHIN), f"history backlog left: {rt.history.backlog}"
            status, places, _ = await _where(kit, rt, mid, seq.queue)
            assert status in ("Succeeded", "Expired") or any(places.values()), f"lost: {status} {places}"
            if sequence != "operator_retry":
                assert _disagreement(status, places) is None, (status, places)
            await _recover(ctx, seq, kit)
        finally:
            await rt.close()
    finally:
        if "schema" in config:
            await drop_schema(config["schema"])


if __name__ == "__main__":
    asyncio.run(child(json.loads(sys.argv[1])))
