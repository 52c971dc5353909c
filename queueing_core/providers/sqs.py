"""Amazon SQS provider on ``boto3``; every boto3 call runs in the provider's own thread pools,
never on the event loop (boto3 clients are thread-safe; the pools bound the concurrent requests).
The consumers' receives (long polls that hold a thread up to ``receive_wait`` each, back to back while
a queue is idle) have a pool of their own: sharing one, idle polls held every thread and a renewal,
settlement or send waited behind them past the visibility timeout, and the message ran twice (review).

- A standard queue per type (sanitized: 80 characters of letters, digits, ``-`` and ``_``) and its
  dead-letter queue ``<queue>-dlq``, created on open with a redrive policy (``maxReceiveCount`` = the
  type's max attempts + 1: the last receive is the kit's, for its reasoned dead letter), the lease
  as ``VisibilityTimeout`` and SQS's longest
  ``MessageRetentionPeriod`` (14 days): the kit records expiry itself, and a message's own ``ttl`` may
  outlast its type's expiration. A queue that exists with other settings (an older version's shorter
  retention) is brought to these on open. With ``auto_create`` off (``QUEUEING_SQS_CREATE_QUEUES``)
  the queues and their dead-letter queues are only looked up, and one missing stops the open. SQS
  still deletes a message that waits *unreceived in the queue* for 14 days, whatever its ``ttl`` (a
  delay beyond 15 minutes waits in the delayed store, whose rows SQS does not count: the 14 days
  start when it is forwarded; a retry or pause sends a new copy).
- The lease is the visibility timeout; long handlers extend it (``ChangeMessageVisibilityBatch``).
  ``ApproximateReceiveCount`` counts deliveries on top of the envelope's attempts.
- Retries, pauses, waits and releases send a copy carrying the attempts used (``DelaySeconds`` up to
  15 minutes; the delayed-message store beyond) and delete the original, so the receive count of a
  copy starts again: the redrive policy only catches a copy that keeps coming back without being
  settled (a consumer that crashes with it), which is what it is there for.
- Dead letters (and expired messages) are sent to the DLQ with the reason in message attributes and
  in the envelope's headers, then deleted; bytes that are not an envelope are kept as they came.
- ``enqueue_many`` uses ``SendMessageBatch`` (10 entries and 256 KiB per call); SQS acknowledges a
  send once it is stored, so ``wait`` holds either way.

Pause/circuit state, history and the delayed store live in the SQL database of ``SideStores``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import math
import os
import re
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from botocore.exceptions import BotoCoreError, ClientError, HTTPClientError
from botocore.exceptions import ConnectionError as BotoConnectionError

from ..clock import Clock, utcnow
from ..decisions import Complete, DeadLetter, DeadLetterReason, Expire, dead_letter_of, due_at
from ..envelope import DESCRIPTION, REASON, Envelope, dead_letter_marks
from ..errors import (
    ConfigurationError,
    InvalidOperation,
    MalformedEnvelope,
    ProviderError,
    ProviderUnavailable,
)
from ..naming import QueueNaming, Transport
from ..options import QueueOptions
from ..tracking import MessageRecord
from ..transport import Capabilities, Delivery, RunBound, Settlement, settled_each
from .dead_letters import DEAD_STATES, HOLD_SECONDS, empty_dead_letters, id_in_text, started_again
from .delayed import FORWARD_FAILED, DelayedMessage, forward_failed_record, record_stored_text
from .delayed.breaker import first_line
from .names import companion_name
from .side_stores import SideStoreOps, WholeQueuePurge
from .sql.history import SideStores, malformed_id
from .sql.leases import LeaseToken, SqlLeaseStore

if TYPE_CHECKING:
    from ..app import QueueingApp, Subscription
    from ..settings import QueueingSettings

log = logging.getLogger("queueing.sqs")

T = TypeVar("T")

MAX_NATIVE_DELAY = timedelta(minutes=15)  # DelaySeconds is at most 900
MAX_VISIBILITY = timedelta(hours=12)
#: a run is cut this long before SQS's 12 hours from its receive end, to settle while its receipt works
HOLD_MARGIN = timedelta(minutes=1)
#: what a renewal leaves of those 12 hours for its call to reach SQS (a renewal that asked for all that
#: was left was refused when the call took a moment: seen in the test)
RENEWAL_SLACK = timedelta(seconds=5)
#: SQS ends a receive's hold on a message 12 hours after it, however often its visibility timeout is
#: extended: its receipt then stops working and another worker runs it beside the first, whose outcome
#: is refused; it ran twice each attempt until dead-lettered "ended without a settlement"
HOLD_BOUND = RunBound(
    MAX_VISIBILITY - HOLD_MARGIN,
    "the run came within a minute of SQS's 12 hours from its receive, past which its receipt stops "
    "working and the message is received again (split work longer than that, or run it on another "
    "transport)",
)
MAX_RETENTION = 14 * 24 * 3600
#: the threads of the control calls (sends, renewals, settlements, forwards, operations)
THREADS = 16
#: the most threads the consumers' receives get by default: one per consumed queue up to this (an
#: idle queue's long poll holds its thread); with more queues than threads their polls take turns
MAX_RECEIVE_THREADS = 64
#: the largest maxReceiveCount a redrive policy takes
MAX_RECEIVE_COUNT = 1000
#: SQS accepts 256 KiB per message and per batch, message attributes included
MAX_BATCH_BYTES = 256 * 1024
MAX_ENVELOPE_BYTES = 250 * 1024
DLQ_SUFFIX = "-dlq"
MESSAGE_ID = "queueing-message-id"
TYPE = "queueing-type"
ATTEMPT = "x-attempt"
#: GetQueueUrl's error codes for a queue that does not exist (the JSON protocol's; the query protocol's)
_NO_QUEUE = {"QueueDoesNotExist", "AWS.SimpleQueueService.NonExistentQueue"}
#: the setting that turns queue creation off
CREATE_QUEUES_SETTING = "QUEUEING_SQS_CREATE_QUEUES"
#: error codes that mean "try again later", not "this request is wrong"
_TRANSIENT = {
    "ThrottlingException",
    "Throttling",
    "RequestThrottled",
    "ServiceUnavailable",
    "InternalError",
    "InternalFailure",
    "RequestTimeout",
    "KMS.ThrottlingException",
}


@contextlib.contextmanager
def _boundary(action: str) -> Iterator[None]:
    """botocore errors become the kit's: unreachable/throttled -> ProviderUnavailable, else ProviderError."""
    try:
        yield
    except ProviderError:
        raise
    except (BotoConnectionError, HTTPClientError, OSError) as exc:
        raise ProviderUnavailable(f"SQS unreachable during {action}: {first_line(exc)}") from None
    except ClientError as exc:
        err = exc.response.get("Error", {})
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        code = str(err.get("Code", ""))
        text = f"{action} failed: {code} {err.get('Message', '')}".strip()
        if code in _TRANSIENT or status >= 500:
            raise ProviderUnavailable(f"SQS busy: {text}") from None
        raise ProviderError(text) from None
    except BotoCoreError as exc:  # configuration: no credentials, no region, a bad endpoint
        raise ProviderError(f"{action} failed: {first_line(exc)}") from None


def _code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def whole_seconds(delay: timedelta, cap: timedelta) -> int:
    """SQS counts in whole seconds: round up (never early), cap at ``cap``."""
    return math.ceil(min(max(delay, timedelta(0)), cap).total_seconds())


#: what SQS refuses in a body or a String attribute (InvalidMessageContents): it takes #x9, #xA, #xD,
#: #x20-#xD7FF, #xE000-#xFFFD and #x10000-#x10FFFF only
_NOT_SQS_TEXT = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")
#: the characters of a dead letter's description kept in its attribute (the body's marks keep 4,000)
DESCRIPTION_CHARS = 1000


def sqs_text(text: str) -> str:
    """``text`` with what SQS refuses replaced by U+FFFD: a dead letter's description may quote a
    tool's colour codes (ESC) or a key of another producer's JSON, and a letter SQS refused left its
    message to run again on every attempt, then to end with the wrong reason (found in review)."""
    return _NOT_SQS_TEXT.sub("\ufffd", text)


def sqs_body(text: str) -> str:
    """JSON text as SQS takes it: U+FFFE and U+FFFF, which SQS refuses and a JSON string may hold raw
    (pydantic writes them so), as their escapes, the same JSON. (Nothing else SQS refuses can be raw in
    JSON text: control characters are escaped, and a lone surrogate does not encode.) A letter or a
    copy of a body holding one, from a producer that escaped it, was refused on every try (review)."""
    if "\ufffe" in text or "\uffff" in text:
        return text.replace("\ufffe", "\\ufffe").replace("\uffff", "\\uffff")
    return text


def _attr(value: str | int) -> dict[str, str]:
    if isinstance(value, int):
        return {"DataType": "Number", "StringValue": str(value)}
    return {"DataType": "String", "StringValue": sqs_text(value) or "-"}  # SQS rejects empty strings


def _entry_bytes(entry: dict[str, Any]) -> int:
    """What SQS counts of an entry against its 256 KiB: the body, and each attribute's name, type and
    value, in UTF-8 bytes."""
    return len(entry["MessageBody"].encode()) + sum(
        len(k.encode()) + len(v["DataType"]) + len(v["StringValue"].encode())
        for k, v in entry["MessageAttributes"].items()
    )


#: the region when neither the kit's setting nor the AWS configuration names one (the kit's old default)
DEFAULT_REGION = "us-east-1"


def standard_region(session: Any) -> str:
    """The region the standard AWS configuration names, as ``session`` (a boto3 session) reads it:
    botocore's own resolution (``AWS_DEFAULT_REGION``, the profile's ``region``), then ``AWS_REGION``
    (which AWS's runtimes set and the other SDKs read, botocore not), then :data:`DEFAULT_REGION`. A
    fixed default passed over all of them put the queues of a deployment in another region in
    us-east-1, with its messages (found in review)."""
    return str(session.region_name or os.environ.get("AWS_REGION") or DEFAULT_REGION)


def _sent_at(m: dict[str, Any]) -> datetime | None:
    """When SQS took the message in (its ``SentTimestamp``, milliseconds since 1970), if it says."""
    try:
        return datetime.fromtimestamp(int(m["Attributes"]["SentTimestamp"]) / 1000, UTC)
    except (KeyError, TypeError, ValueError, OverflowError, OSError):
        return None


@dataclass
class _Handle:
    url: str
    receipt: str
    physical: str
    #: this receive's token in the side store's lease table: SQS takes a stale receipt handle, so the
    #: token is what keeps a run whose visibility ran out from settling the message (None: a message
    #: taken only to be deleted, as when draining a queue)
    lease: LeaseToken | None = None
    #: the steps of this run's settlement already done (its copy or dead letter sent; the original
    #: deleted): the settler's next try after a failure goes on from there, not sending them again
    prepared: bool = False
    deleted: bool = False
    #: SQS refused its delete as the sender's fault (a receipt no longer the message's): not deleted,
    #: and a later try would be refused again
    stale: bool = False


class _DeadLetterPages:
    """A dead-letter queue read page by page: letters passed over stay invisible (so the next receive
    returns others) until the scan makes them visible again."""

    def __init__(self, provider: SqsProvider, url: str) -> None:
        self.provider, self.url = provider, url

    async def next_page(self) -> list[dict[str, Any]]:
        resp = await self.provider._call(
            "reading dead letters",
            self.provider.client.receive_message,
            QueueUrl=self.url,
            MaxNumberOfMessages=10,
            WaitTimeSeconds=1,  # a long poll asks every server: a short one may miss messages
            VisibilityTimeout=HOLD_SECONDS,
            MessageAttributeNames=["All"],
        )
        return list(resp.get("Messages") or [])

    def message_id(self, item: dict[str, Any]) -> str:
        mid = item.get("MessageAttributes", {}).get(MESSAGE_ID, {}).get("StringValue")
        return str(mid) if mid else id_in_text(str(item.get("Body", "")))

    def key(self, item: dict[str, Any]) -> Any:
        return item["MessageId"]

    async def remove(self, item: dict[str, Any]) -> None:
        await self.provider._call(
            "deleting a dead letter",
            self.provider.client.delete_message,
            QueueUrl=self.url,
            ReceiptHandle=item["ReceiptHandle"],
        )

    async def total(self) -> int | None:
        # letters hidden by a reader that died come back when their visibility timeout ends
        depth = await self.provider.depth_of(self.url)
        return depth["ready"] + depth["in_flight"] + depth["delayed"]

    async def hand_back(self, items: Sequence[dict[str, Any]]) -> None:
        for i in range(0, len(items), 10):
            entries = [
                {"Id": str(j), "ReceiptHandle": m["ReceiptHandle"], "VisibilityTimeout": 0}
                for j, m in enumerate(items[i : i + 10])
            ]
            with contextlib.suppress(ProviderError):
                await self.provider._call(
                    "returning dead letters",
                    self.provider.client.change_message_visibility_batch,
                    QueueUrl=self.url,
                    Entries=entries,
                )


class SqsProvider(SideStoreOps):
    transport = Transport.SQS
    left_store_text = "it waits in SQS's own delay, which cannot be shortened (it runs when due)"

    def __init__(
        self,
        client: Any,
        *,
        stores: SideStores,
        naming: QueueNaming | None = None,
        auto_create: bool = True,
        ttl_grace: timedelta = timedelta(hours=1),
        receive_wait: int = 1,
        max_native_delay: timedelta = MAX_NATIVE_DELAY,
        threads: int = THREADS,
        receive_threads: int | None = None,
        delayed_retries: int = 3,
        dispatcher_options: dict[str, Any] | None = None,
        clock: Clock = utcnow,
    ) -> None:
        if not timedelta(0) <= max_native_delay <= MAX_NATIVE_DELAY:
            raise ConfigurationError("max_native_delay", "out of range", "0 to 15 minutes")
        self.client = client
        self._use_stores(stores, delayed_retries, clock, dispatcher_options)
        self.leases = SqlLeaseStore(stores.sql, self.transport.value)
        #: a lease write failed: SQS is not asked again until the store takes a write (see receive)
        self._leases_refused = False
        self.naming = naming
        self.auto_create = auto_create
        self.ttl_grace = ttl_grace
        self.receive_wait = max(0, min(20, int(receive_wait)))
        self.capabilities = Capabilities(
            max_delay=max_native_delay,
            lock_renewal=True,
            native_dead_letter=True,
            max_message_bytes=MAX_ENVELOPE_BYTES,
            # PurgeQueue deletes the messages consumers hold too ("including in-flight messages"): a
            # whole-queue purge that left their history as held reported them left to their workers
            # while SQS had deleted them, and the history said Leased for good (found in review). Their
            # history goes now. The holder's delete is then refused (not recorded; moto) or taken (its
            # outcome recorded, as AWS takes an old receipt), and a copy its run sends (a retry, a
            # pause) comes back: a duplicate, not a loss (tests/integration/test_sqs_purge_takes_held.py)
            purge_takes_held=True,
            # SQS deletes a dead letter after 14 days (a queue's longest retention) whatever anyone did;
            # its history, which keeps the message whole, stays: still listed, and a retry sends it
            # again from there (pruned by age with the rest, the message was lost; found in review)
            dead_letters_kept=DEAD_STATES,
            longest_run=HOLD_BOUND,
        )
        #: the control calls' threads; the receives' (``None``: one per consumed queue, at most
        #: :data:`MAX_RECEIVE_THREADS`, fixed when the first receive starts)
        self.threads = threads
        self.receive_threads = receive_threads
        self._pool: ThreadPoolExecutor | None = None
        self._receive_pool: ThreadPoolExecutor | None = None
        self._urls: dict[str, str] = {}
        self._url_lock = asyncio.Lock()
        self._app: QueueingApp | None = None

    @classmethod
    def from_settings(cls, settings: QueueingSettings, **kwargs: Any) -> SqsProvider:
        """Credentials come from the standard AWS chain (environment, profile, instance role)."""
        import boto3
        from botocore.exceptions import InvalidRegionError

        from .. import retry_policy

        threads = int(kwargs.pop("threads", THREADS))
        receive_threads = kwargs.get("receive_threads")
        # the default session an application set up in code (``boto3.setup_default_session``: its
        # keys, profile or assumed role), as ``boto3.client`` uses it; else a session of its own, the
        # AWS configuration as it is now, its region and credentials from one reading
        session = boto3.DEFAULT_SESSION or boto3.session.Session()
        region = settings.sqs_region or standard_region(session)
        if not settings.sqs_region and region != DEFAULT_REGION:
            # earlier versions used us-east-1 whatever the AWS configuration said: a deployment that
            # relied on it would now create empty queues here, its messages left waiting there
            log.warning(
                "SQS: QUEUEING_SQS_REGION is not set, so the queues are those of %s, the AWS "
                "configuration's region (versions before this one used us-east-1 whatever it said: "
                "set QUEUEING_SQS_REGION, to us-east-1 to keep the queues there, to say which)",
                region,
            )
        try:
            client = session.client(
                "sqs",
                endpoint_url=settings.sqs_endpoint_url,
                region_name=region,
                # a connection for every thread of both pools (more are opened and thrown away after use)
                config=retry_policy.boto3_config(
                    max_pool_connections=threads + int(receive_threads or MAX_RECEIVE_THREADS)
                ),
            )
        except InvalidRegionError:
            # botocore's refusal was a traceback (exit 1): said as the setting it came from, in one line
            if settings.sqs_region:
                raise ConfigurationError(
                    "QUEUEING_SQS_REGION", f"{region!r} is not a region name", "us-east-1, eu-west-2, ..."
                ) from None
            raise ConfigurationError(
                "QUEUEING_SQS_REGION",
                f"not set, and the region of the AWS configuration, {region!r}, is not a region name",
                "us-east-1, eu-west-2, ... here or in the AWS configuration",
            ) from None
        except ValueError:
            if settings.sqs_endpoint_url is None:
                raise
            raise ConfigurationError(
                "QUEUEING_SQS_ENDPOINT_URL",
                f"{settings.sqs_endpoint_url!r} is not a URL",
                "http://host:port or https://host, or unset for AWS's own",
            ) from None
        kwargs.setdefault("ttl_grace", settings.ttl_grace)
        kwargs.setdefault("delayed_retries", settings.delayed_store_retries)
        kwargs.setdefault("auto_create", settings.sqs_create_queues)
        return cls(client, stores=SideStores.from_settings(settings), threads=threads, **kwargs)

    # -- plumbing ----------------------------------------------------------------------------------
    async def _run(self, fn: Callable[..., T], **kwargs: Any) -> T:
        """Run one boto3 call in the control calls' pool: boto3 blocks, the event loop must not."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="queueing-sqs")
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, **kwargs))

    def _receive_executor(self) -> ThreadPoolExecutor:
        """The consumers' receives' own pool: their long polls never hold a thread a renewal,
        settlement or send waits for."""
        if self._receive_pool is None:
            size = self.receive_threads
            if size is None:
                queues = len(self._app.subscriptions()) if self._app is not None else 1
                size = min(MAX_RECEIVE_THREADS, max(1, queues))
            self._receive_pool = ThreadPoolExecutor(
                max_workers=max(1, size), thread_name_prefix="queueing-sqs-receive"
            )
        return self._receive_pool

    async def _call(self, action: str, fn: Callable[..., T], **kwargs: Any) -> T:
        with _boundary(action):
            return await self._run(fn, **kwargs)

    @staticmethod
    def dead_letter_name(physical: str) -> str:
        return companion_name(physical, DLQ_SUFFIX, Transport.SQS)

    def _settings(self, queue: str) -> tuple[dict[str, str], int]:
        """The queue attributes a logical queue's type asks for, and its max attempts."""
        sub = self._app.by_queue().get(queue) if self._app is not None else None
        o = sub.options if sub is not None else QueueOptions()
        attributes = {
            "VisibilityTimeout": str(whole_seconds(o.lease_duration, MAX_VISIBILITY)),
            # always SQS's longest: the kit records expiry itself (the run sees it and dead-letters the
            # message as expired), and one message's own ttl (``enqueue(ttl=...)``) may be longer than
            # its type's expiration: a retention cut to the type's would let SQS delete it unreceived,
            # with no run, no dead letter and its history still Pending. Set on queues an older version
            # created shorter too (``_create`` updates the attributes of a queue that exists)
            "MessageRetentionPeriod": str(MAX_RETENTION),
        }
        return attributes, o.max_attempts

    async def _create(self, name: str, attributes: dict[str, str]) -> str:
        try:
            resp = await self._run(self.client.create_queue, QueueName=name, Attributes=attributes)
        except ClientError as exc:
            if _code(exc) not in ("QueueAlreadyExists", "QueueNameExists"):
                with _boundary(f"creating queue {name}"):
                    raise
        except Exception:
            with _boundary(f"creating queue {name}"):
                raise
        else:
            return str(resp["QueueUrl"])
        # it exists with other settings: bring them to what the type asks for now
        found = await self._call(f"finding queue {name}", self.client.get_queue_url, QueueName=name)
        url = str(found["QueueUrl"])
        await self._call(
            f"updating queue {name}", self.client.set_queue_attributes, QueueUrl=url, Attributes=attributes
        )
        return url

    async def _url(self, queue: str, *, dead: bool = False) -> str:
        """The URL of a logical queue (or its DLQ); created with its settings on first use."""
        physical = self.physical(queue)
        name = self.dead_letter_name(physical) if dead else physical
        url = self._urls.get(name)
        if url is not None:
            return url
        async with self._url_lock:
            url = self._urls.get(name)
            if url is not None:
                return url
            if not self.auto_create:
                self._urls[name] = url = await self._find(name)
                return url
            dlq_name = self.dead_letter_name(physical)
            dlq_url = await self._create(dlq_name, {"MessageRetentionPeriod": str(MAX_RETENTION)})
            self._urls[dlq_name] = dlq_url
            attrs, max_attempts = self._settings(queue)
            if max_attempts >= MAX_RECEIVE_COUNT:
                log.warning(
                    "queue %s: max_attempts %d leaves no receive beyond the attempts under SQS's limit "
                    "(%d): a message whose runs all die is moved to its dead-letter queue by SQS, unrecorded",
                    queue,
                    max_attempts,
                    MAX_RECEIVE_COUNT,
                )
            arn = await self._call(
                f"reading {dlq_name}",
                self.client.get_queue_attributes,
                QueueUrl=dlq_url,
                AttributeNames=["QueueArn"],
            )
            attrs["RedrivePolicy"] = json.dumps(
                {
                    "deadLetterTargetArn": arn["Attributes"]["QueueArn"],
                    # one receive more than the attempts: a message whose runs all died unsettled
                    # reaches the kit once more, which dead-letters it with its reason and records it
                    # (SQS's own move at max_attempts left its history Pending)
                    "maxReceiveCount": str(min(max_attempts + 1, MAX_RECEIVE_COUNT)),
                }
            )
            self._urls[physical] = await self._create(physical, attrs)
            return self._urls[name]

    async def _find(self, name: str) -> str:
        """The URL of a queue that must exist (``auto_create`` off): a missing one is named, with the
        region looked in (a region not meant is the likeliest cause), not left to a bare error code."""
        try:
            resp = await self._run(self.client.get_queue_url, QueueName=name)
        except ClientError as exc:
            if _code(exc) not in _NO_QUEUE:
                with _boundary(f"finding queue {name}"):
                    raise
            raise ConfigurationError(
                CREATE_QUEUES_SETTING,
                f"SQS queue {name} does not exist in {self.client.meta.region_name} and queues are not "
                "created",
                f"create {name} (see the SQS transport's docs for its settings), or true to have it created",
            ) from None
        except Exception:
            with _boundary(f"finding queue {name}"):
                raise
        return str(resp["QueueUrl"])

    async def _url_of_physical(self, physical: str) -> str:
        """The URL of a physical queue name (delayed messages are stored by physical name)."""
        url = self._urls.get(physical)
        if url is None:
            resp = await self._call(
                f"finding queue {physical}", self.client.get_queue_url, QueueName=physical
            )
            url = self._urls[physical] = str(resp["QueueUrl"])
        return url

    # -- lifecycle ---------------------------------------------------------------------------------
    async def open(self, app: QueueingApp) -> None:
        self._app = app
        await self.stores.open()
        for sub in app.subscriptions():
            await self._url(sub.queue)
            if not self.auto_create:
                # (created with its queue otherwise) a missing one would fail the first dead letter
                await self._url(sub.queue, dead=True)

    async def close(self) -> None:
        for pool in (self._pool, self._receive_pool):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
        self._pool = self._receive_pool = None
        self._urls.clear()
        await self.stores.close()

    # -- producing ---------------------------------------------------------------------------------
    def _entry(self, env: Envelope, delay: int, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        return {
            "MessageBody": sqs_body(env.encode_text()),
            "DelaySeconds": delay,
            "MessageAttributes": {
                MESSAGE_ID: _attr(str(env.message_id)),
                TYPE: _attr(env.type),
                ATTEMPT: _attr(env.attempt),
                **(extra or {}),
            },
        }

    async def _send_entries(self, url: str, entries: list[dict[str, Any]]) -> None:
        """SendMessageBatch in chunks of 10 entries and at most 256 KiB, sent concurrently."""
        chunks: list[list[dict[str, Any]]] = []
        size = 0
        for e in entries:
            n = _entry_bytes(e)
            if not chunks or len(chunks[-1]) == 10 or size + n > MAX_BATCH_BYTES:
                chunks.append([])
                size = 0
            chunks[-1].append(e)
            size += n
        await asyncio.gather(*(self._send_batch(url, c) for c in chunks))

    async def _send_batch(self, url: str, chunk: list[dict[str, Any]]) -> None:
        batch = [{"Id": str(i), **e} for i, e in enumerate(chunk)]
        resp = await self._call(
            "sending messages", self.client.send_message_batch, QueueUrl=url, Entries=batch
        )
        failed = resp.get("Failed") or []
        if failed:
            first = failed[0]
            kind = ProviderError if first.get("SenderFault") else ProviderUnavailable
            why = f"{first.get('Code')} {first.get('Message', '')}".strip()
            raise kind(f"SQS refused {len(failed)} of {len(batch)} message(s): {why}")

    async def send_at(self, queue: str, env: Envelope, due: datetime | None) -> None:
        """Send now, delayed natively (up to ``max_delay``), or through the delayed store."""
        now = self.clock()
        delay = (due - now) if due is not None else timedelta(0)
        assert self.capabilities.max_delay is not None
        url = await self._url(queue)
        if delay > self.capabilities.max_delay:
            await self.delayed.store(env, self.physical(queue), now + delay)
            return
        await self._send_entries(url, [self._entry(env, whole_seconds(delay, MAX_NATIVE_DELAY))])

    async def send(self, envelopes: Sequence[Envelope], *, wait: bool = False) -> None:
        now = self.clock()
        assert self.capabilities.max_delay is not None
        later: list[tuple[Envelope, str, datetime]] = []
        by_queue: dict[str, list[dict[str, Any]]] = {}
        for env in envelopes:
            delay = (env.not_before - now) if env.not_before is not None else timedelta(0)
            if delay > self.capabilities.max_delay:
                later.append((env, self.physical(env.queue), now + delay))
            else:
                by_queue.setdefault(env.queue, []).append(
                    self._entry(env, whole_seconds(delay, MAX_NATIVE_DELAY))
                )
        if later:
            # the queues exist before the dispatcher forwards to them, wherever it runs
            for queue in {env.queue for env, _, _ in later}:
                await self._url(queue)
            await self.delayed.store_many(later)
        for queue, entries in by_queue.items():
            await self._send_entries(await self._url(queue), entries)

    async def forward_delayed(self, item: DelayedMessage) -> None:
        """Send a due message from the delayed store to its queue."""
        try:
            env = Envelope.decode(item.envelope)
        except MalformedEnvelope as exc:
            # no run could read it: straight to the dead-letter queue, as the receive path sends a
            # message that is not an envelope (a failed decode here would fail every forward, and then
            # the dead letter, and leave the row due for ever)
            await self._dead_letter_stored_text(item, f"a delayed message is not an envelope: {exc}")
            return
        url = await self._url_of_physical(item.destination)
        await self._send_entries(url, [self._entry(env, 0)])

    async def dead_letter_delayed(self, item: DelayedMessage, description: str) -> None:
        now = self.clock()
        try:
            env = Envelope.decode(item.envelope)
        except MalformedEnvelope:
            await self._dead_letter_stored_text(item, description)
            return
        dlq = await self._url_of_physical(self.dead_letter_name(item.destination))
        await self._send_entries(dlq, [self._dead_entry(env, FORWARD_FAILED, description, now)])
        await self.stores.history.upsert([forward_failed_record(env, description, now)])

    async def _dead_letter_stored_text(self, item: DelayedMessage, description: str) -> None:
        """A delayed-store row whose text is not an envelope: the text as it was stored goes to the
        dead-letter queue with the reason ``malformed-envelope`` (as the receive path sends one), under
        the message id the row was stored with, and the history says so under that id."""
        now = self.clock()
        reason = DeadLetterReason.MALFORMED_ENVELOPE.value
        dlq = await self._url_of_physical(self.dead_letter_name(item.destination))
        entry = {
            "MessageBody": sqs_body(item.envelope),
            "MessageAttributes": {
                MESSAGE_ID: _attr(str(item.message_id)),
                REASON: _attr(reason),
                DESCRIPTION: _attr(description[:DESCRIPTION_CHARS]),
            },
        }
        await self._send_entries(dlq, [entry])
        queue = self.logical_of(item.destination)
        await record_stored_text(self.stores.history, item, queue, reason, description, now)

    def _dead_entry(self, env: Envelope, reason: str, description: str, now: datetime) -> dict[str, Any]:
        """The dead letter of ``env``: its marks in the body's headers and in attributes. A letter must
        fit where its message did: the description gives way (a message near the size limit whose
        letter SQS refused ran again on every attempt, then ended with the wrong reason; review)."""
        text = sqs_text(description)
        for keep in (len(text), 1000, 100, 0):
            marks = dead_letter_marks(reason, text[:keep], now)
            copy = env.model_copy(update={"headers": {**env.headers, **marks}})
            attrs = {REASON: _attr(reason), DESCRIPTION: _attr(text[: min(keep, DESCRIPTION_CHARS)])}
            entry = self._entry(copy, 0, attrs)
            if _entry_bytes(entry) <= MAX_BATCH_BYTES:
                break
        return entry

    # -- consuming ---------------------------------------------------------------------------------
    async def receive(self, sub: Subscription, max_messages: int) -> list[Delivery]:
        url = await self._url(sub.queue)
        lease = min(sub.options.lease_duration, MAX_VISIBILITY)
        physical = self.physical(sub.queue)
        out: list[Delivery] = []
        try:
            await self._receive_into(out, sub, url, lease, physical, max_messages)
        except Exception as exc:
            if not out:
                raise
            # a later call failed: what the earlier ones brought is ours, hidden for the lease and its
            # receive counted. Raising would leave it to come back only when that runs out, an attempt
            # used unrun (and a message on its last one dead-lettered unrun): run it now
            log.warning(
                "receiving from %s stopped after %d message(s): %s", physical, len(out), first_line(exc)
            )
        return out

    async def _receive_into(
        self, out: list[Delivery], sub: Subscription, url: str, lease: timedelta, physical: str, most: int
    ) -> None:
        """Receive up to ``most`` messages into ``out``, 10 a call, until a call brings fewer."""
        max_messages = most
        wait = self.receive_wait
        if self._leases_refused:
            # every receive counts against its messages' attempts (SQS's receive count, which its
            # redrive policy also reads), whether they run or not: while the store refuses the lease
            # writes (a server turned read-only in a failover, a full disk) each poll would spend one
            # unrun, and an outage of a few leases' length dead-lettered the backlog unrun (found in
            # review). The store is asked first, with a write that changes nothing
            await self.leases.writable()
            self._leases_refused = False
        while len(out) < max_messages:
            # the visibility timeout starts when SQS hands the message over, somewhere in this call: a
            # lease counted from the clock after it would overstate what is left by the call's time
            # (a stalled process would renew too late); counted from before, it errs the safe way.
            # Read in the receive's thread as the call starts, not before a wait for a free thread
            request = functools.partial(
                self.client.receive_message,
                QueueUrl=url,
                MaxNumberOfMessages=min(10, max_messages - len(out)),
                WaitTimeSeconds=wait,  # the first call is a short long-poll; the rest take what is there
                VisibilityTimeout=whole_seconds(lease, MAX_VISIBILITY),
                MessageSystemAttributeNames=["ApproximateReceiveCount", "SentTimestamp"],
                MessageAttributeNames=["All"],
            )

            def timed(request: Callable[[], dict[str, Any]] = request) -> tuple[datetime, dict[str, Any]]:
                return self.clock(), request()

            with _boundary(f"receiving from {physical}"):
                sent_at, resp = await asyncio.get_running_loop().run_in_executor(
                    self._receive_executor(), timed
                )
            messages = resp.get("Messages") or []
            counts = [int(m.get("Attributes", {}).get("ApproximateReceiveCount", 1)) for m in messages]
            # the side store learns of this receive before any handler runs: from now on an earlier
            # receive of the same message can no longer settle it. The receive count orders the
            # receives, not the order their writes land in (see sql/leases.py)
            try:
                tokens = await self.leases.take(
                    [(m["MessageId"], n) for m, n in zip(messages, counts, strict=True)], sent_at + lease
                )
            except Exception:
                # (these messages come back when the lease runs out, this receive counted: no more)
                self._leases_refused = True
                raise
            for m, n, token in zip(messages, counts, tokens, strict=True):
                if token is None:
                    # a later receive of this message (its visibility ran out while this receive's
                    # write was on the way) holds it now: this one is stale and must not run
                    log.warning(
                        "dropped a stale receive of SQS message %s from %s (receive %d): a later "
                        "receive holds it",
                        m["MessageId"],
                        physical,
                        n,
                    )
                    continue
                d = Delivery.of(
                    m["Body"],
                    queue=sub.queue,
                    delivery_count=n,
                    handle=_Handle(url, m["ReceiptHandle"], physical, token),
                    lease_until=sent_at + lease,
                    # SQS's 12 hours run from the receive: counted from before the call, the
                    # renewals' cap and the run's bound err the safe way
                    received_at=sent_at,
                )
                marked = REASON in (m.get("MessageAttributes") or {})
                out.append(self._redriven(d, sub, n, _sent_at(m) or sent_at) if marked else d)
            if len(messages) < 10:
                break
            wait = 0

    @staticmethod
    def _redriven(d: Delivery, sub: Subscription, count: int, sent: datetime) -> Delivery:
        """``d``, or where it is a dead letter of the kit's back in its live queue, ``d`` as a retry.
        Only an operator puts one there: AWS's DLQ redrive (``StartMessageMoveTask``, the console's
        "Start DLQ redrive") moves each letter back as a new message, its body and attributes as they
        were. Its envelope carried the attempts its message had used (all of them) and an expiry that
        may have passed: its first receive was past its last attempt, and it was dead-lettered again
        unrun, "ended without a settlement" (review). So it starts again as the kit's own retry sends
        it: no attempts used (SQS's receive count of the new message is the attempt), its type's
        expiration from when the redrive sent it (the same on each receive of it: its envelope keeps
        the marks, and a retry by visibility receives it again), and without the marks of its
        dead-lettering."""
        env = d.envelope
        # (the caller found the letter's reason among the message's attributes too, which only a
        # letter the kit sent carries: a header of that name alone may be the sender's own)
        if env is None or REASON not in env.headers:
            return d
        d.envelope = started_again(env, sub.options.expiration, sent)
        d.attempt = max(1, count)
        log.info(
            "SQS message %s (%s) came back from its dead-letter queue (a redrive): run again with "
            "fresh attempts",
            env.message_id,
            env.type,
        )
        return d

    async def wait_for_work(self, sub: Subscription, timeout: float) -> None:
        if not self.receive_wait:
            # short polling: only the worker's idle back-off spaces the requests (SQS bills each one)
            await asyncio.sleep(timeout)
        # otherwise receive already long-polled (up to receive_wait) for work to arrive

    async def _prepare_once(self, s: Settlement) -> None:
        """:meth:`_prepare`, unless an earlier try of this settlement did it (a failed delete, or a
        failure beside it in the batch, has the settler try the whole batch again)."""
        h = s.delivery.handle
        if not h.prepared:
            await self._prepare(s)
            h.prepared = True

    async def _prepare(self, s: Settlement) -> None:
        """Everything a settlement needs before its original is deleted (copies, dead letters)."""
        d, decision = s.delivery, s.decision
        now = self.clock()
        if isinstance(decision, Complete):
            return
        if isinstance(decision, Expire | DeadLetter):
            dead_reason, description = dead_letter_of(decision)
            reason = dead_reason.value
            dlq = await self._url(d.queue, dead=True)
            if d.envelope is not None:
                env = d.envelope.with_attempt(d.attempts_used(decision))
                entry = self._dead_entry(env, reason, description, now)
            else:  # not an envelope: the text as it came, the reason in attributes
                entry = {
                    "MessageBody": d.text(),
                    "MessageAttributes": {
                        MESSAGE_ID: _attr(str(malformed_id(d.text()))),
                        REASON: _attr(reason),
                        DESCRIPTION: _attr(description[:DESCRIPTION_CHARS]),
                    },
                }
            await self._send_entries(dlq, [entry])
            return
        assert d.envelope is not None, "malformed messages are always dead-lettered"
        # the copy first: if the delete fails afterwards, a duplicate beats a loss
        await self.send_at(d.queue, d.copy_after(decision), due_at(decision, now))

    async def _delete(self, handles: list[_Handle]) -> None:
        """DeleteMessageBatch per queue, 10 at a time, the calls side by side (one after another, a
        large batch's last part waited for all the others' round trips). Each handle SQS answered for
        is marked: deleted, or ``stale`` where SQS refused its delete as the sender's fault (the
        receipt is no longer the message's; a later try would be refused again). An entry that failed
        on SQS's side, or a call that failed, is left for the settler's next try: raised once every
        part was sent."""
        transient: list[str] = []

        async def delete_part(url: str, part: list[_Handle]) -> None:
            entries = [{"Id": str(j), "ReceiptHandle": h.receipt} for j, h in enumerate(part)]
            resp = await self._call(
                "deleting messages", self.client.delete_message_batch, QueueUrl=url, Entries=entries
            )
            failed = {f.get("Id"): f for f in resp.get("Failed") or []}
            for j, h in enumerate(part):
                f = failed.get(str(j))
                if f is not None and not f.get("SenderFault", True):
                    transient.append(str(f.get("Code", "InternalError")))
                    continue
                h.deleted, h.stale = f is None, f is not None

        by_url: dict[str, list[_Handle]] = {}
        for h in handles:
            by_url.setdefault(h.url, []).append(h)
        results = await asyncio.gather(
            *(delete_part(url, hs[i : i + 10]) for url, hs in by_url.items() for i in range(0, len(hs), 10)),
            return_exceptions=True,
        )
        for r in results:
            if isinstance(r, BaseException):
                raise r
        if transient:
            raise ProviderUnavailable(
                f"SQS did not delete {len(transient)} message(s): {', '.join(sorted(set(transient)))}"
            )

    async def settle(self, settlements: Sequence[Settlement]) -> None:
        # Only the receive that holds a message may settle it: its lease token is checked first
        # (before any copy is sent), and whoever's token was replaced by a newer receive is refused.
        # The token stays (see ``SqlLeaseStore.holding``): renewals go on until the delete is done.
        ours = await self.leases.holding([s.delivery.handle.lease for s in settlements])
        for s in settlements:
            if s.delivery.handle.lease not in ours:  # (key and token: a stale twin shares the key)
                s.delivery.refuse("a later receive holds it (its lease token was replaced)")
        mine = [s for s in settlements if not s.delivery.refused]
        results = await asyncio.gather(*(self._prepare_once(s) for s in mine), return_exceptions=True)
        ready = [
            s.delivery.handle
            for s, r in zip(mine, results, strict=True)
            if r is None and not (s.delivery.handle.deleted or s.delivery.handle.stale)
        ]
        if ready:
            try:
                await self._delete(ready)
            except BaseException:
                # the parts deleted before the failure are settled: should the settler give up on
                # the batch, their outcomes are recorded all the same (see ``Delivery.applied``). So
                # is a dead letter sent whose original's delete SQS refused (below): given up with
                # the batch for another entry's failure, the letter stayed in the DLQ unlisted, its
                # history Pending (review)
                for s, r in zip(mine, results, strict=True):
                    h = s.delivery.handle
                    s.delivery.applied = r is None and (h.deleted or self._stale_letter(s))
                raise
        for s in mine:
            if not s.delivery.handle.stale or s.delivery.refused:
                continue
            # SQS refused the delete: the receipt is no longer the message's (another receive has it,
            # or SQS moved it to the dead-letter queue itself after its last receive)
            if self._stale_letter(s):
                # its dead letter is sent: recorded all the same, so the letter is listed (refused,
                # the letter would stay in the dead-letter queue with a history that never says so)
                log.warning(
                    "SQS refused the delete of a dead-lettered message (its receipt had passed on): "
                    "the dead letter is sent and recorded; the message may come back and run again"
                )
            else:  # it comes back or is run there, and that run records it
                s.delivery.refuse(
                    "SQS refused the delete: its receipt had passed on; a copy this run sent stays, "
                    "a duplicate"
                )
        # a message not deleted comes back when its visibility timeout ends (at least once, not lost)
        settled_each(mine, results, "SQS")

    @staticmethod
    def _stale_letter(s: Settlement) -> bool:
        """A dead letter sent whose original's delete SQS refused as the sender's fault: its outcome
        stands (the letter is in the DLQ) whatever happens to the rest of its batch."""
        h = s.delivery.handle
        return h.prepared and h.stale and isinstance(s.decision, Expire | DeadLetter)

    async def maintain(self, app: QueueingApp | None = None) -> dict[str, int]:
        done = await super().maintain(app)
        done["leases_pruned"] = await self.leases.prune(self.clock())
        return done

    def _lease_of(self, d: Delivery) -> timedelta:
        sub = self._app.subscription(d.type_name) if self._app and d.type_name else None
        return min(sub.options.lease_duration if sub else timedelta(seconds=30), MAX_VISIBILITY)

    def _renewal_of(self, d: Delivery, now: datetime) -> timedelta:
        """The type's lease, but no further than SQS's 12 hours from the receive, less the call's way
        there, in whole seconds: a renewal that asks past them is refused, and the message came back
        beside its run before the run's bound cut it (review)."""
        left = math.floor((d.received_at + MAX_VISIBILITY - now - RENEWAL_SLACK).total_seconds())
        return min(self._lease_of(d), timedelta(seconds=max(0, left)))

    async def renew(self, deliveries: Sequence[Delivery]) -> list[Delivery]:
        if not deliveries:
            return []
        now = self.clock()
        # a newer receive holds the others: extending their visibility would extend its lease
        longest = max(self._renewal_of(d, now) for d in deliveries)
        ours = await self.leases.extend([d.handle.lease for d in deliveries], now + longest)
        lost: list[Delivery] = [d for d in deliveries if d.handle.lease not in ours]
        by_url: dict[str, list[Delivery]] = {}
        for d in deliveries:
            if d.handle.lease in ours:
                by_url.setdefault(d.handle.url, []).append(d)
        # the batches side by side: one after another, a host with many messages in flight renewed
        # the last of them a round trip per ten later
        await asyncio.gather(
            *(
                self._renew_part(url, ds[i : i + 10], lost)
                for url, ds in by_url.items()
                for i in range(0, len(ds), 10)
            )
        )
        return lost

    async def _renew_part(self, url: str, part: list[Delivery], lost: list[Delivery]) -> None:
        """One ChangeMessageVisibilityBatch of up to 10 deliveries; those not extended join ``lost``."""
        # (as for a receive: the new timeout starts within the call; what is left of the 12 hours
        # counted from just before it, not from before the batches beside this one were built)
        sent_at = self.clock()
        leases: dict[str, timedelta] = {}
        entries: list[dict[str, Any]] = []
        for j, d in enumerate(part):
            lease = self._renewal_of(d, sent_at)
            if not lease:  # its 12 hours are over (a timeout of 0 would free the message)
                lost.append(d)
                continue
            leases[str(j)] = lease
            entries.append(
                {
                    "Id": str(j),
                    "ReceiptHandle": d.handle.receipt,
                    "VisibilityTimeout": whole_seconds(lease, MAX_VISIBILITY),
                }
            )
        if not entries:
            return
        try:
            resp = await self._call(
                "renewing leases",
                self.client.change_message_visibility_batch,
                QueueUrl=url,
                Entries=entries,
            )
        except ProviderError:
            lost.extend(d for j, d in enumerate(part) if str(j) in leases)
            return
        failed = {f["Id"] for f in resp.get("Failed") or []}
        for j, d in enumerate(part):
            if str(j) in failed:
                lost.append(d)
            elif str(j) in leases:
                d.lease_until = sent_at + leases[str(j)]

    # -- ops ---------------------------------------------------------------------------------------
    async def depth(self, queue: str, *, dead: bool = False) -> dict[str, int]:
        return await self.depth_of(await self._url(queue, dead=dead))

    async def depth_of(self, url: str) -> dict[str, int]:
        resp = await self._call(
            "reading queue attributes",
            self.client.get_queue_attributes,
            QueueUrl=url,
            AttributeNames=[
                "ApproximateNumberOfMessages",
                "ApproximateNumberOfMessagesNotVisible",
                "ApproximateNumberOfMessagesDelayed",
            ],
        )
        a = resp.get("Attributes", {})
        return {
            "ready": int(a.get("ApproximateNumberOfMessages", 0)),
            "in_flight": int(a.get("ApproximateNumberOfMessagesNotVisible", 0)),
            "delayed": int(a.get("ApproximateNumberOfMessagesDelayed", 0)),
        }

    async def native_counts(self) -> dict[str, dict[str, int]]:
        """Approximate counts from SQS (ready, in flight, delayed there, dead letters) and the store."""
        if self._app is None:
            return {}
        stored = await self.delayed.counts()
        out: dict[str, dict[str, int]] = {}
        for sub in self._app.subscriptions():
            main = await self.depth(sub.queue)
            dead = await self.depth(sub.queue, dead=True)
            out[sub.queue] = {
                **main,
                "delayed_store": stored.get(self.physical(sub.queue), 0),
                "dead_lettered": dead["ready"] + dead["in_flight"],
            }
        return out

    @contextlib.asynccontextmanager
    async def _dead_letter_pages(self, queue: str) -> AsyncIterator[_DeadLetterPages]:
        yield _DeadLetterPages(self, await self._url(queue, dead=True))

    async def _send_now(self, queue: str, envelope: Envelope) -> None:
        await self.send_at(queue, envelope, None)

    async def ops_release(self, record: MessageRecord, now: datetime) -> bool:
        raise InvalidOperation(
            "an SQS receipt belongs to the receive that holds it: only that consumer can release it; "
            "the message returns by itself when its visibility timeout ends"
        )

    async def _purge_queue(self, url: str, *, drain: bool = True) -> bool:
        """PurgeQueue (True), or, where SQS refuses it (one purge a minute per queue), with ``drain``
        the messages received and deleted by hand, and without it nothing done (False)."""
        try:
            await self._run(self.client.purge_queue, QueueUrl=url)
            return True
        except ClientError as exc:
            if "PurgeQueueInProgress" not in _code(exc):
                with _boundary("purging a queue"):
                    raise
        except Exception:
            with _boundary("purging a queue"):
                raise
        if not drain:
            return False
        # SQS allows one purge a minute per queue: delete what is there by hand
        while True:
            resp = await self._call(
                "draining a queue",
                self.client.receive_message,
                QueueUrl=url,
                MaxNumberOfMessages=10,
                WaitTimeSeconds=1,
            )
            messages = resp.get("Messages") or []
            if not messages:
                return False
            await self._delete([_Handle(url, m["ReceiptHandle"], "") for m in messages])

    async def _purge_whole(self, queue: str) -> WholeQueuePurge:
        await self._purge_queue(await self._url(queue))
        dlq = await self._url(queue, dead=True)
        if await self._purge_queue(dlq, drain=False):
            # PurgeQueue deletes the letters a receive holds too: every one goes
            return WholeQueuePurge(None)
        # purged within the minute: a receive does not see the letters another scan holds hidden,
        # and those keep their history (see empty_dead_letters)
        depth = await self.depth_of(dlq)
        async with self._dead_letter_pages(queue) as pages:
            return WholeQueuePurge(await empty_dead_letters(pages, depth["ready"] + depth["in_flight"] + 1))
