"""Rights on Service Bus: the in-memory Service Bus refuses what a credential's rights do not allow, with
the exception the real SDK raises for the service's refusal, and the provider turns a refusal into one
line naming the role instead of failing to open.

The administration refusal is held against the real ``ServiceBusAdministrationClient``: its own HTTP
pipeline is pointed at a local server answering the service's 401, and the fake must raise the same
exception type, status and text.
"""

from __future__ import annotations

import logging
import re
import time
from datetime import timedelta
from urllib.parse import urlsplit, urlunsplit

import pytest
from aiohttp import web
from azure.core.credentials import AccessToken
from azure.core.exceptions import ClientAuthenticationError
from azure.core.pipeline.transport import AioHttpTransport
from azure.servicebus import ServiceBusMessage
from azure.servicebus.aio.management import ServiceBusAdministrationClient
from azure.servicebus.exceptions import ServiceBusAuthorizationError

from queueing_core import QueueingApp, QueueMessage, queue
from queueing_core.errors import MissingPermission
from queueing_core.fakes.servicebus import (
    LISTEN,
    MANAGE,
    SEND,
    FakeServiceBusAdministrationClient,
    FakeServiceBusClient,
    FakeServiceBusNamespace,
    rights_of_roles,
)
from queueing_core.ops.service import OpsService
from queueing_core.providers.servicebus import PEEK_COUNT_LIMIT, ServiceBusProvider
from queueing_core.runtime import Runtime

DATA_RECEIVER = "4f6d3b9b-027b-4f4c-9142-0e5a2a2247e0"
DATA_SENDER = "69a216fc-b8fb-44d8-bc22-1f3c2cd27a39"
DATA_OWNER = "090c5cfd-751d-490a-894a-3ce6f1109419"
PROVISIONED = rights_of_roles([DATA_RECEIVER, DATA_SENDER])  # what infra/modules/roles.bicep grants


@queue("rights-jobs", max_attempts=3)
class RightsJob(QueueMessage):
    n: int = 0


def test_roles_map_to_the_rights_azure_documents() -> None:
    assert rights_of_roles([DATA_OWNER]) == {MANAGE, SEND, LISTEN}
    assert {SEND, LISTEN} == PROVISIONED
    contributor = "b24988ac-6180-42a0-ab88-20f7382dd24c"  # control plane only: no data rights
    assert rights_of_roles([contributor]) == set()


# -- the administration API's 401, held against the real SDK ---------------------------------------------


class _Token:
    async def get_token(self, *scopes: str, **kwargs: object) -> AccessToken:
        return AccessToken("token", int(time.time()) + 3600)

    async def close(self) -> None:
        pass


class _ToLocal(AioHttpTransport):
    """The SDK's own aiohttp transport, sent to a local server instead of <ns>.servicebus.windows.net."""

    def __init__(self, port: int) -> None:
        super().__init__()
        self.port = port

    async def send(self, request, **kwargs):  # type: ignore[no-untyped-def]
        u = urlsplit(request.url)
        request.url = urlunsplit(("http", f"127.0.0.1:{self.port}", u.path, u.query, ""))
        return await super().send(request, **kwargs)


@pytest.fixture
async def answering_401():
    """A server answering every call with the body the fake gives its 401 (the service's XML error)."""
    bodies: list[str] = []

    async def handler(request: web.Request) -> web.Response:
        return web.Response(status=401, body=bodies[-1], content_type="application/xml")

    server = web.Application()
    server.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(server)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    admin = ServiceBusAdministrationClient("fake.servicebus.windows.net", _Token(), transport=_ToLocal(port))
    yield admin, bodies
    await admin.close()
    await runner.cleanup()


def _stable(text: str) -> str:
    return re.sub(r"TrackingId:[^,]*,|Timestamp:[^<]*", "", text)


@pytest.mark.parametrize("call", ["create_queue", "get_queue_runtime_properties", "get_queue"])
async def test_without_manage_the_fake_refuses_as_the_real_sdk_does(answering_401, call) -> None:
    real_admin, bodies = answering_401
    ns = FakeServiceBusNamespace(fully_qualified_namespace="fake.servicebus.windows.net")
    fake_admin = FakeServiceBusAdministrationClient(ns, rights=PROVISIONED)

    with pytest.raises(ClientAuthenticationError) as fake:
        await getattr(fake_admin, call)("orders")
    bodies.append(fake.value.response.text())  # the service's answer, as the fake worded it
    with pytest.raises(ClientAuthenticationError) as real:
        await getattr(real_admin, call)("orders")

    assert type(fake.value) is type(real.value)
    assert (
        (fake.value.status_code, fake.value.reason)
        == (real.value.status_code, real.value.reason)
        == (
            401,
            "Unauthorized",
        )
    )
    assert _stable(str(fake.value)) == _stable(str(real.value))
    assert "Manage" in str(fake.value)


async def test_with_manage_the_fake_administers() -> None:
    ns = FakeServiceBusNamespace()
    admin = FakeServiceBusAdministrationClient(ns, rights=rights_of_roles([DATA_OWNER]))
    await admin.create_queue("orders")
    assert (await admin.get_queue_runtime_properties("orders")).active_message_count == 0


async def test_links_need_send_and_listen() -> None:
    ns = FakeServiceBusNamespace()
    await FakeServiceBusAdministrationClient(ns).create_queue("orders")
    receive_only = FakeServiceBusClient(ns, rights=rights_of_roles([DATA_RECEIVER]))
    with pytest.raises(ServiceBusAuthorizationError, match="'Send' claim"):
        await receive_only.get_queue_sender("orders").send_messages(ServiceBusMessage("x"))
    send_only = FakeServiceBusClient(ns, rights=rights_of_roles([DATA_SENDER]))
    await send_only.get_queue_sender("orders").send_messages(ServiceBusMessage("x"))
    with pytest.raises(ServiceBusAuthorizationError, match="'Listen' claim"):
        await send_only.get_queue_receiver("orders").receive_messages(max_wait_time=1)
    with pytest.raises(ServiceBusAuthorizationError, match="'Listen' claim"):
        await send_only.get_queue_receiver("orders").peek_messages()
    [m] = await receive_only.get_queue_receiver("orders").receive_messages(max_wait_time=1)
    assert str(m) == "x"


# -- the provider with exactly the provisioned rights ---------------------------------------------------


def _provider(ns: FakeServiceBusNamespace, rights: frozenset[str], *, create: bool) -> ServiceBusProvider:
    from queueing_core.control import MemoryControlStore
    from queueing_core.tracking import MemoryTracker

    return ServiceBusProvider(
        client=FakeServiceBusClient(ns, rights=rights),
        admin=FakeServiceBusAdministrationClient(ns, rights=rights),
        control=MemoryControlStore(),
        tracker=MemoryTracker(),
        auto_create=create,
    )


def _app() -> tuple[QueueingApp, list[int]]:
    app = QueueingApp("rights")
    done: list[int] = []

    @app.handler()
    async def handle(msg: RightsJob) -> None:
        done.append(msg.n)

    return app, done


async def _provisioned_namespace() -> FakeServiceBusNamespace:
    ns = FakeServiceBusNamespace()
    await FakeServiceBusAdministrationClient(ns).create_queue("rights-jobs", max_delivery_count=3)
    return ns


async def test_creation_on_without_manage_logs_one_line_naming_the_role_and_still_runs(caplog) -> None:
    ns = await _provisioned_namespace()
    app, done = _app()
    rt = Runtime(app, _provider(ns, PROVISIONED, create=True))
    with caplog.at_level(logging.ERROR, logger="queueing.servicebus"):
        await rt.open()  # no exception: the queues exist, and a 401 must not fail every invocation
    [record] = [r for r in caplog.records if r.levelno >= logging.ERROR]
    line = record.getMessage()
    assert "\n" not in line
    assert "Azure Service Bus Data Owner" in line
    assert "QUEUEING_SERVICEBUS_CREATE_QUEUES=false" in line
    await app.enqueue(RightsJob(n=1))
    [delivery] = await rt.provider.receive(app.subscription("RightsJob"), 1)
    settlement = await rt.process(delivery)
    await rt.provider.settle([settlement])
    assert done == [1]
    await rt.close()


async def test_creation_off_makes_no_management_call(caplog) -> None:
    ns = await _provisioned_namespace()
    app, _ = _app()
    rt = Runtime(app, _provider(ns, PROVISIONED, create=False))
    with caplog.at_level(logging.WARNING):
        await rt.open()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    await rt.close()


async def test_a_missing_send_right_is_one_error_naming_data_sender() -> None:
    ns = await _provisioned_namespace()
    app, _ = _app()
    rt = Runtime(app, _provider(ns, rights_of_roles([DATA_RECEIVER]), create=False))
    await rt.open()
    with pytest.raises(MissingPermission) as caught:
        await app.enqueue(RightsJob())
    assert caught.value.role == "Azure Service Bus Data Sender"
    assert "\n" not in str(caught.value)
    await rt.close()


async def test_stats_without_manage_count_by_peeking_and_say_so() -> None:
    ns = await _provisioned_namespace()
    app, _ = _app()
    rt = Runtime(app, _provider(ns, PROVISIONED, create=False))
    await rt.open()
    for n in range(3):
        await app.enqueue(RightsJob(n=n))
    await app.enqueue(RightsJob(n=9), delay=timedelta(hours=1))
    summary = await OpsService(rt).summary()
    [q] = summary.queues
    assert q.transport_counts == {"active": 3, "scheduled": 1, "dead_lettered": 0}
    [note] = summary.notes
    assert "peeking" in note
    assert "Azure Service Bus Data Owner" in note
    assert str(PEEK_COUNT_LIMIT) in note
    await rt.close()


async def test_stats_with_manage_read_runtime_properties_without_a_note() -> None:
    ns = await _provisioned_namespace()
    app, _ = _app()
    rt = Runtime(app, _provider(ns, rights_of_roles([DATA_OWNER]), create=True))
    await rt.open()
    await app.enqueue(RightsJob())
    summary = await OpsService(rt).summary()
    assert summary.queues[0].transport_counts == {"active": 1, "scheduled": 0, "dead_lettered": 0}
    assert summary.notes == []
    await rt.close()
