"""The contract suite on SQS: moto's server (started once per session on a free port) for the queues,
the side stores (history, pause/circuit state, delayed messages) in a SQLite file per test."""

from __future__ import annotations

import atexit
import logging
import shutil
import socket
import tempfile
from datetime import timedelta
from typing import Any

from queueing_core.runtime import Runtime
from queueing_core.transport import Provider

from .harness import Harness, lease_lapses, native_dead_letters

_server: dict[str, Any] = {}


def moto_endpoint() -> str:
    """The moto server's URL, started on first use and stopped when the interpreter exits."""
    if "url" not in _server:
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one access line per request otherwise
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        server.start()
        atexit.register(server.stop)
        _server["url"] = f"http://127.0.0.1:{port}"
    return str(_server["url"])


def sqs_client() -> Any:
    import boto3

    # moto takes any keys; explicit ones keep the test away from real credentials in the environment
    return boto3.client(
        "sqs",
        endpoint_url=moto_endpoint(),
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )


def make_harness() -> Harness:
    from queueing_core.providers.sql.history import SideStores
    from queueing_core.providers.sqs import SqsProvider

    folder = tempfile.mkdtemp(prefix="queueing-sqs-")
    url = f"sqlite:///{folder}/side.db"
    made: list[SqsProvider] = []

    async def make() -> Provider:
        prov = SqsProvider(
            sqs_client(),
            stores=SideStores(url),
            receive_wait=0,
            dispatcher_options={"retry_delay": timedelta(milliseconds=100)},
        )
        made.append(prov)
        return prov

    async def inject(rt: Runtime, queue: str, raw: bytes) -> None:
        prov = rt.provider
        assert isinstance(prov, SqsProvider)
        prov.client.send_message(QueueUrl=await prov._url(queue), MessageBody=raw.decode())

    async def cleanup() -> None:
        for prov in made:
            await prov.close()
        shutil.rmtree(folder, ignore_errors=True)

    # a standard queue promises no order
    return Harness(
        "sqs",
        make_provider=make,
        inject_raw=inject,
        ordered=False,
        cleanup=cleanup,
        lose_lease=lease_lapses,
        dead_letters=native_dead_letters,
    )
