"""Azure Storage Queues provider on ``azure-storage-queue`` (async).

- A queue per type (sanitized: lowercase, 3-63) and its ``<queue>-poison`` queue, created on open.
- The lease is the visibility timeout; ``dequeue_count`` counts attempts on top of the envelope's.
- A failed attempt is re-hidden for the backoff delay (``update_message``): the next dequeue counts.
  A backoff beyond the 7-day visibility limit is a fresh copy instead, carrying the attempt and its
  due time (see below), and the original is deleted.
- Anything that must not use an attempt (pause, waiting for a handler, an early delivery, a release at
  shutdown) sends a fresh copy carrying the attempts used so far and deletes the original, because
  every dequeue raises ``dequeue_count``.
- Dead letters go to ``<queue>-poison`` with the reason and last error in ``x-queueing-*`` headers
  of the envelope; bytes that are not an envelope are wrapped with their raw text kept.
- The Functions host moves a message to ``<queue>-poison`` itself after its dequeue limit, with the
  service's default time-to-live (7 days) and no history of it: the maintenance pass (``maintain``,
  the Functions retention timer) keeps each such letter for good and records it DeadLettered, and an
  operator's retry of a message whose history says it waits in its queue looks there too.
- Bodies are sent as base64 text; the kit decodes each message itself (base64, or plain text from
  another producer), so one bad body is a poison message, not a failed receive. The Functions app
  reads the text as it is (host.json's ``messageEncoding`` is ``none``) and decodes it the same way.
  A copy of another producer's plain envelope too large for base64 (over 48 KiB) is sent as plain
  text; one too large even so is dead-lettered when received, before it runs (see ``too_large_to_copy``).
- Every message is sent without a storage TTL, expiry or not: the service drops what outlives its
  TTL without a trace (Storage Queues has no dead-letter for it), and no host may read a message in
  time (a queue paused past its messages' expiry, every host down). A message past its expiry waits
  until a worker receives it, which records it "Expired" and deletes it.
- Delays beyond the 7-day visibility limit wait in the SQL delayed store when one is configured
  (``QUEUEING_STORAGE_DELAYED_STORE``), else are re-hidden for up to 7 more days on each arrival,
  without using an attempt. A copy sent for later than that carries its due time (``not_before``):
  the service shows it when the limit ends, and only its due time keeps it from running then.

Pause/circuit state and message history live in Azure Tables (shared by every host and instance).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hashlib
import json
import logging
import math
import re
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from azure.core.exceptions import (
    AzureError,
    HttpResponseError,
    ResourceExistsError,
    ResourceNotFoundError,
    ServiceRequestError,
    ServiceResponseError,
)
from azure.storage.queue.aio import QueueClient, QueueServiceClient

from .. import retry_policy
from ..clock import utcnow
from ..connections import STORAGE, StorageConnection, no_table_uri
from ..decisions import (
    Complete,
    DeadLetter,
    DeadLetterReason,
    Decision,
    Defer,
    Expire,
    Release,
    RetryAfter,
    due_at,
)
from ..envelope import Envelope, dead_letter_marks, malformed_identity
from ..errors import (
    ConfigurationError,
    InvalidOperation,
    MalformedEnvelope,
    ProviderError,
    ProviderUnavailable,
    first_line,
)
from ..logs import without_url_queries
from ..messages import MessageStatus
from ..naming import QueueNaming, Transport
from ..tracking.base import nothing_to_reopen
from ..transport import Capabilities, Delivery, Settlement, settled_each
from .dead_letters import (
    HOLD_SECONDS,
    SCAN_LIMIT,
    DeadLetterOps,
    LetterPass,
    id_in_text,
    is_whole_queue,
    read_letters,
)
from .names import PhysicalNames, companion_name
from .storage_errors import refusal
from .tables import TablesControlStore, TablesTracker, tables_from_connection

if TYPE_CHECKING:
    from ..app import QueueingApp, Subscription
    from ..tracking import MessageQuery, MessageRecord, Reopen
    from .delayed import DelayedDispatcher, DelayedMessage, SqlDelayedStore
    from .sql.history import SideStores

log = logging.getLogger("queueing.storage_queue")

POISON_SUFFIX = "-poison"
MAX_VISIBILITY = timedelta(days=7)  # the service's limit on a visibility timeout
#: what one queue message holds: 64 KiB of its text in UTF-8 (the service's limit)
MAX_WIRE_BYTES = 64 * 1024
#: 64 KiB of base64 text carries 48 KiB of text: what one queue message (and a poison copy) holds
MAX_TEXT_BYTES = 48 * 1024
#: room a message keeps for the marks its dead-letter copy adds (reason, time, a cut description)
DEAD_LETTER_ROOM = 1024
#: the largest envelope the kit sends: its dead-letter copy must fit in the poison queue too
MAX_ENVELOPE_BYTES = MAX_TEXT_BYTES - DEAD_LETTER_ROOM
#: delayed-store rows remembered as dead-lettered while their history write fails
_LETTERED_MEMORY = 10_000
#: the history's description of a letter the Functions host moved to the poison queue itself
HOST_MOVED = (
    "moved to the poison queue by the Functions host after its dequeue limit (maxDequeueCount): "
    "every invocation of it failed before the kit could settle it"
)
#: the year of the expiry the service reports for a message sent without a time-to-live (-1): never
_NEVER_YEAR = 9999
#: how often one process looks for letters the Functions host moved (a look at a long poison queue
#: hides and hands back every letter in it; those letters have days left)
HOST_LETTERS_EVERY = timedelta(minutes=30)
#: the longest one look at the poison queues for such letters reads: the rest wait for the next look
#: (after an outage the host may have moved thousands, and the look runs in a Functions timer whose
#: invocation the host's functionTimeout ends, with every other invocation of its process)
HOST_LETTERS_BUDGET = 60.0
#: how far the service's clock (a letter's insertion time, in whole seconds) and the hosts' (the history's
#: times) may be apart: a history is newer than a letter only by more. Taken wide: a letter wrongly
#: thought older than its history would be left to expire, a loss; one wrongly thought newer only has
#: its history written again
CLOCKS_APART = timedelta(minutes=5)
#: the statuses of a message that finished other than in a dead letter
FINISHED_ELSEWHERE = frozenset(
    {MessageStatus.SUCCEEDED.value, MessageStatus.CANCELLED.value, MessageStatus.EXPIRED.value}
)


def whole_seconds(delay: timedelta) -> int:
    """The service counts visibility in whole seconds: round up, never down to "now", cap at 7 days."""
    return math.ceil(min(max(delay, timedelta(0)), MAX_VISIBILITY).total_seconds())


@dataclass
class _Handle:
    queue_client: QueueClient
    id: str
    pop_receipt: str
    dequeue_count: int
    #: no other run can receive the message before this (counted from before the call that hid it, so
    #: the service's own end is later)
    hidden_until: datetime
    #: a renewal and the settlement of one message take turns: each update replaces the pop receipt,
    #: and a delete sent with the receipt a renewal in flight is about to replace would fail
    turn: asyncio.Lock = field(default_factory=asyncio.Lock)
    settled: bool = False
    #: a settlement's copy is on its way (or about to be): the worker's renewals pass it by rather
    #: than wait their turn behind it, since the copy renews the hold itself (waiting behind a slow one
    #: held up the renewal of every other message of the worker, whose leases ran out: found in
    #: review). Only then: a delete tried again renews nothing itself, and the renewals that wait
    #: their turn run between its tries
    copying: bool = False
    #: the settlement's copy or dead letter is sent: the settler's next try after a failed delete goes
    #: on from there, not sending another (each try sent one: up to five copies that all ran)
    prepared: bool = False
    #: a delete of this message went unanswered (it may have reached the service): kept on the handle,
    #: not in one call, because the settler tries again in a new call, whose 404 may be that delete's
    #: work, not a lost lease
    delete_unanswered: bool = False


def _fits(text: str) -> bool:
    return len(text.encode()) <= MAX_TEXT_BYTES


def copy_for_later(copy: Envelope, due: datetime, now: datetime) -> Envelope:
    """``copy`` (see :meth:`Delivery.copy_after`), to run at ``due``. A due beyond the
    visibility limit is written into the copy (``not_before``): the service shows it when the limit
    ends, and without its due time the copy would run then, early; with it, the pipeline hides it
    again until it is due (or the delayed store keeps it)."""
    if due - now > MAX_VISIBILITY:
        later = copy.model_copy(update={"not_before": due})
        if wire_text(later.encode_text()) is not None:
            return later
        # (another producer's envelope so near the limit that its due time does not fit: it comes back
        # when the visibility limit ends, days early, rather than not at all)
        log.warning("a copy of %s is too large to carry its due time: it shows after 7 days", copy.message_id)
    return copy


def poison_text(d: Delivery, decision: DeadLetter, now: datetime) -> str:
    """The text of ``d``'s dead-letter copy, never more than one queue message holds: a copy the
    service refused (413) would fail every settlement of the message, which would come back and run
    again for ever. An envelope keeps its body whole and carries the reason; its description is cut
    to the room left. Text that is not an envelope (or an envelope too large even so, sent by
    another producer) is kept in a wrapper under the id the history gives it, its text cut when it
    does not fit (with its length and SHA-256, and the history keeps the text it was received with)."""
    description = decision.description
    if d.envelope is not None:
        while True:
            marks = dead_letter_marks(decision.reason.value, description, now)
            env = d.envelope.model_copy(
                update={"attempt": d.attempts_used(decision), "headers": {**d.envelope.headers, **marks}}
            )
            text = env.encode_text()
            if _fits(text) or not description:
                break
            description = description[: len(description) // 2]
        if _fits(text):
            return text
    return raw_poison_text(d.text(), decision.reason.value, description, now)


def raw_poison_text(
    raw: str, reason: str, description: str, now: datetime, message_id: uuid.UUID | None = None
) -> str:
    """The dead-letter copy of text that is not an envelope (see :func:`poison_text`), under the id
    the history lists it by: ``message_id`` where the kit gave it one (a delayed-store row's)."""
    derived_id, tracking_id, type_name = malformed_identity(raw)
    message_id = message_id or derived_id
    wrapper: dict[str, Any] = {
        # the ids the history lists the message under: the dead-letter locator reads them here
        "message_id": str(message_id),
        "tracking_id": str(tracking_id),
        # every field but the text bounded in bytes (at most 256 and 4,000 characters, 4 bytes each
        # in UTF-8), so the wrapper with no text at all always fits and the cut below ends
        "type": type_name,
        "dead_letter": {
            "reason": reason,
            "description": description[:4000],
            "at": now.isoformat(),
        },
        "raw": raw,
    }
    text = _json(wrapper)
    if not _fits(text):
        digest = hashlib.sha256(raw.encode()).hexdigest()
        wrapper.update(raw_length=len(raw), raw_sha256=digest, raw_truncated=True)
        keep = len(raw)
        while not _fits(text := _json({**wrapper, "raw": raw[:keep]})) and keep:
            keep //= 2
    return text


def _json(doc: dict[str, Any]) -> str:
    # as UTF-8, not \u escapes: a character beyond the BMP is 4 bytes, not 12 (the limit is in bytes)
    return json.dumps(doc, ensure_ascii=False)


def encode_body(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


#: characters a queue message's text may not hold as it is: it travels as XML 1.0 text, which has no
#: place for most control characters, surrogates and U+FFFE/U+FFFF, and whose parser turns a CR into a
#: LF (JSON from the kit escapes every control character, so an envelope of its has none of these)
_NOT_XML_SAFE = re.compile("[^\t\n\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def wire_text(text: str) -> str | None:
    """What is sent for ``text``: base64, as the kit sends everything, when it fits in a queue
    message; else the text as it is, where the service keeps it unchanged (the kit reads either). An
    envelope from another producer may be up to 64 KiB of plain text: its copies (a retry, a pause, a
    deferral) in base64, a third larger, would be refused on every try, and the message would come
    back until its attempts ran out, dead-lettered unrun. None: it fits in neither form."""
    encoded = encode_body(text)
    if len(encoded) <= MAX_WIRE_BYTES:
        return encoded
    if len(text.encode()) <= MAX_WIRE_BYTES and not _NOT_XML_SAFE.search(text):
        return text
    return None


def too_large_to_copy(env: Envelope, text: str, attempt: int) -> str | None:
    """Why no copy of ``env`` (received as ``text``) could be sent, or None. A copy carries the attempts
    used and may carry a due time; checked on receipt, so such a message is dead-lettered at once with
    this reason rather than run, fail to send its copies and come back until its attempts are spent."""
    if len(text) * 4 + 512 <= MAX_TEXT_BYTES:
        return None  # (cheap: well within what base64 carries, whatever the characters)
    # the largest copy a settlement within the visibility limit sends (a retry, a pause, a deferral):
    # the most attempts it can carry, its own due time (a copy for later than the limit that does not
    # fit goes without its due time: ``copy_for_later``)
    copy = env.with_attempt(attempt + 1).encode_text()
    if wire_text(copy) is not None:
        return None
    return (
        f"the envelope is {len(text.encode())} bytes of plain text: a copy of it (for a retry, a pause or "
        f"a deferral) does not fit in a queue message ({MAX_WIRE_BYTES} bytes) in any form, so it is "
        "dead-lettered before it runs"
    )


def storage_delivery(
    text: str, *, queue: str, delivery_count: int, handle: Any = None, lease_until: datetime | None = None
) -> Delivery:
    """The delivery of a queue message's decoded text (the worker's receive and the Functions trigger)."""
    d = Delivery.of(text, queue=queue, delivery_count=delivery_count, handle=handle, lease_until=lease_until)
    if d.envelope is not None and (why := too_large_to_copy(d.envelope, text, d.attempt)) is not None:
        # not an envelope this transport can carry: dead-lettered by the pipeline with this reason
        malformed = MalformedEnvelope(why, text)
        d = Delivery(queue, text, None, malformed, max(1, delivery_count), handle, lease_until=lease_until)
    return d


def decode_body(content: str) -> str:
    """Base64 text (the Functions trigger's default) or, failing that, the text as it is."""
    try:
        return base64.b64decode(content, validate=True).decode()
    except (binascii.Error, ValueError, UnicodeDecodeError):
        return content


@contextlib.contextmanager
def _boundary(action: str) -> Iterator[None]:
    """SDK errors become the kit's: unreachable -> ProviderUnavailable, the rest -> ProviderError.
    An SDK error is said by its type and first line, any URL's query string hidden: the text of one
    raised by the HTTP client quotes the request's URL, whose query string holds a SAS token."""
    try:
        yield
    except (ServiceRequestError, ServiceResponseError, OSError) as exc:
        raise ProviderUnavailable(
            f"storage queue service unreachable during {action}: {without_url_queries(first_line(exc))}"
        ) from None
    except HttpResponseError as exc:
        if exc.status_code in (408, 429, 500, 502, 503, 504):
            raise ProviderUnavailable(f"storage queue service busy during {action}: {exc.reason}") from None
        refused = refusal(exc, "queue", action)
        if refused is not None:
            raise refused from None
        if exc.status_code is None:
            # no answer to quote: the request was never sent (the SDK could not sign it with an
            # AccountKey that is not base64); its own words say why, and hold no part of the key
            raise ProviderError(f"{action} failed: {without_url_queries(first_line(exc))}") from None
        raise ProviderError(f"{action} failed: {exc.status_code} {exc.reason}") from None
    except AzureError as exc:
        raise ProviderError(f"{action} failed: {without_url_queries(first_line(exc))}") from None


class _ReceiptLost(ProviderError):
    """The pop receipt no longer holds the message: its visibility ran out and another receive took
    it (the service answers 400 PopReceiptMismatch), or the message is gone (404)."""


class _MessageGone(_ReceiptLost):
    """The message is no longer in the queue (404)."""


class _DeleteUnconfirmed(_ReceiptLost):
    """The message is gone (404) after a delete of ours went unanswered, found so once it could have
    been received again: our delete may have removed it, or the run that received it after us."""


@contextlib.contextmanager
def _receipt_held() -> Iterator[None]:
    try:
        yield
    except ResourceNotFoundError:
        raise _MessageGone("the message is gone from the queue") from None
    except HttpResponseError as exc:
        # the storage SDK adds the service's x-ms-error-code to its errors as ``error_code``
        if exc.status_code == 400 and getattr(exc, "error_code", None) == "PopReceiptMismatch":
            raise _ReceiptLost("another receive holds it: the pop receipt no longer matches") from None
        raise


class _PoisonPages:
    """A poison queue read page by page: letters passed over stay hidden (so the next receive
    returns the ones after them) until the scan makes them visible again."""

    #: a queue message id is the letter's own for good (its pop receipt is not): a letter whose hold
    #: lapsed and was received again can be found again by it and no other letter matches
    keys_outlive_holds = True

    def __init__(self, poison: QueueClient) -> None:
        self.poison = poison

    async def next_page(self) -> list[Any]:
        return [
            m
            async for m in self.poison.receive_messages(
                messages_per_page=32, visibility_timeout=HOLD_SECONDS, max_messages=32
            )
        ]

    def message_id(self, item: Any) -> str:
        text = decode_body(item.content)
        try:
            doc = json.loads(text)
        except (ValueError, RecursionError):  # (JSON nested deeper than the interpreter's stack goes)
            doc = None
        if isinstance(doc, dict) and "message_id" not in doc and isinstance(doc.get("raw"), str):
            # the wrapper of a body that was not an envelope, as versions before wrote it (no id of its
            # own): the id is the one the history gave the text it keeps
            return id_in_text(doc["raw"])
        return id_in_text(text)

    def key(self, item: Any) -> Any:
        return item.id

    async def remove(self, item: Any) -> None:
        await self.poison.delete_message(item.id, item.pop_receipt)

    async def total(self) -> int | None:
        # letters hidden by a reader that died come back when their visibility timeout ends
        return int((await self.poison.get_queue_properties()).approximate_message_count or 0)

    async def hand_back(self, items: Sequence[Any]) -> None:
        for m in items:
            await self.poison.update_message(m.id, m.pop_receipt, visibility_timeout=0)


def never_expires(letter: Any) -> bool:
    """Whether a queue message was sent without a time-to-live (the service reports 9999-12-31)."""
    expires: datetime | None = letter.expires_on
    return expires is None or expires.year >= _NEVER_YEAR


class _HostLetters(_PoisonPages):
    """A poison queue read for the letters the Functions host moved there itself: each letter
    "removed" is first kept for good by ``keep`` (a copy without a time-to-live), then deleted; one
    ``keep`` leaves as it is goes back to the queue, to run out its time-to-live."""

    def __init__(self, poison: QueueClient, keep: Callable[[Any], Awaitable[bool]]) -> None:
        super().__init__(poison)
        self._keep = keep
        self.kept = 0
        #: letters ``keep`` left as they are: handed back when the pass ends (before, it read them again)
        self.left: list[Any] = []

    async def remove(self, item: Any) -> None:
        # copy first: a failure before the delete leaves two letters, not none
        if await self._keep(item):
            await super().remove(item)
            self.kept += 1
        else:
            self.left.append(item)


class StorageQueueProvider(DeadLetterOps, PhysicalNames):
    transport = Transport.STORAGE_QUEUE

    def __init__(
        self,
        connection: StorageConnection,
        *,
        naming: QueueNaming | None = None,
        auto_create: bool = True,
        control_table: str = "queueingcontrol",
        tracker_table: str = "queueinghistory",
        tracker_retention: timedelta = timedelta(days=14),
        concurrency: int = 16,
        delayed_stores: SideStores | None = None,
        delayed_retries: int = 3,
    ) -> None:
        self.connection = connection
        self.naming = naming
        self.auto_create = auto_create
        self.capabilities = Capabilities(
            max_delay=MAX_VISIBILITY,
            lock_renewal=True,
            native_dead_letter=True,
            max_message_bytes=MAX_ENVELOPE_BYTES,
            purge_takes_held=True,
            # its poison queue keeps a letter for good (sent without a time-to-live); an expired message
            # is deleted, not dead-lettered, so its history may go
            dead_letters_kept=(MessageStatus.DEAD_LETTERED.value,),
        )
        # delays beyond the 7-day visibility limit: rows in the SQL delayed store when one is given,
        # else re-hidden for another 7 days on each arrival (no database needed)
        self.stores = delayed_stores
        #: delayed-store rows whose dead letter is in the poison queue while their history write
        #: failed: the dispatcher's next try writes the history only (each try sent another letter
        #: while Tables was down); bounded, and a restart sends at most one more
        self._lettered: OrderedDict[uuid.UUID, None] = OrderedDict()
        self.delayed: SqlDelayedStore | None = None
        self.dispatcher: DelayedDispatcher | None = None
        if delayed_stores is not None:
            from .delayed import DelayedDispatcher

            self.delayed = delayed_stores.delayed_store(Transport.STORAGE_QUEUE)
            self.dispatcher = DelayedDispatcher(self.delayed, self, retries=delayed_retries)
        self._credential = connection.credential() if connection.connection_string is None else None
        if connection.connection_string is not None:
            try:
                self._service = QueueServiceClient.from_connection_string(
                    connection.connection_string, **retry_policy.azure_storage_queue()
                )
            except ValueError as exc:  # (the SDK's word for it names no secret)
                raise ConfigurationError(STORAGE, f"invalid connection string: {exc}") from None
            # the SDK reads an AccountKey only to sign the first request, whose failure then read
            # "failed: None None" (no answer to quote); decoded here as it decodes it, start-up says so
            key = getattr(self._service.credential, "account_key", None)
            if isinstance(key, str):
                try:
                    # (as the SDK decodes it: its UTF-8 bytes, whose non-base64 characters, a pasted
                    # no-break space say, it skips; decoded as text, such a key raised a ValueError)
                    base64.b64decode(key.encode("utf-8"))
                except binascii.Error as exc:  # (its text counts the key's characters, shows none)
                    raise ConfigurationError(
                        STORAGE,
                        f"its AccountKey is not base64: {exc}",
                        "the account's key as the portal shows it",
                    ) from None
            control, tracker = tables_from_connection(
                connection.connection_string,
                control_table=control_table,
                tracker_table=tracker_table,
                retention=tracker_retention,
            )
        else:
            if not connection.table_service_uri:
                raise no_table_uri(STORAGE)
            assert connection.queue_service_uri is not None
            self._service = QueueServiceClient(
                connection.queue_service_uri,
                credential=self._credential,
                **retry_policy.azure_storage_queue(),
            )
            control, tracker = tables_from_connection(
                table_service_uri=connection.table_service_uri,
                credential=self._credential,
                control_table=control_table,
                tracker_table=tracker_table,
                retention=tracker_retention,
            )
        self._control: TablesControlStore = control
        self._tracker: TablesTracker = tracker
        self._clients: dict[str, QueueClient] = {}
        self._created: set[str] = set()
        self._limit = asyncio.Semaphore(concurrency)
        self._wakeups: dict[str, asyncio.Event] = {}
        self._app: QueueingApp | None = None
        #: when this process last looked for letters the Functions host moved (see ``maintain``)
        self._host_letters_at: datetime | None = None

    # -- wiring ------------------------------------------------------------------------------------
    def control_store(self) -> TablesControlStore:
        return self._control

    def tracker(self) -> TablesTracker:
        return self._tracker

    def poison_name(self, queue: str) -> str:
        return companion_name(self.physical(queue), POISON_SUFFIX, Transport.STORAGE_QUEUE)

    def client(self, physical: str) -> QueueClient:
        c = self._clients.get(physical)
        if c is None:
            c = self._clients[physical] = self._service.get_queue_client(physical)
        return c

    async def _ensure(self, physical: str) -> QueueClient:
        c = self.client(physical)
        if self.auto_create and physical not in self._created:
            with _boundary(f"creating queue {physical}"), contextlib.suppress(ResourceExistsError):
                await c.create_queue()
            self._created.add(physical)
        return c

    async def open(self, app: QueueingApp) -> None:
        self._app = app
        if self.stores is not None:
            await self.stores.open()
        for sub in app.subscriptions():
            await self._ensure(self.physical(sub.queue))
            await self._ensure(self.poison_name(sub.queue))

    async def close(self) -> None:
        for c in self._clients.values():
            await c.close()
        self._clients.clear()
        await self._service.close()
        await self._control.aclose()
        await self._tracker.aclose()
        if self.stores is not None:
            await self.stores.close()
        if self._credential is not None:
            await self._credential.close()

    # -- producing ---------------------------------------------------------------------------------
    async def put(self, queue: str, env: Envelope, visible_in: timedelta, now: datetime) -> None:
        """Send one envelope, hidden for ``visible_in`` (callers hold the concurrency limit)."""
        physical = self.physical(queue)
        c = await self._ensure(physical)  # also before a store: the dispatcher forwards to it
        if self.delayed is not None and visible_in > MAX_VISIBILITY:
            await self.delayed.store(env, physical, now + visible_in)
            return
        await self._put_physical(c, env, visible_in, now)

    async def _put_physical(
        self, c: QueueClient, env: Envelope, visible_in: timedelta, now: datetime
    ) -> None:
        hide = min(max(visible_in, timedelta(0)), MAX_VISIBILITY)
        text = env.encode_text()
        content = wire_text(text)
        if content is None:  # (a received envelope too large to copy is dead-lettered on receipt)
            raise ProviderError(
                f"sending to {c.queue_name} failed: {len(text.encode())} bytes do not fit in a queue message"
            )
        with _boundary(f"sending to {c.queue_name}"):
            # no TTL (see the module's note): the kit records a message's expiry when it reads it
            await c.send_message(content, visibility_timeout=whole_seconds(hide), time_to_live=-1)

    async def _limited(self, aw: Awaitable[None]) -> None:
        async with self._limit:
            await aw

    async def send(self, envelopes: Sequence[Envelope], *, wait: bool = False) -> None:
        # each send is acknowledged by the service after it is stored: ``wait`` holds either way
        now = utcnow()
        await asyncio.gather(
            *(
                self._limited(
                    self.put(e.queue, e, (e.not_before - now) if e.not_before else timedelta(0), now)
                )
                for e in envelopes
            )
        )
        for e in envelopes:
            if e.not_before is None:
                self._wake(e.queue)

    # -- consuming ---------------------------------------------------------------------------------
    async def receive(self, sub: Subscription, max_messages: int) -> list[Delivery]:
        c = await self._ensure(self.physical(sub.queue))
        lease = min(sub.options.lease_duration, MAX_VISIBILITY)
        out: list[Delivery] = []
        # the visibility timeout starts when the service hands each message over, within this call: a
        # lease counted from the clock once a message is here would overstate what is left by the call's
        # time (a stalled process would renew too late); counted from before the call, it errs the safe
        # way (the messages of a later page are renewed a little early)
        sent_at = utcnow()
        try:
            with _boundary(f"receiving from {sub.queue}"):
                pages = c.receive_messages(
                    messages_per_page=min(32, max_messages),
                    visibility_timeout=whole_seconds(lease),
                    max_messages=max_messages,
                )
                async for msg in pages:
                    count = msg.dequeue_count or 1
                    handle = _Handle(c, msg.id, msg.pop_receipt or "", count, sent_at + lease)
                    out.append(
                        storage_delivery(
                            decode_body(msg.content),
                            queue=sub.queue,
                            delivery_count=count,
                            handle=handle,
                            lease_until=sent_at + lease,
                        )
                    )
        except ProviderError as exc:
            if not out:
                raise
            # a later page failed: the earlier pages' messages are ours, hidden for the lease and their
            # dequeue counted. Raising would leave them to come back only when it runs out, an attempt
            # used unrun (and a message on its last one dead-lettered unrun): run them now
            log.warning(
                "receiving from %s stopped after %d message(s): %s", sub.queue, len(out), first_line(exc)
            )
        return out

    def _wake(self, queue: str) -> None:
        event = self._wakeups.get(queue)
        if event is not None:
            event.set()

    async def wait_for_work(self, sub: Subscription, timeout: float) -> None:
        # Storage has no push; a send from this process cuts the wait short
        event = self._wakeups.setdefault(sub.queue, asyncio.Event())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout)
        event.clear()

    async def _delete(self, h: _Handle) -> None:
        """Delete under our receipt. The SDK's own retry is off here: when a delete reaches the service
        but its answer is lost, the retry finds the message gone (404) and cannot tell that from a
        message another run deleted. This loop can: a 404 after our own unanswered try is our delete
        when it came while the message was still hidden under our receipt (no other run could have
        received it yet); any other 404 is a lost lease. Once the message could have been received
        again, the current holder may have deleted it (a stale run taking that for its own delete
        would record its outcome over the holder's), so the settlement is refused, marked unconfirmed:
        the runtime records its outcome unless a later run has recorded one.

        The unanswered try is remembered on the handle: when every try here goes unanswered, the
        settler tries again in a new call, and that call's 404 is judged by the same rule."""
        for attempt in range(retry_policy.RETRIES + 1):
            try:
                with _boundary("deleting a message"), _receipt_held():
                    await h.queue_client.delete_message(h.id, h.pop_receipt, retry_total=0)
                return
            except _MessageGone:
                if not h.delete_unanswered:
                    raise
                # answered while the message was still hidden under our receipt (the service's own
                # end of it is later than ours): no other run could have received it, so our earlier
                # try deleted it. The time of the answer, not of the send: a request may reach the
                # service seconds after it leaves (a new connection's handshake)
                if utcnow() < h.hidden_until:
                    return
                raise _DeleteUnconfirmed(
                    "the message is gone from the queue after a delete went unanswered"
                ) from None
            except ProviderUnavailable:
                h.delete_unanswered = True
                if attempt == retry_policy.RETRIES:
                    raise
                await asyncio.sleep(min(retry_policy.BACKOFF_MAX, retry_policy.BACKOFF_FIRST * 2**attempt))

    async def _hide(self, h: _Handle, delay: timedelta) -> None:
        """Hide the message for ``delay`` under our receipt (which the service then replaces)."""
        sent_at = utcnow()
        with _boundary("re-hiding a message"), _receipt_held():
            receipt = await h.queue_client.update_message(
                h.id, h.pop_receipt, visibility_timeout=whole_seconds(delay)
            )
        h.pop_receipt = receipt.pop_receipt or h.pop_receipt
        h.hidden_until = sent_at + timedelta(seconds=whole_seconds(delay))

    def _lease(self, d: Delivery) -> timedelta:
        sub = self._app.subscription(d.type_name) if self._app and d.type_name else None
        return min(sub.options.lease_duration if sub else timedelta(seconds=30), MAX_VISIBILITY)

    async def _settle_one(self, s: Settlement) -> None:
        d, decision = s.delivery, s.decision
        h: _Handle = d.handle
        now = utcnow()
        # (set before the turn is awaited: a renewal that comes meanwhile passes it by)
        h.copying = not h.prepared and self._copies(decision)
        try:
            await self._settle_held(d, decision, h, now)
        finally:
            h.copying = False

    @staticmethod
    def _copies(decision: Decision) -> bool:
        """Whether settling ``decision`` writes a copy first (all but a delete and a re-hide)."""
        if isinstance(decision, Complete | Expire):
            return False
        return not (isinstance(decision, RetryAfter) and decision.delay <= MAX_VISIBILITY)

    async def _settle_held(self, d: Delivery, decision: Decision, h: _Handle, now: datetime) -> None:
        async with h.turn, self._limit:
            try:
                if isinstance(decision, Complete | Expire):
                    await self._delete(h)
                elif not self._copies(decision):
                    assert isinstance(decision, RetryAfter)
                    await self._hide(h, decision.delay)  # the next dequeue counts the attempt
                else:
                    # A copy goes first (a dead letter, a deferral's fresh copy, or a retry later than
                    # the service can hide a message, whose copy carries its due time) and the
                    # original is deleted after. Renewing the lease first proves this receipt still
                    # holds the message, so a run whose lease passed on writes no copy at all; the
                    # hold is renewed until the copy has landed (``_copy_within_hold``). Once
                    # the copy is out (an earlier call's), only the delete is left: a renewal then
                    # proves nothing, and its 404 may be that earlier call's delete landing unanswered.
                    if not h.prepared:
                        if d.envelope is None and not isinstance(decision, DeadLetter):
                            return  # cannot happen: malformed bodies are dead-lettered on receipt
                        await self._hide(h, self._lease(d))
                        await self._copy_within_hold(h, d, decision, now)
                        h.prepared = True
                        h.copying = False  # (the renewals that come now wait for the delete)
                    await self._delete(h)
            except _DeleteUnconfirmed as exc:
                # not known to be ours: not applied, but recorded unless a later run recorded its own
                d.refuse(str(exc))
                d.unconfirmed = True
            except _ReceiptLost as exc:
                d.refuse(str(exc))
            # only once it is done (or refused) does a renewal waiting for its turn have nothing left to
            # renew: a settlement that failed is tried again by the worker, and until then the lease is
            # renewed as the handler's was (a lease that ran out meanwhile would run the message again)
            h.settled = True

    async def _copy_within_hold(
        self, h: _Handle, d: Delivery, decision: DeadLetter | RetryAfter | Defer | Release, now: datetime
    ) -> None:
        """Write the settlement's copy while the original stays hidden under this run's receipt: the
        hold is renewed (a lease at a time) for as long as the copy is on its way, so a slow copy lands
        while no other run can have the message. Hidden for one lease only, a copy that took longer
        landed after another run had received the message and completed it: the stale run's letter, or
        a fresh copy that ran again, stood beside that run's outcome (found in review). Given up in two
        cases only: the receipt is refused (another run has the message, or a renewal of ours whose
        answer was lost replaced the receipt; a copy that reached the service all the same is then a
        duplicate), or the hold cannot be renewed and less than a third of
        it is left (the service does not answer; the settler tries again from the hiding). Cancelled,
        not waited out, a copy whose answer was only slow was sent again on each try of the settler
        (found in review)."""
        lease = self._lease(d)
        copy = asyncio.ensure_future(self._copy(d, decision, now))
        try:
            while True:
                # renewed a third into each hold; tried again soon when a renewal fails
                wait = max((h.hidden_until - lease * 2 / 3 - utcnow()).total_seconds(), 0.0)
                done, _ = await asyncio.wait({copy}, timeout=wait or min(1.0, lease.total_seconds() / 10))
                if done:
                    copy.result()  # (its failure is the settlement's)
                    return
                try:
                    await self._hide(h, lease)
                except ProviderUnavailable:
                    if h.hidden_until - utcnow() < lease / 3:
                        raise ProviderUnavailable(
                            "a settlement's copy was still on its way with the message's hold nearly "
                            "over and the service not answering: given up, and tried again"
                        ) from None
        finally:
            if not copy.done():
                copy.cancel()
                await asyncio.wait({copy})  # (its cancellation; never raises the copy's error)

    async def _copy(
        self, d: Delivery, decision: DeadLetter | RetryAfter | Defer | Release, now: datetime
    ) -> None:
        if isinstance(decision, DeadLetter):
            await self.dead_letter(d, decision, now)
            return
        due = due_at(decision, now) or now
        # a fresh copy starts at dequeue_count 0: its envelope counts the attempts
        await self.put(d.queue, copy_for_later(d.copy_after(decision), due, now), due - now, now)

    async def dead_letter(self, d: Delivery, decision: DeadLetter, now: datetime) -> None:
        """Put ``d`` in ``<queue>-poison`` with the reason (the original is settled by the caller)."""
        poison = await self._ensure(self.poison_name(d.queue))
        text = poison_text(d, decision, now)
        with _boundary(f"dead-lettering to {poison.queue_name}"):
            await poison.send_message(encode_body(text), time_to_live=-1)

    async def settle(self, settlements: Sequence[Settlement]) -> None:
        results = await asyncio.gather(*(self._settle_one(s) for s in settlements), return_exceptions=True)
        # one that failed after its delete went unanswered may have been deleted all the same, and then
        # it never comes back for a later run to record: its outcome is recorded unless a later run has
        # recorded its own, whether the rest settled (those that failed then count as refused) or the
        # settler gives the batch up after its tries (marked before ``settled_each`` raises)
        for s, r in zip(settlements, results, strict=True):
            if isinstance(r, BaseException) and s.delivery.handle.delete_unanswered:
                s.delivery.unconfirmed = True
        settled_each(settlements, results, "Storage Queues")

    async def renew(self, deliveries: Sequence[Delivery]) -> list[Delivery]:
        lost: list[Delivery] = []

        async def one(d: Delivery) -> None:
            h: _Handle = d.handle
            lease = self._lease(d)
            if h.copying:
                return  # its settlement renews it while the copy is on its way
            try:
                async with h.turn:
                    if h.settled:
                        return
                    async with self._limit:
                        sent_at = utcnow()  # (as for a receive: the new timeout starts within the call)
                        await self._hide(h, lease)
                d.lease_until = sent_at + lease
            except ProviderError:
                lost.append(d)

        await asyncio.gather(*(one(d) for d in deliveries))
        return lost

    # -- ops actions -------------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def _dead_letter_pages(self, queue: str) -> AsyncIterator[_PoisonPages]:
        poison = await self._ensure(self.poison_name(queue))
        with _boundary(f"scanning {poison.queue_name}"):
            yield _PoisonPages(poison)

    async def ops_retry(
        self, record: MessageRecord, envelope: Envelope, now: datetime, reopen: Reopen = nothing_to_reopen
    ) -> bool:
        wanted = {str(record.message_id)}
        in_poison = record.status == "DeadLettered"
        if record.status in ("Failed", "Sleeping"):
            # the Functions host moves a message to the poison queue itself after its dequeue limit
            # (every invocation failed in the kit, say with its Tables unreachable), leaving the
            # history as the last run wrote it: the poison queue, not the history, says where it is.
            # Only once its copy was due: the host moves a message only after it became visible, and
            # a look reads (and hides) the whole poison queue, which every retry of a message waiting
            # for its backoff paid (a dashboard's bulk retry once for each; found in review)
            due = record.not_before is None or record.not_before <= now
            in_poison = due and bool(await self._dead_letters(record.queue, wanted, remove=False))
            if not in_poison:
                raise InvalidOperation(
                    f"message {record.message_id} is hidden in its queue until {record.not_before}: "
                    "Storage Queues cannot bring a scheduled message forward (it runs then)"
                )

        # the copy is sent before the original leaves: a failure in between leaves two, never none
        async def send() -> None:
            async with reopen():
                await self.put(record.queue, envelope, timedelta(0), now)
            self._wake(record.queue)

        if in_poison:
            # the poison letters are found (and hidden) before the copy is sent, and only those are
            # deleted after, by id and pop receipt: the copy may run and be dead-lettered again
            # meanwhile, and its new letter stays (a hold that lapsed and was taken by another reader
            # leaves the old letter, a duplicate, never a loss)
            await self._dead_letters(record.queue, wanted, before_removing=send)
        else:
            await send()
        return True

    async def ops_release(self, record: MessageRecord, now: datetime) -> bool:
        raise InvalidOperation(
            "Storage Queues lease a message to its receiver alone (pop receipt): only the "
            "holder can release it; it returns by itself when its visibility timeout ends"
        )

    async def ops_archive(self, record: MessageRecord, now: datetime) -> bool:
        return True  # a flag in the history; the message itself left the queue when it finished

    async def ops_remove(self, query: MessageQuery, records: Sequence[MessageRecord]) -> set[uuid.UUID]:
        """Dead letters are removed from the poison queue; a purge of a whole queue clears it, its
        poison queue and its messages in the delayed store. Messages waiting in a live queue cannot be
        picked out one by one (receiving them would use attempts). Returns the ids of the messages
        removed: only their history goes."""
        if is_whole_queue(query):
            assert query.queue is not None
            stays: set[uuid.UUID] = set()
            if self.delayed is not None:
                # first, as on the other transports (side_stores): a delay beyond the visibility limit
                # waits there, reported removed with the rest; a forward due meanwhile lands in the
                # queue before its clearing (one stored there meanwhile stays: left, with its history)
                stays = (await self.delayed.purge(self.physical(query.queue))).left
            for name in (self.physical(query.queue), self.poison_name(query.queue)):
                with _boundary(f"clearing {name}"):
                    await (await self._ensure(name)).clear_messages()
            return {r.message_id for r in records if r.message_id not in stays}
        dead = [r for r in records if r.status == "DeadLettered"]
        removed: set[str] = set()
        for queue in {r.queue for r in dead}:
            wanted = {str(r.message_id) for r in dead if r.queue == queue}
            removed |= await self._dead_letters(queue, wanted)
        return {r.message_id for r in records if str(r.message_id) in removed}

    # -- the delayed store (only with one configured) ----------------------------------------------
    def background_tasks(self) -> list[Callable[[], Awaitable[None]]]:
        return [self.dispatcher.run] if self.dispatcher is not None else []

    async def dispatch_due(self, budget_seconds: float) -> int:
        """Forward the due delayed messages within ``budget_seconds`` (the Functions timer)."""
        return await self.dispatcher.dispatch_due(budget_seconds) if self.dispatcher is not None else 0

    async def forward_delayed(self, item: DelayedMessage) -> None:
        now = utcnow()
        try:
            env = Envelope.decode(item.envelope)
        except MalformedEnvelope as exc:
            # no run could read it: straight to the poison queue with its reason (a failed decode here
            # would fail every forward, then the dead letter, and leave the row due for ever)
            await self._dead_letter_stored_text(item, f"a delayed message is not an envelope: {exc}", now)
            return
        await self._put_physical(await self._ensure(item.destination), env, timedelta(0), now)

    async def dead_letter_delayed(self, item: DelayedMessage, description: str) -> None:
        from .delayed import FORWARD_FAILED, forward_failed_record

        now = utcnow()
        try:
            env = Envelope.decode(item.envelope)
        except MalformedEnvelope:
            await self._dead_letter_stored_text(item, description, now)
            return
        marked = env.model_copy(
            update={"headers": {**env.headers, **dead_letter_marks(FORWARD_FAILED, description, now)}}
        )
        await self._letter_once(item, marked.encode_text())
        await self._tracker.upsert([forward_failed_record(env, description, now)])
        self._lettered.pop(item.id, None)

    async def _letter_once(self, item: DelayedMessage, text: str) -> None:
        """Send a delayed-store row's dead letter unless an earlier try of this row sent it."""
        if item.id in self._lettered:
            return
        poison = await self._ensure(f"{item.destination}{POISON_SUFFIX}")
        with _boundary(f"dead-lettering to {poison.queue_name}"):
            await poison.send_message(encode_body(text), time_to_live=-1)
        self._lettered[item.id] = None
        while len(self._lettered) > _LETTERED_MEMORY:
            self._lettered.popitem(last=False)

    async def _dead_letter_stored_text(self, item: DelayedMessage, description: str, now: datetime) -> None:
        """A delayed-store row whose text is not an envelope: its text to the poison queue in the
        wrapper the receive path gives such text, with the reason ``malformed-envelope``."""
        from .delayed import record_stored_text

        reason = DeadLetterReason.MALFORMED_ENVELOPE.value
        await self._letter_once(
            item, raw_poison_text(item.envelope, reason, description, now, item.message_id)
        )
        queue = self.logical_of(item.destination)
        await record_stored_text(self._tracker, item, queue, reason, description, now)
        self._lettered.pop(item.id, None)

    # -- upkeep ------------------------------------------------------------------------------------
    maintenance_interval = 300.0

    async def maintain(self, app: QueueingApp | None = None) -> dict[str, int]:
        """Keep for good the letters the Functions host moved to a poison queue (see
        :meth:`keep_host_letters`), then bound the history: finished records older than the tracker's
        retention are deleted (after, so a letter kept now is recorded DeadLettered, and stays)."""
        try:
            kept = await self.keep_host_letters(app or self._app)
        finally:  # (the history is bounded also when the poison queues cannot be read)
            pruned = await self._tracker.prune(utcnow(), self.capabilities.dead_letters_kept)
        return {"history_pruned": pruned, "host_letters_kept": kept}

    async def keep_host_letters(self, app: QueueingApp | None) -> int:
        """The Functions host moves a message to ``<queue>-poison`` itself once its dequeue limit is
        reached (every invocation failed before the kit could settle it), and sends it there without a
        time-to-live: the service's default of 7 days, after which the letter is gone without a
        trace, while the history still shows the message's last run. Each such letter (one whose
        expiry is not "never") is recorded DeadLettered, copied without a time-to-live and then
        deleted; returns how many. At most once per ``HOST_LETTERS_EVERY`` in a process."""
        now = utcnow()
        if app is None or (
            self._host_letters_at is not None and now - self._host_letters_at < HOST_LETTERS_EVERY
        ):
            return 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + HOST_LETTERS_BUDGET

        def enough() -> bool:
            return loop.time() > deadline

        kept = 0
        for sub in app.subscriptions():
            if enough():
                log.warning(
                    "the look for letters the Functions host moved stopped at its time: the rest next"
                )
                break
            kept += await self._keep_host_letters(sub.queue, enough)
        self._host_letters_at = now
        return kept

    async def _keep_host_letters(self, queue: str, enough: Callable[[], bool]) -> int:
        async with self._dead_letter_pages(queue) as found:
            # most poison queues are empty or short: a peek, which hides nothing, settles those (a
            # letter hidden by a scan under way makes the count larger than the peek: read them all)
            seen = await found.poison.peek_messages(max_messages=32)
            if await found.total() == len(seen) and all(never_expires(m) for m in seen):
                return 0
            pages = _HostLetters(found.poison, lambda letter: self._keep_host_letter(queue, letter))
            run: LetterPass[Any] = LetterPass()
            try:
                await read_letters(
                    pages, lambda letter: not never_expires(letter), "remove", run, SCAN_LIMIT, enough
                )
            finally:
                with contextlib.suppress(Exception):
                    await pages.hand_back(run.held + pages.left)
        if not run.complete:
            log.warning(
                "looked at the first %d letters of %s's poison queue only: letters the Functions host "
                "moved after them are kept at the next look",
                run.seen,
                queue,
            )
        return pages.kept

    async def _keep_host_letter(self, queue: str, letter: Any) -> bool:
        """Record a letter the Functions host moved as DeadLettered, and copy it without a
        time-to-live, with the kit's dead-letter marks (the caller deletes the original after). A
        letter whose message's history says it finished, or moved on since the letter was written (an
        operator's retry, another copy's run), is a leftover duplicate: left as it is, to run out its
        time-to-live (recorded DeadLettered, its outcome and result were overwritten; review)."""
        from ..runtime import history_record

        now = utcnow()
        d = storage_delivery(decode_body(letter.content), queue=queue, delivery_count=1)
        decision = DeadLetter(DeadLetterReason.MAX_ATTEMPTS, HOST_MOVED)
        record = history_record(Settlement(d, decision), now)
        seen = await self._tracker.get(record.message_id)
        moved: datetime | None = letter.inserted_on
        # (a record a look wrote before is not "moved on": its copy may have failed after it; review)
        ours = (
            seen is not None and seen.status == MessageStatus.DEAD_LETTERED and seen.description == HOST_MOVED
        )
        if (
            seen is not None
            and not ours
            and (
                seen.status in FINISHED_ELSEWHERE
                or (moved is not None and seen.updated_at > moved + CLOCKS_APART)
            )
        ):
            return False
        # the history first: written after the copy and failing (the Tables outage that sent the
        # message here, say), it would never be written, since the copy no longer expires and no
        # later look picks it out; the history would then be pruned and the letter listed nowhere
        await self._tracker.upsert([record])
        await self.dead_letter(d, decision, now)
        log.warning(
            "message %s was moved to %s by the Functions host after its dequeue limit: kept there for "
            "good and recorded DeadLettered (retry or purge it from the ops API)",
            record.message_id,
            self.poison_name(queue),
        )
        return True

    # -- for tests and the ops API -------------------------------------------------------------------
    async def depth(self, queue: str, *, poison: bool = False) -> int:
        c = await self._ensure(self.poison_name(queue) if poison else self.physical(queue))
        with _boundary("reading queue properties"):
            props = await c.get_queue_properties()
        return int(props.approximate_message_count or 0)
