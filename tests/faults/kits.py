"""The providers of the fault suite: for each, the calls where it can fail (its SDK's or driver's own
exception) and where the transport holds a message, read from the transport itself.

Each provider is one harness of the contract suite (``tests/contract/harness*.py``): a provider added
there joins this suite by adding its call points and its ``places`` here.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from uuid import UUID

from queueing_core.runtime import Runtime

from .inject import CallPoint

Places = Callable[[Runtime, str, UUID], Awaitable[dict[str, int]]]


@dataclass(frozen=True)
class Kit:
    name: str
    points: Callable[[], list[CallPoint]]
    places: Places
    #: False: the transport lives in this process (a crash takes it along; the same object goes on)
    durable: bool = True
    #: why no step of this provider can be made to fail (its baselines run all the same)
    no_faults: str = ""


# -- errors as each SDK raises them -------------------------------------------------------------------
def _sql_error() -> BaseException:
    import sqlalchemy as sa

    return sa.exc.OperationalError("INSERT ... (injected)", {}, ConnectionResetError("connection reset"))


def _pg_error() -> BaseException:
    import psycopg

    return psycopg.OperationalError("server closed the connection unexpectedly (injected)")


def _sqlite_error() -> BaseException:
    import sqlite3

    return sqlite3.OperationalError("database is locked (injected)")


def _azure_error() -> BaseException:
    from azure.core.exceptions import ServiceRequestError

    return ServiceRequestError("injected: connection reset by peer")


def _servicebus_error() -> BaseException:
    from azure.servicebus.exceptions import ServiceBusConnectionError

    return ServiceBusConnectionError(message="injected: the AMQP link was detached")


def _amqp_error() -> BaseException:
    from aio_pika.exceptions import ChannelInvalidStateError

    return ChannelInvalidStateError("injected: the channel is closed")


def _aws_error() -> BaseException:
    from botocore.exceptions import EndpointConnectionError

    return EndpointConnectionError(endpoint_url="http://sqs.injected")


# -- denials: the service answers, and says no (a right the identity lacks, a publish the broker nacked):
#: not an outage, so the kit counts a failure against the message instead of waiting for the service
def _azure_denied() -> BaseException:
    from azure.core.exceptions import HttpResponseError

    exc = HttpResponseError(message="injected: This request is not authorized to perform this operation")
    exc.status_code, exc.error_code = 403, "AuthorizationPermissionMismatch"
    return exc


def _amqp_denied() -> BaseException:
    from aio_pika.exceptions import DeliveryError
    from pamqp.commands import Basic

    return DeliveryError(None, Basic.Nack())


def _aws_denied() -> BaseException:
    from botocore.exceptions import ClientError

    error = {"Code": "AccessDenied", "Message": "injected: not authorized to perform sqs:SendMessage"}
    return ClientError({"Error": error, "ResponseMetadata": {"HTTPStatusCode": 403}}, "SendMessageBatch")


def _servicebus_denied() -> BaseException:
    from azure.servicebus.exceptions import ServiceBusAuthorizationError

    return ServiceBusAuthorizationError(message="injected: Unauthorized access. 'Send' claim(s) are required")


#: call point -> its SDK's denial (where a sequence's refusal is one: ``Sequence.denied``)
DENIALS: dict[str, Callable[[], BaseException]] = {
    "queue.send_message": _azure_denied,
    "sb.send_messages": _servicebus_denied,
    "amqp.publish": _amqp_denied,
    "sqs.send_message": _aws_denied,
    "sqs.send_message_batch": _aws_denied,
}


def _methods(
    prefix: str, owner: Callable[[Any], Any], names: list[str], error: Callable[[], BaseException] | None
) -> list[CallPoint]:
    return [CallPoint(f"{prefix}.{n}", owner, n, error) for n in names]


# -- history and side stores ----------------------------------------------------------------------------
#: the history's writes, on every tracker (a cancel's record is a compare-and-swap)
_HISTORY_WRITES = ["upsert", "upsert_newer", "reopen", "delete", "change_if_unchanged"]
#: the control store's calls a sequence makes: a cancel's request, and an idempotent type's identity
#: document read and written by compare-and-set (the transports that keep no SQL row for a message)
_CONTROL_CALLS = ["set_cancel", "identity_doc", "put_identity_doc"]


def _tables_history() -> list[CallPoint]:
    """The history and the control state (pauses, circuits, cancellation requests) in Tables."""
    from queueing_core.providers.tables import TablesControlStore, TablesTracker

    return [
        *_methods("history", lambda rt: TablesTracker, _HISTORY_WRITES, _azure_error),
        *_methods("control", lambda rt: TablesControlStore, _CONTROL_CALLS, _azure_error),
    ]


def _delayed_store() -> list[CallPoint]:
    """The SQL delayed store (delays a transport cannot hold itself, and RabbitMQ's and SQS's retries)."""
    from queueing_core.providers.delayed.store import SqlDelayedStore

    delayed = [
        "store_many",  # the seed's
        *("fetch_due", "remove", "release", "increment_failure"),  # the dispatcher's
        *("holds", "copies", "hold", "take_message", "purge"),  # the ops actions'
    ]
    return _methods("delayed", lambda rt: SqlDelayedStore, delayed, _sql_error)


def _sql_side_stores() -> list[CallPoint]:
    from queueing_core.providers.sql.control import SqlControlStore
    from queueing_core.providers.sql.history import SqlHistoryTracker

    return [
        *_methods("history", lambda rt: SqlHistoryTracker, _HISTORY_WRITES, _sql_error),
        *_delayed_store(),
        *_methods("control", lambda rt: SqlControlStore, _CONTROL_CALLS, _sql_error),
    ]


# -- places: where the transport holds a message ----------------------------------------------------------
async def _sql_places(rt: Runtime, queue: str, mid: UUID) -> dict[str, int]:
    rec = await rt.tracker.get(mid)  # the row is the message: a finished one is claimed no more
    if rec is None or rec.status in ("Succeeded", "Cancelled"):
        return {}
    return {"dead": 1} if rec.status in ("DeadLettered", "Expired") else {"queue": 1}


async def _inprocess_places(rt: Runtime, queue: str, mid: UUID) -> dict[str, int]:
    from queueing_core.providers.inprocess import _message_id

    prov: Any = rt.provider
    q = prov._q(queue)
    held = [i for i in (*q.ready, *q.scheduled, *((q.head,) if q.head else ())) if _message_id(i.raw) == mid]
    dead = [s for s in prov.dead_letters.get(queue, []) if s.delivery.envelope.message_id == mid]
    return {"queue": len(held) + q.in_flight, "dead": len(dead)}


async def _storage_places(rt: Runtime, queue: str, mid: UUID) -> dict[str, int]:
    prov: Any = rt.provider  # one message per queue in this suite: the counts are its copies
    stored = (await prov.delayed.counts()).get(prov.physical(queue), 0) if prov.delayed else 0
    return {"queue": await prov.depth(queue), "dead": await prov.depth(queue, poison=True), "delayed": stored}


async def _counted_places(rt: Runtime, queue: str, mid: UUID) -> dict[str, int]:
    """Service Bus, RabbitMQ, SQS: the transport's own counts (one message per queue in this suite)."""
    counts = (await rt.provider.native_counts()).get(queue, {})  # type: ignore[attr-defined]
    dead = counts.get("dead_lettered", 0)
    stored = counts.get("delayed_store", 0) + counts.get("delayed", 0)
    live = sum(v for k, v in counts.items() if k not in ("dead_lettered", "delayed_store", "delayed"))
    return {"queue": live, "dead": dead, "delayed": stored}


# -- the kits ----------------------------------------------------------------------------------------------
def _sql_points(driver_error: Callable[[], BaseException]) -> list[CallPoint]:
    """SQLAlchemy's statements, and the commits of its transactions: the dialect's commit on the
    driver's connection, which fails (or loses its answer) with the driver's own error, as a commit
    does whose connection drops (SQLAlchemy wraps it, then rolls back what it can)."""
    from sqlalchemy.ext.asyncio import AsyncConnection

    def dialect(rt: Runtime) -> type:
        return type(rt.provider.engine.sync_engine.dialect)  # type: ignore[attr-defined]

    return [
        CallPoint("sql.execute", lambda rt: AsyncConnection, "execute", _sql_error),
        CallPoint("sql.commit", dialect, "do_commit", driver_error),
    ]


def _postgres_points() -> list[CallPoint]:
    """SQLAlchemy's statements, and the hot path's round trips on psycopg's connection (claims,
    renewals, settlements), which fail with psycopg's own error."""
    from queueing_core.providers.sql.driver import DriverPath

    point = CallPoint("pg.round_trip", lambda rt: DriverPath, "round_trip", _pg_error)
    return [*_sql_points(_pg_error), point]


def _sqlite_points() -> list[CallPoint]:
    """SQLAlchemy's statements, and the hot path's calls (claims, renewals, settlements: on the event
    loop's thread or in aiosqlite's), which fail with sqlite3's own error."""
    from queueing_core.providers.sql.sqlite_driver import SqliteDriverPath

    point = CallPoint("sqlite.round_trip", lambda rt: SqliteDriverPath, "round_trip", _sqlite_error)
    return [*_sql_points(_sqlite_error), point]


def _inprocess_points() -> list[CallPoint]:
    from queueing_core.control.memory import MemoryControlStore
    from queueing_core.providers.inprocess import InProcessProvider
    from queueing_core.tracking.memory import MemoryTracker

    return [
        *_methods("memory", lambda rt: InProcessProvider, ["send", "settle", "_forget"], None),
        *_methods("history", lambda rt: MemoryTracker, _HISTORY_WRITES, None),
        *_methods("control", lambda rt: MemoryControlStore, _CONTROL_CALLS, None),
    ]


def _storage_points() -> list[CallPoint]:
    from azure.storage.queue.aio import QueueClient

    calls = ["send_message", "update_message", "delete_message", "receive_messages", "clear_messages"]
    return [
        *_methods("queue", lambda rt: QueueClient, calls, _azure_error),
        *_tables_history(),
        *_delayed_store(),
    ]


def _servicebus_points() -> list[CallPoint]:
    from queueing_core.fakes.servicebus import FakeServiceBusReceiver, FakeServiceBusSender

    receiver = [
        "receive_messages",
        "complete_message",
        "abandon_message",
        "dead_letter_message",
        "renew_message_lock",
        "peek_messages",
    ]
    sender = ["send_messages", "cancel_scheduled_messages"]
    return [
        *_methods("sb", lambda rt: FakeServiceBusSender, sender, _servicebus_error),
        *_methods("sb", lambda rt: FakeServiceBusReceiver, receiver, _servicebus_error),
        *_tables_history(),
    ]


def _rabbitmq_points() -> list[CallPoint]:
    from aio_pika.exchange import Exchange
    from aio_pika.message import IncomingMessage
    from aio_pika.queue import Queue

    return [
        *_methods("amqp", lambda rt: Exchange, ["publish"], _amqp_error),
        *_methods("amqp", lambda rt: IncomingMessage, ["ack", "nack", "reject"], _amqp_error),
        *_methods("amqp", lambda rt: Queue, ["get", "purge"], _amqp_error),
        *_sql_side_stores(),
    ]


def _sqs_client_class(rt: Runtime) -> type:
    # botocore makes a class per client: wrap the one this provider calls
    return type(rt.provider.client)  # type: ignore[attr-defined]


def _sqs_points() -> list[CallPoint]:
    from queueing_core.providers.sql.leases import SqlLeaseStore

    calls = [
        "send_message",
        "send_message_batch",
        "receive_message",
        "delete_message",
        "delete_message_batch",
        "change_message_visibility",
        "change_message_visibility_batch",
        "purge_queue",
    ]
    return [
        *_methods("sqs", _sqs_client_class, calls, _aws_error),
        *_methods("leases", lambda rt: SqlLeaseStore, ["take", "holding", "extend"], _sql_error),
        *_sql_side_stores(),
    ]


KITS: dict[str, Kit] = {
    "inprocess": Kit(
        "inprocess",
        _inprocess_points,
        _inprocess_places,
        durable=False,
        no_faults="in memory: no SDK or driver call can fail, and a crash takes the queues along (the "
        "in-process provider promises nothing across a process's death)",
    ),
    "sqlite": Kit("sqlite", _sqlite_points, _sql_places),
    "postgres": Kit("postgres", _postgres_points, _sql_places),
    "storage_queue": Kit("storage_queue", _storage_points, _storage_places),
    "servicebus": Kit("servicebus", _servicebus_points, _counted_places),
    "rabbitmq": Kit("rabbitmq", _rabbitmq_points, _counted_places),
    "sqs": Kit("sqs", _sqs_points, _counted_places),
}
