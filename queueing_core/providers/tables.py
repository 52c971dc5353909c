"""Azure Tables control store and durable tracker.

Every Functions instance of an app shares one storage account, so pause flags, circuit state and
message history kept here are seen by all of them. Azure SDK errors are translated into the kit's
``ProviderUnavailable`` / ``ProviderError`` at every public method; nothing from ``azure.core`` leaks.

Keys: Azure Table keys may not contain ``/ \\ # ?`` or control characters, and ``%`` and ``'`` are
known to break some operations (on Azure and in Azurite), so names are escaped as ``!XX`` (two hex
digits) for those characters and for ``!`` itself. An escaped name never contains ``!`` followed by
anything but two upper-case hex digits, which leaves ``!id`` free for the tracker's id index.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import json
import re
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, Final, Self, cast
from uuid import UUID

from azure.core import MatchConditions
from azure.core.exceptions import (
    AzureError,
    HttpResponseError,
    ResourceExistsError,
    ResourceModifiedError,
    ResourceNotFoundError,
    ServiceRequestError,
    ServiceResponseError,
)
from azure.data.tables import TableEntity, TableTransactionError, UpdateMode
from azure.data.tables.aio import TableClient
from pydantic import TypeAdapter

from .. import retry_policy
from ..clock import as_utc
from ..control import circuit
from ..control.base import CANCEL_KEPT, CircuitName, CircuitState, ControlState, PauseKind, cas_backoff
from ..errors import ConfigurationError, ProviderError, ProviderUnavailable
from ..logs import without_url_queries
from ..messages import MessageStatus
from ..options import CircuitBreakerOptions
from ..storable import HEADERS_CUT_SHORT, cut_short_marker
from ..tracking.base import (
    CANCEL_REQUESTED,
    OUTCOMES,
    MessageQuery,
    MessageRecord,
    Only,
    Page,
    as_listed,
    invalid_cursor,
    is_enqueue_record,
    newest_per_message,
    still_as_listed,
)
from .storage_errors import refusal

if TYPE_CHECKING:
    from azure.core.credentials import AzureNamedKeyCredential, AzureSasCredential
    from azure.core.credentials_async import AsyncTokenCredential

    from .tables_schedules import TablesTickStore

    Credential = AsyncTokenCredential | AzureNamedKeyCredential | AzureSasCredential

__all__ = ["TablesControlStore", "TablesTracker", "escape_key", "tables_from_connection", "unescape_key"]

Closer = Callable[[], Awaitable[None]]

# --- keys --------------------------------------------------------------------------------------

_ESCAPED: Final = frozenset("!%/\\#?'")
_UNESCAPE = re.compile(r"!([0-9A-F]{2})")


def escape_key(name: str) -> str:
    """A table key for ``name``: reversible, and free of the characters Tables rejects or mishandles."""
    return "".join(
        f"!{ord(ch):02X}" if ch in _ESCAPED or ord(ch) < 0x20 or 0x7F <= ord(ch) <= 0x9F else ch
        for ch in name
    )


def unescape_key(key: str) -> str:
    return _UNESCAPE.sub(lambda m: chr(int(m.group(1), 16)), key)


# --- errors ------------------------------------------------------------------------------------

#: statuses where trying again later can help; the rest are programming or permission errors
_TRANSIENT_STATUS: Final = frozenset({408, 429, 500, 502, 503, 504})


def _first_line(text: str | None, fallback: str) -> str:
    text = (text or "").strip()
    return text.splitlines()[0] if text else fallback


@contextmanager
def _boundary(action: str) -> Iterator[None]:
    """Translate azure-core errors raised inside the block into the kit's provider errors. An SDK
    error is said by its first line, any URL's query string hidden: the text of one raised by the
    HTTP client quotes the request's URL, whose query string holds a SAS token."""
    try:
        yield
    except (ServiceRequestError, ServiceResponseError) as exc:
        said = without_url_queries(_first_line(exc.message, type(exc).__name__))
        # (not chained: the cause's text, in a traceback, is the URL with its query string)
        raise ProviderUnavailable(f"Azure Tables unreachable ({action}): {said}") from None
    except HttpResponseError as exc:
        refused = refusal(exc, "table", f"Azure Tables {action}")
        if refused is not None:
            raise refused from exc
        kind = ProviderUnavailable if exc.status_code in _TRANSIENT_STATUS else ProviderError
        said = without_url_queries(_first_line(exc.message, type(exc).__name__))
        raise kind(f"Azure Tables {action} failed ({exc.status_code}): {said}") from exc
    except AzureError as exc:
        said = without_url_queries(_first_line(exc.message, type(exc).__name__))
        raise ProviderError(f"Azure Tables {action} failed: {said}") from exc
    except AttributeError as exc:
        # azure-data-tables 12.7 reprocesses some errors by reading .error_code, which a credential's
        # ClientAuthenticationError lacks: the AttributeError hides the real cause, which is its context
        cause = exc.__context__
        if not isinstance(cause, AzureError):
            raise
        said = without_url_queries(_first_line(cause.message, type(cause).__name__))
        raise ProviderError(f"Azure Tables {action} failed: {said}") from cause


def _plain_utc(value: datetime) -> datetime:
    """The SDK returns a datetime subclass carrying the service's string; callers get a plain one."""
    v = as_utc(value)
    return datetime(v.year, v.month, v.day, v.hour, v.minute, v.second, v.microsecond, tzinfo=UTC)


class _Table:
    """One table client plus lazy creation: the first call creates the table when asked to."""

    def __init__(self, client: TableClient, create: bool, closers: Sequence[Closer]) -> None:
        self.client = client
        self._create = create
        self._closers = list(closers)

    async def ready(self) -> TableClient:
        if self._create:
            # Idempotent: two instances racing both end up here, one of them gets "exists".
            with suppress(ResourceExistsError):
                await self.client.create_table()
            self._create = False
        return self.client

    async def close(self) -> None:
        await self.client.close()
        for close in self._closers:
            await close()


# --- control store -----------------------------------------------------------------------------

_PAUSE_PK: Final = "pause"
_CIRCUIT_PK: Final = "circuit"
_CANCEL_PK: Final = "cancel"
#: idempotent identities: RowKey is a hash of type and identity (any text, any length up to 256)
_IDENTITY_PK: Final = "identity"
_CIRCUIT_STATES: Final[frozenset[str]] = frozenset({"closed", "open", "half_open"})
#: optimistic-concurrency rounds; each round only one writer wins, the others re-read
_CAS_ATTEMPTS: Final = 25


class _OnTable:
    """An async context over one ``_Table``: leaving it (or ``aclose``) closes the table's client."""

    _table: _Table

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        with _boundary("close"):
            await self._table.close()


class TablesControlStore(_OnTable):
    """Pause flags and per-type circuits in one table, updated with ETag-guarded read-modify-write.

    Entities: ``("pause", "queue:<name>")`` / ``("pause", "type:<name>")`` exist while paused;
    ``("circuit", <type>)`` holds a circuit that is not plainly closed. Transitions come from
    :mod:`queueing_core.control.circuit`, so this store and the memory store cannot disagree.
    """

    def __init__(
        self, table_client: TableClient, *, create_table: bool = False, close_also: Sequence[Closer] = ()
    ) -> None:
        """``create_table``: create the table on first use; ``close_also``: more to close in aclose()."""
        self._table = _Table(table_client, create_table, close_also)
        # Coroutines of one instance take turns per type, so only other instances compete on the ETag
        # (a failing dependency makes every concurrent handler record a failure at the same moment).
        self._locks: dict[str, asyncio.Lock] = {}

    async def state(self) -> ControlState:
        queues: set[str] = set()
        types: set[str] = set()
        schedules: set[str] = set()
        circuits: dict[str, CircuitState] = {}
        cancelled: set[UUID] = set()
        since = datetime.now(UTC) - CANCEL_KEPT
        with _boundary("read control state"):
            client = await self._table.ready()
            entities = client.query_entities(
                "PartitionKey eq @p or PartitionKey eq @c or PartitionKey eq @x",
                parameters={"p": _PAUSE_PK, "c": _CIRCUIT_PK, "x": _CANCEL_PK},
            )
            async for e in entities:
                if e["PartitionKey"] == _CANCEL_PK:
                    if as_utc(e["RequestedAt"]) > since:
                        cancelled.add(UUID(str(e["RowKey"])))
                elif e["PartitionKey"] == _PAUSE_PK:
                    kind, _, key = str(e["RowKey"]).partition(":")
                    {"queue": queues, "schedule": schedules}.get(kind, types).add(unescape_key(key))
                else:
                    c = _circuit_from_entity(e)
                    circuits[c.type_name] = c
        return ControlState(
            frozenset(queues),
            frozenset(types),
            circuits,
            paused_schedules=frozenset(schedules),
            cancelled=frozenset(cancelled),
        )

    async def set_cancel(self, message_id: UUID, requested: bool, now: datetime) -> None:
        with _boundary("request cancellation" if requested else "withdraw a cancellation"):
            client = await self._table.ready()
            if requested:
                await client.upsert_entity(
                    {"PartitionKey": _CANCEL_PK, "RowKey": str(message_id), "RequestedAt": now},
                    mode=UpdateMode.REPLACE,
                )
            else:
                await client.delete_entity(_CANCEL_PK, str(message_id))
            # requests past their keeping time: few, and read by every state() until gone. Each only
            # as listed (its ETag): another host may request the same message's cancellation again
            # meanwhile, and that fresh request must stay
            stale = client.query_entities(
                "PartitionKey eq @x and RequestedAt lt @t",
                parameters={"x": _CANCEL_PK, "t": now - CANCEL_KEPT},
            )
            async for e in stale:
                await _delete_if_unchanged(client, _CANCEL_PK, str(e["RowKey"]), str(e.metadata["etag"]))

    async def set_paused(self, kind: PauseKind, name: str, paused: bool) -> None:
        if kind not in ("queue", "type", "schedule"):
            raise ValueError(f"pause kind must be 'queue', 'type' or 'schedule', not {kind!r}")
        row = f"{kind}:{escape_key(name)}"
        with _boundary("set pause"):
            client = await self._table.ready()
            if paused:
                await client.upsert_entity(
                    {"PartitionKey": _PAUSE_PK, "RowKey": row, "Name": name}, mode=UpdateMode.REPLACE
                )
            else:
                await client.delete_entity(_PAUSE_PK, row)  # the SDK ignores "not found"

    async def record_failure(
        self, type_name: str, opts: CircuitBreakerOptions, now: datetime, probe_until: datetime | None = None
    ) -> CircuitState:
        held = None if probe_until is None else as_utc(probe_until)
        new, _ = await self._transition(type_name, lambda s: circuit.on_failure(s, opts, as_utc(now), held))
        return new

    async def record_success(self, type_name: str, probe_until: datetime | None = None) -> CircuitState:
        # Called after every successful message: a missing entity (the usual case) costs one read.
        with _boundary("record circuit success"):
            async with self._lock(type_name):
                client = await self._table.ready()
                for attempt in range(_CAS_ATTEMPTS):
                    current, etag = await self._read(client, type_name)
                    new = circuit.on_success(current, None if probe_until is None else as_utc(probe_until))
                    if new is None:
                        return current
                    if etag is None:
                        return new
                    try:
                        # Closed is stored as "no entity", like the memory store's pop.
                        await client.delete_entity(
                            _CIRCUIT_PK,
                            escape_key(type_name),
                            etag=etag,
                            match_condition=MatchConditions.IfNotModified,
                        )
                        return new
                    except ResourceModifiedError:
                        await cas_backoff(attempt)
        raise ProviderUnavailable(f"circuit of {type_name!r}: too much contention, gave up")

    async def acquire_probe(self, type_name: str, opts: CircuitBreakerOptions, now: datetime) -> bool:
        # Exactly one caller wins: a loser's conditional write fails, and on its re-read the circuit
        # is already half-open with a live probe, so circuit.acquire_probe returns None.
        _, changed = await self._transition(type_name, lambda s: circuit.acquire_probe(s, opts, as_utc(now)))
        return changed

    async def release_probe(self, type_name: str, held_until: datetime, now: datetime) -> None:
        await self._transition(type_name, lambda s: circuit.release_probe(s, as_utc(held_until), as_utc(now)))

    def schedule_store(self) -> TablesTickStore:
        """Schedule ticks on the same table (the hosts that share pauses share ticks)."""
        from .tables_schedules import TablesTickStore

        return TablesTickStore(self._table)

    async def reset_circuit(self, type_name: str) -> None:
        # An operator's override: it does not depend on the current state, so no ETag is needed.
        with _boundary("reset circuit"):
            client = await self._table.ready()
            await client.delete_entity(_CIRCUIT_PK, escape_key(type_name))

    def _lock(self, type_name: str) -> asyncio.Lock:
        return self._locks.setdefault(type_name, asyncio.Lock())

    async def identity_doc(self, type_name: str, identity: str) -> tuple[dict[str, Any], object] | None:
        with _boundary("read an identity"):
            client = await self._table.ready()
            try:
                e = await client.get_entity(_IDENTITY_PK, _identity_key(type_name, identity))
            except ResourceNotFoundError:
                return None
        return json.loads(str(e["Doc"])), str(e.metadata["etag"])

    async def put_identity_doc(
        self, type_name: str, identity: str, doc: dict[str, Any], token: object | None
    ) -> bool:
        entity = {
            "PartitionKey": _IDENTITY_PK,
            "RowKey": _identity_key(type_name, identity),
            "Type": type_name,
            "Identity": identity,
            "Doc": json.dumps(doc, separators=(",", ":")),
        }
        with _boundary("write an identity"):
            client = await self._table.ready()
            try:
                await _write_if_unchanged(client, entity, None if token is None else str(token))
            except (ResourceModifiedError, ResourceExistsError, ResourceNotFoundError):
                return False  # another writer came first: the caller reads again
        return True

    async def _read(self, client: TableClient, type_name: str) -> tuple[CircuitState, str | None]:
        try:
            e = await client.get_entity(_CIRCUIT_PK, escape_key(type_name))
        except ResourceNotFoundError:
            return CircuitState.closed(type_name), None
        return _circuit_from_entity(e), str(e.metadata["etag"])

    async def _transition(
        self, type_name: str, change: Callable[[CircuitState], CircuitState | None]
    ) -> tuple[CircuitState, bool]:
        """Apply ``change`` atomically; ``(state, False)`` when it declined (returned None)."""
        with _boundary("update circuit"):
            async with self._lock(type_name):
                client = await self._table.ready()
                for attempt in range(_CAS_ATTEMPTS):
                    current, etag = await self._read(client, type_name)
                    new = change(current)
                    if new is None:
                        return current, False
                    entity = _circuit_entity(new)
                    try:
                        await _write_if_unchanged(client, entity, etag)
                        return new, True
                    except (ResourceModifiedError, ResourceExistsError):
                        pass  # someone else wrote it between our read and our write: read again
                    except ResourceNotFoundError:
                        if etag is None:
                            raise  # the table itself is missing
                        # the entity was deleted (a success or reset) after our read: read again
                    await cas_backoff(attempt)
        raise ProviderUnavailable(f"circuit of {type_name!r}: too much contention, gave up")


def _identity_key(type_name: str, identity: str) -> str:
    return hashlib.sha256(f"{type_name}\x1f{identity}".encode()).hexdigest()


def _circuit_entity(s: CircuitState) -> dict[str, Any]:
    # None values are left out by the SDK, which with REPLACE/create means "absent".
    return {
        "PartitionKey": _CIRCUIT_PK,
        "RowKey": escape_key(s.type_name),
        "State": s.state,
        "ConsecutiveFailures": s.consecutive_failures,
        "OpenedAt": s.opened_at,
        "OpenUntil": s.open_until,
        "ProbeUntil": s.probe_until,
    }


def _circuit_from_entity(e: Mapping[str, Any]) -> CircuitState:
    def when(name: str) -> datetime | None:
        value = e.get(name)
        return _plain_utc(value) if isinstance(value, datetime) else None

    raw_state = str(e.get("State", "closed"))
    state = cast(CircuitName, raw_state if raw_state in _CIRCUIT_STATES else "closed")
    return CircuitState(
        type_name=unescape_key(str(e["RowKey"])),
        state=state,
        consecutive_failures=int(e.get("ConsecutiveFailures", 0)),
        opened_at=when("OpenedAt"),
        open_until=when("OpenUntil"),
        probe_until=when("ProbeUntil"),
    )


# --- tracker -----------------------------------------------------------------------------------

#: partition of the id index; escape_key never produces it, so no queue can collide with it
_INDEX_PK: Final = "!id"
#: records a late write (the history backlog) handles at once
_LATE_WRITES: Final = 16
#: a string property holds at most 64 KiB of UTF-16, i.e. 32,768 code units; keep a margin
_PART_UNITS: Final = 32_000
#: microseconds from the epoch to 9999-12-31T23:59:59.999999Z; RowKeys count down from here
_MAX_US: Final = 253_402_300_799_999_999
_EPOCH: Final = datetime(1970, 1, 1, tzinfo=UTC)
_ONE_US: Final = timedelta(microseconds=1)
#: Azure rejects a transaction over 4 MiB or 100 operations
_BATCH_BYTES: Final = 3 * 1024 * 1024
_BATCH_OPS: Final = 100
#: a query page makes at most this many requests to fill ``limit`` (filters can make pages sparse)
_PAGE_REQUESTS: Final = 8

# Size rule (never fail an upsert for size). An entity may hold 1 MiB with strings at 2 bytes per
# UTF-16 unit, so every text field has a fixed budget in units and the budgets add up to about
# 470K units (~940 KB) with room for property overhead:
#   body 7 parts (224K), raw 3 parts (96K less 3), result 2 parts (64K), headers 1 part (32K),
#   last_error/description 16K each, reason/type/correlation_id/locked_by/status 4K each.
# JSON that fits is split across parts (Body0..Body6) and read back whole. JSON that does not fit is
# replaced by a marker object {"_truncated": true, "_original_chars": N, "_preview": "<start>"}
# (headers: as many as fit plus "x-queueing-truncated"); plain text is cut and ends with
# "...[truncated, N chars]". The replacement fits its budget by construction.
_BODY_PARTS: Final = 7
_RAW_PARTS: Final = 3
_RESULT_PARTS: Final = 2
_HEADERS_PARTS: Final = 1
_LONG_TEXT: Final = 16_000
_SHORT_TEXT: Final = 4_000

#: nullable scalar fields: record attribute -> (property, unit budget or 0 for datetimes)
_NULLABLE: Final[dict[str, tuple[str, int]]] = {
    "correlation_id": ("CorrelationId", _SHORT_TEXT),
    "not_before": ("NotBefore", 0),
    "expires_at": ("ExpiresAt", 0),
    "locked_by": ("LockedBy", _SHORT_TEXT),
    "locked_until": ("LockedUntil", 0),
    "last_error": ("LastError", _LONG_TEXT),
    "reason": ("Reason", _SHORT_TEXT),
    "description": ("Description", _LONG_TEXT),
    "archived_at": ("ArchivedAt", 0),
}

_TERMINAL: Final = tuple(sorted(str(s) for s in MessageStatus.terminal()))


def _units(text: str) -> int:
    return len(text.encode("utf-16-le")) // 2


def _cut_units(text: str, units: int) -> str:
    """The longest prefix of ``text`` with at most ``units`` UTF-16 units (no split surrogate pair)."""
    data = text.encode("utf-16-le")[: units * 2]
    if len(data) >= 2 and 0xD8 <= data[-1] <= 0xDB:  # the first half of a pair at the end
        data = data[:-2]
    return data.decode("utf-16-le")


def _clip(text: str, units: int) -> str:
    # Lone surrogates (text decoded with surrogateescape, say) cannot be sent as UTF-8: replace them.
    text = text.encode("utf-8", "replace").decode("utf-8")
    if _units(text) <= units:
        return text
    marker = f"...[truncated, {len(text)} chars]"
    return _cut_units(text, units - len(marker)) + marker


def _fits(parts: int) -> int:
    """The UTF-16 units of text that :func:`_split` always fits in ``parts`` parts. A part is cut one
    unit short where a surrogate pair straddles its end (half a pair cannot be stored), so each part
    is only sure to hold ``_PART_UNITS - 1`` units."""
    return parts * (_PART_UNITS - 1)


def _split(text: str, parts: int) -> list[str]:
    """``text`` in exactly ``parts`` pieces of at most _PART_UNITS units (unused pieces are ""). Text of
    up to ``_fits(parts)`` units always fits; ASCII text (the JSON fields) fits ``parts * _PART_UNITS``."""
    out: list[str] = []
    rest = text
    for _ in range(parts):
        piece = _cut_units(rest, _PART_UNITS)
        out.append(piece)
        rest = rest[len(piece) :]
    if rest:  # callers size the text first; reaching here is a bug, not a user error
        raise AssertionError("text does not fit its parts")
    return out


def _fit_json(value: Any, parts: int) -> str:
    # ensure_ascii keeps JSON to one UTF-16 unit per character, so units == len
    text = json.dumps(value, ensure_ascii=True, separators=(",", ":"))
    budget = parts * _PART_UNITS
    if len(text) <= budget:
        return text
    preview = text[: budget - 200]
    while True:
        marker = json.dumps(cut_short_marker(len(text), preview), ensure_ascii=True)
        if len(marker) <= budget:
            return marker
        preview = preview[: len(preview) - (len(marker) - budget) - 16]


def _fit_headers(headers: Mapping[str, str]) -> str:
    text = json.dumps(dict(headers), ensure_ascii=True, separators=(",", ":"))
    budget = _HEADERS_PARTS * _PART_UNITS
    if len(text) <= budget:
        return text
    kept: dict[str, str] = {}
    size = 200  # room for the marker header
    for k, v in headers.items():
        item = len(json.dumps({k: v}, ensure_ascii=True))
        if size + item > budget:
            break
        kept[k] = v
        size += item
    kept[HEADERS_CUT_SHORT] = f"{len(headers) - len(kept)} headers dropped ({len(text)} chars)"
    return json.dumps(kept, ensure_ascii=True, separators=(",", ":"))


def _put_parts(entity: dict[str, Any], name: str, text: str, parts: int) -> None:
    for i, piece in enumerate(_split(text, parts)):
        entity[f"{name}{i}"] = piece


def _get_parts(entity: Mapping[str, Any], name: str, parts: int) -> str | None:
    if f"{name}0" not in entity:
        return None
    return "".join(str(entity.get(f"{name}{i}", "")) for i in range(parts))


def _row_key(created_at: datetime, message_id: UUID) -> str:
    # Counting down from the end of time makes RowKey order newest-first within a queue.
    return f"{_inverted(created_at):019d}_{message_id}"


def _inverted(when: datetime) -> int:
    return _MAX_US - (as_utc(when) - _EPOCH) // _ONE_US


def _record_entity(rec: MessageRecord) -> dict[str, Any]:
    """The entity for ``rec``. Every field is written (MERGE cannot remove a property, and the SDK
    drops None values), except ``body``/``raw`` which are written only when present so that a later
    event without them keeps the stored ones. None values are written as "" and listed in ``Nulls``.
    """
    e: dict[str, Any] = {
        "PartitionKey": escape_key(rec.queue),
        "RowKey": _row_key(rec.created_at, rec.message_id),
        "MessageId": str(rec.message_id),
        "TrackingId": str(rec.tracking_id),
        "Type": _clip(rec.type, _SHORT_TEXT),
        "Queue": rec.queue,
        "Status": _clip(rec.status, _SHORT_TEXT),
        "Attempt": rec.attempt,
        "CreatedAt": as_utc(rec.created_at),
        "UpdatedAt": as_utc(rec.updated_at),
        "Archived": rec.archived,
    }
    nulls: list[str] = []
    for attr, (prop, budget) in _NULLABLE.items():
        value = getattr(rec, attr)
        if value is None:
            e[prop] = ""
            nulls.append(prop)
        elif isinstance(value, datetime):
            e[prop] = as_utc(value)
        else:
            e[prop] = _clip(str(value), budget)
    e["Nulls"] = ",".join(nulls)
    _put_parts(e, "Headers", _fit_headers(rec.headers), _HEADERS_PARTS)
    _put_parts(e, "Result", _fit_json(_jsonable(rec.result), _RESULT_PARTS), _RESULT_PARTS)
    if rec.progress is not None:  # absent otherwise, so a MERGE keeps the last report past the outcome
        e["Progress"] = _clip(json.dumps(_jsonable(rec.progress)), _SHORT_TEXT)
    if rec.body is not None:
        _put_parts(e, "Body", _fit_json(_jsonable(rec.body), _BODY_PARTS), _BODY_PARTS)
    if rec.raw is not None:
        # (the only split field that may hold surrogate pairs: JSON is written with ensure_ascii)
        _put_parts(e, "Raw", _clip(rec.raw, _fits(_RAW_PARTS)), _RAW_PARTS)
    # the duplicate marks only when set, so that MERGE of a later record keeps them
    if rec.copied_from is not None:
        e["CopiedFrom"] = _clip(rec.copied_from, _SHORT_TEXT)
    if rec.duplicates is not None:
        e["Duplicates"] = rec.duplicates
    return e


#: result is Any: pydantic turns datetimes, UUIDs, models... into JSON values (str as a last resort)
_ANY: Final = TypeAdapter(Any)


def _entity_missing(exc: Exception) -> bool:
    """The service's answer is that the entity does not exist (not the table: the SDK raises the same
    error type for ``TableNotFound``). Azurite and the service say ``ResourceNotFound``; the
    service's list of codes also has ``EntityNotFound``."""
    return getattr(exc, "error_code", None) in ("ResourceNotFound", "EntityNotFound")


async def _merge_unchanged(client: TableClient, e: dict[str, Any], stored: TableEntity) -> bool:
    """MERGE ``e`` if the entity is still as ``stored`` (its ETag); False when it changed meanwhile,
    deletion included (the caller reads it again, and finds it missing)."""
    try:
        await client.update_entity(
            e,
            mode=UpdateMode.MERGE,
            etag=stored.metadata["etag"],
            match_condition=MatchConditions.IfNotModified,
        )
    except ResourceModifiedError:
        return False
    except ResourceNotFoundError as exc:
        if not _entity_missing(exc):
            raise
        return False
    return True


def _producers(e: Mapping[str, Any]) -> bool:
    """``is_producers_record`` of a stored entity, read from its properties (no result outside OUTCOMES,
    so none is read; an entity damaged outside the kit reads as a run's, which keeps it)."""
    nulls = set(filter(None, str(e.get("Nulls", "")).split(",")))
    status = e.get("Status")
    return (
        status not in OUTCOMES
        and status != MessageStatus.LEASED.value
        and all(p in nulls or e.get(p) is None for p in ("Reason", "LastError", "LockedBy"))
    )


def _index_entity(e: Mapping[str, Any]) -> dict[str, Any]:
    """The id index entry of a record entity (where ``get`` finds it by message id)."""
    return {"PartitionKey": _INDEX_PK, "RowKey": e["MessageId"], "Pk": e["PartitionKey"], "Rk": e["RowKey"]}


def _jsonable(value: Any) -> Any:
    return _ANY.dump_python(value, mode="json", fallback=str)


def _record_from_entity(e: Mapping[str, Any]) -> MessageRecord:
    nulls = set(filter(None, str(e.get("Nulls", "")).split(",")))
    data: dict[str, Any] = {
        "message_id": e["MessageId"],
        "tracking_id": e["TrackingId"],
        "type": e["Type"],
        "queue": e["Queue"],
        "status": e["Status"],
        "attempt": e.get("Attempt", 0),
        "created_at": _plain_utc(e["CreatedAt"]),
        "updated_at": _plain_utc(e["UpdatedAt"]),
        "archived": bool(e.get("Archived", False)),
    }
    for attr, (prop, _) in _NULLABLE.items():
        value = None if prop in nulls else e.get(prop)
        data[attr] = _plain_utc(value) if isinstance(value, datetime) else value
    headers = _get_parts(e, "Headers", _HEADERS_PARTS)
    data["headers"] = json.loads(headers) if headers else {}
    result = _get_parts(e, "Result", _RESULT_PARTS)
    data["result"] = json.loads(result) if result else None
    progress = e.get("Progress")
    data["progress"] = _progress_of(progress) if progress else None
    body = _get_parts(e, "Body", _BODY_PARTS)
    data["body"] = json.loads(body) if body else None
    data["raw"] = _get_parts(e, "Raw", _RAW_PARTS)
    data["copied_from"] = e.get("CopiedFrom")
    data["duplicates"] = e.get("Duplicates")
    return MessageRecord.model_validate(data)


def _progress_of(text: str) -> dict[str, Any] | None:
    try:
        value = json.loads(text)
    except ValueError:  # clipped: progress is advisory
        return None
    return value if isinstance(value, dict) else None


def _entity_matches(q: MessageQuery, e: Mapping[str, Any]) -> bool:
    """``MessageQuery.matches`` on a (possibly projected) entity; the server filter did most of it."""
    nulls = set(filter(None, str(e.get("Nulls", "")).split(",")))
    correlation = None if "CorrelationId" in nulls else e.get("CorrelationId")
    created = as_utc(e["CreatedAt"])
    return (
        (q.queue is None or e.get("Queue") == q.queue)
        and (q.type is None or e.get("Type") == q.type)
        and (q.status is None or e.get("Status") in q.status)
        and (q.created_from is None or created >= as_utc(q.created_from))
        and (q.created_to is None or created < as_utc(q.created_to))
        and (q.archived is None or bool(e.get("Archived")) == q.archived)
        and (q.correlation_id is None or correlation == q.correlation_id)
        and (q.tracking_id is None or e.get("TrackingId") == str(q.tracking_id))
    )


#: the properties _entity_matches needs (a projection keeps deletes and counts light)
_MATCH_PROPS: Final = [
    "PartitionKey",
    "RowKey",
    "MessageId",
    "Queue",
    "Type",
    "Status",
    "CreatedAt",
    "UpdatedAt",
    "Archived",
    "CorrelationId",
    "TrackingId",
    "Nulls",
]


class _Filter:
    """An OData filter built from fixed text and ``@name`` parameters (the SDK quotes the values)."""

    def __init__(self) -> None:
        self.clauses: list[str] = []
        self.params: dict[str, Any] = {}

    def param(self, value: Any) -> str:
        name = f"p{len(self.params)}"
        self.params[name] = value
        return f"@{name}"

    def add(self, clause: str) -> None:
        self.clauses.append(clause)

    def any_of(self, prop: str, values: Iterable[str]) -> None:
        # The SDK substitutes parameters only in space-separated words: keep spaces around "(" ")".
        self.add("( " + " or ".join(f"{prop} eq {self.param(v)}" for v in values) + " )")

    @property
    def text(self) -> str:
        return " and ".join(self.clauses)


def _query_filter(q: MessageQuery) -> _Filter:
    f = _Filter()
    if q.queue is not None:
        f.add(f"PartitionKey eq {f.param(escape_key(q.queue))}")
    else:
        f.add(f"PartitionKey ne {f.param(_INDEX_PK)}")
    # created_at is encoded in the RowKey (counting down), so a range is a key range scan.
    if q.created_from is not None:
        f.add(f"RowKey lt {f.param(f'{_inverted(q.created_from) + 1:019d}')}")
    if q.created_to is not None:
        f.add(f"RowKey ge {f.param(f'{_inverted(q.created_to) + 1:019d}')}")
    if q.type is not None:
        f.add(f"Type eq {f.param(q.type)}")
    if q.status is not None:
        f.any_of("Status", q.status)
    if q.archived is not None:
        f.add(f"Archived eq {f.param(q.archived)}")
    if q.correlation_id is not None:
        f.add(f"CorrelationId eq {f.param(q.correlation_id)}")
    if q.tracking_id is not None:
        f.add(f"TrackingId eq {f.param(str(q.tracking_id))}")
    return f


#: the parts of a continuation token the service hands out (its NextPartitionKey/NextRowKey)
_TOKEN_KEYS: Final = frozenset({"PartitionKey", "RowKey"})


def _continuation(token: Any) -> dict[str, str] | None:
    """The SDK's continuation token without its empty parts. The service may continue with a
    NextPartitionKey and no NextRowKey; the SDK then reports ``RowKey: None`` but sends only the parts
    present, and an empty NextRowKey would be refused."""
    if not token:
        return None
    parts = {k: v for k, v in dict(token).items() if k in _TOKEN_KEYS and v}
    return parts or None


def _encode_cursor(token: Any) -> str | None:
    parts = _continuation(token)
    if parts is None:
        return None
    return base64.urlsafe_b64encode(json.dumps(parts).encode()).decode().rstrip("=")


def _token_part(value: object) -> bool:
    return isinstance(value, str) and 0 < len(value) <= 1024 and value.isascii() and value.isprintable()


def _decode_cursor(cursor: str | None) -> dict[str, str] | None:
    """A continuation token from :func:`_encode_cursor`. It arrives from a URL and goes into request
    headers, so its shape is checked here; a well-formed token the service still refuses is turned into
    the same error by :meth:`TablesTracker.query`."""
    if not cursor:
        return None
    try:
        token = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
    except (binascii.Error, ValueError) as exc:
        raise invalid_cursor() from exc
    if isinstance(token, dict) and "RowKey" in token and token["RowKey"] is None:
        del token["RowKey"]  # as next_cursor carried a continuation without a row key before
    if not (
        isinstance(token, dict)
        and "PartitionKey" in token
        and set(token) <= _TOKEN_KEYS
        and all(_token_part(v) for v in token.values())
    ):
        raise invalid_cursor()
    return cast(dict[str, str], token)


def _approx_bytes(entity: Mapping[str, Any]) -> int:
    return sum(len(k) + len(str(v).encode()) + 64 for k, v in entity.items())


def _batches(entities: Sequence[dict[str, Any]]) -> Iterator[list[dict[str, Any]]]:
    """Per partition, runs of at most 100 entities and ~3 MiB (the transaction limits)."""
    by_pk: dict[str, list[dict[str, Any]]] = {}
    for e in entities:
        by_pk.setdefault(str(e["PartitionKey"]), []).append(e)
    for group in by_pk.values():
        batch: list[dict[str, Any]] = []
        size = 0
        for e in group:
            n = _approx_bytes(e)
            if batch and (len(batch) >= _BATCH_OPS or size + n > _BATCH_BYTES):
                yield batch
                batch, size = [], 0
            batch.append(e)
            size += n
        if batch:
            yield batch


_WRITTEN_MEMORY = 100_000


class TablesTracker(_OnTable):
    """Message history, one entity per message, bounded by :meth:`prune`.

    Layout:

    * record: PartitionKey = escaped queue name, RowKey = ``<inverted created_at µs>_<message id>``.
      The inverted timestamp makes the table's natural order newest-first within a queue (like the
      memory tracker) at no extra cost, and makes a created_at range a RowKey range. A message's
      created_at never changes (it travels in the envelope), so the key is stable.
    * id index: PartitionKey ``!id``, RowKey = message id, holding the record's keys. ``get`` is two
      point reads; without it, finding an id without its queue would be a scan of the whole table.

    Order of :meth:`query`: newest first within a queue; with no queue filter, queues come in
    escaped-name order (Tables returns partitions in key order; a global order would need a second
    copy of every record in one hot partition).
    """

    def __init__(
        self,
        table_client: TableClient,
        *,
        retention: timedelta = timedelta(days=14),
        create_table: bool = False,
        close_also: Sequence[Closer] = (),
    ) -> None:
        if retention <= timedelta(0):
            raise ValueError("retention must be positive")
        self.retention = retention
        self._table = _Table(table_client, create_table, close_also)
        #: messages this instance has written with their body and index entity (bounded, LRU)
        self._written: OrderedDict[UUID, None] = OrderedDict()

    async def upsert(self, records: Sequence[MessageRecord]) -> None:
        await self._upsert(records, keep_outcomes=True)

    async def _upsert(self, records: Sequence[MessageRecord], *, keep_outcomes: bool) -> None:
        # Fold repeats of one message in this call (a transaction may not touch an entity twice),
        # with the same rule as a later call: a missing body/raw keeps the earlier one.
        folded: dict[UUID, MessageRecord] = {}
        for rec in records:
            old = folded.get(rec.message_id)
            if old is not None and (rec.body is None or rec.raw is None):
                keep = {
                    "body": old.body if rec.body is None else rec.body,
                    "raw": old.raw if rec.raw is None else rec.raw,
                }
                rec = rec.model_copy(update=keep)
            folded[rec.message_id] = rec
        if not folded:
            return
        gone = await self._write_folded(folded, keep_outcomes=keep_outcomes)
        # A message this instance wrote whose entity is gone was deleted meanwhile (a purge, an
        # operator, the retention). Made again from a record sent without its body and index entity,
        # it would be listed but found by no lookup: it is forgotten, and a record that carries its
        # body (a worker's always does) is written again whole, as a host that never wrote the
        # message writes it; one without is dropped.
        again = {mid: r for mid, r in folded.items() if str(mid) in gone and r.body is not None}
        if again:
            await self._write_folded(again, keep_outcomes=keep_outcomes)  # (unknown now: whole)

    async def _write_folded(self, folded: dict[UUID, MessageRecord], *, keep_outcomes: bool) -> set[str]:
        """Write one record per message; returns the ids of messages whose entity was found deleted
        (and is not made again here)."""
        # A message this instance already wrote needs neither its index entity (it never changes) nor
        # its body again (fixed at enqueue): MERGE keeps what is stored. Halves the requests per update.
        known_ids = {mid for mid in folded if mid in self._written}
        entities = [
            _record_entity(r.model_copy(update={"body": None}) if r.message_id in known_ids else r)
            for r in folded.values()
        ]
        # A producer writes its record after the send, so a fast worker's outcome may already be
        # stored: a first record that only says "sent" is inserted, never merged over it.
        first = {r.message_id for r in folded.values() if keep_outcomes and is_enqueue_record(r)}
        new: list[dict[str, Any]] = []
        known_first: list[dict[str, Any]] = []
        known: list[dict[str, Any]] = []
        seen: list[dict[str, Any]] = []
        for e, r in zip(entities, folded.values(), strict=True):
            if r.message_id not in known_ids:
                (new if r.message_id in first else seen).append(e)
            else:
                (known_first if r.message_id in first else known).append(e)
        gone: set[str] = set()
        with _boundary("upsert history"):
            client = await self._table.ready()
            for batch in _batches(new):
                gone |= await self._insert_new(client, batch)
            for e in known_first:
                if not await self._merge_unless_outcome(client, e):
                    gone.add(e["MessageId"])
            for batch in _batches(known):
                gone |= await self._update_existing(client, batch)
            for batch in _batches(seen):
                await self._write(client, batch, UpdateMode.MERGE)
            index = [
                _index_entity(e)
                for e, r in zip(entities, folded.values(), strict=True)
                if r.message_id not in known_ids and e["MessageId"] not in gone
            ]
            for batch in _batches(index):
                await self._write(client, batch, UpdateMode.REPLACE)
        self._forget(gone)
        self._remember(
            [
                r.message_id
                for r in folded.values()
                if str(r.message_id) not in gone and (r.body is not None or r.message_id in known_ids)
            ]
        )
        return gone

    def _forget(self, gone: Iterable[str]) -> None:
        """These messages' entities were found deleted: their next record is written whole."""
        for mid in gone:
            self._written.pop(UUID(mid), None)

    def _remember(self, written: Iterable[UUID]) -> None:
        """These messages' bodies and index entities are stored (bounded, least recently written go)."""
        for mid in written:
            self._written[mid] = None
            self._written.move_to_end(mid)
        while len(self._written) > _WRITTEN_MEMORY:
            self._written.popitem(last=False)

    async def reopen(self, record: MessageRecord) -> None:
        await self._upsert([record], keep_outcomes=False)

    async def change_if_unchanged(self, seen: MessageRecord, changes: Mapping[str, Any]) -> bool:
        with _boundary("upsert history"):
            client = await self._table.ready()
            try:
                ix = await client.get_entity(_INDEX_PK, str(seen.message_id))
                stored = await client.get_entity(str(ix["Pk"]), str(ix["Rk"]))
            except ResourceNotFoundError as exc:
                if not _entity_missing(exc):
                    raise  # (the table itself missing: not a message that is gone)
                return False
            if stored.get("Status") != seen.status or stored.get("UpdatedAt") != as_utc(seen.updated_at):
                return False
            # the stored body, raw text, progress and duplicate marks stay (MERGE keeps what a record
            # leaves out): a count made since the read (it does not move UpdatedAt) is not set back
            kept = {"body": None, "raw": None, "progress": None, "duplicates": None, "copied_from": None}
            changed = seen.model_copy(update={**changes, **kept})
            entity = _record_entity(changed)
            entity["PartitionKey"], entity["RowKey"] = stored["PartitionKey"], stored["RowKey"]
            return await _merge_unchanged(client, entity, stored)

    async def note_duplicate(self, message_id: UUID) -> None:
        """Count one delivery of ``message_id`` dropped as a known duplicate."""
        await self._patch(message_id, lambda e: {"Duplicates": int(e.get("Duplicates") or 0) + 1})

    async def note_copied(self, message_id: UUID, left_behind: str) -> None:
        """Mark the original ``left_behind`` as one whose outcome went on in a copy."""
        await self._patch(message_id, lambda e: {"CopiedFrom": left_behind})

    async def _patch(self, message_id: UUID, change: Callable[[Mapping[str, Any]], dict[str, Any]]) -> None:
        """Write only the properties ``change`` returns, on the read's ETag: a concurrent outcome is
        neither lost nor overwritten."""
        with _boundary("upsert history"):
            client = await self._table.ready()
            for _ in range(5):
                try:
                    ix = await client.get_entity(_INDEX_PK, str(message_id))
                    stored = await client.get_entity(str(ix["Pk"]), str(ix["Rk"]))
                except ResourceNotFoundError as exc:
                    if not _entity_missing(exc):
                        raise  # (the table itself missing: not a message that is gone)
                    return
                patch = {"PartitionKey": stored["PartitionKey"], "RowKey": stored["RowKey"], **change(stored)}
                if await _merge_unchanged(client, patch, stored):
                    return

    @property
    def store_id(self) -> str:
        """Which table this tracker writes to (names the local journal of records not yet written)."""
        client = self._table.client
        return f"tables:{client.url.split('?')[0]}|{client.table_name}"

    async def upsert_newer(self, records: Sequence[MessageRecord]) -> None:
        """Write each record unless the stored one is newer (a late write from the history backlog):
        read, compare ``UpdatedAt``, write on the read's ETag (a change in between reads again)."""
        latest = newest_per_message(records)
        with _boundary("upsert history"):
            client = await self._table.ready()
            # a read and a conditional write per record: many at once, or a backlog drains slowly
            limit = asyncio.Semaphore(_LATE_WRITES)

            async def one(rec: MessageRecord) -> None:
                async with limit:
                    await self._write_if_newer(client, rec)
                    if rec.copied_from is not None:
                        # kept even where a newer record stays: the original that a copy left behind
                        # is recognised by it when it returns (else it runs again beside the copy)
                        await self.note_copied(rec.message_id, rec.copied_from)

            await asyncio.gather(*(one(r) for r in latest.values()))

    async def _write_if_newer(self, client: TableClient, rec: MessageRecord) -> None:
        # (as ``upsert``: a message this instance wrote needs neither its body nor its index entity again)
        known = rec.message_id in self._written
        e = _record_entity(rec.model_copy(update={"body": None}) if known else rec)
        newer = as_utc(rec.updated_at)
        fresh = is_enqueue_record(rec)

        def keep(stored: Mapping[str, Any]) -> bool:
            # ``supersedes`` in the table's terms: history that moved on while this record waited is left
            # as it is, a producer's record never replaces an outcome (its clock, read after the send,
            # may be later than the worker's), and a run's record always replaces a producer's and an
            # operator's request to cancel
            if fresh:
                return _plain_utc(stored["UpdatedAt"]) > newer or stored.get("Status") in OUTCOMES
            request = stored.get("Status") == MessageStatus.CANCELLED.value and (
                stored.get("Description") == CANCEL_REQUESTED
            )
            return _plain_utc(stored["UpdatedAt"]) > newer and not _producers(stored) and not request

        # (a message this instance wrote whose entity is gone was deleted meanwhile, by a purge or an
        # operator: a record made again without its body and index entity would be found nowhere, so
        # it is made again only from a record that carries its body, whole, as ``upsert`` does)
        if not await self._merge_on_etag(client, e, keep, create=not known):
            self._forget([e["MessageId"]])
            if rec.body is not None:
                await self._write_if_newer(client, rec)  # (unknown now: created, with the index)
            return
        if not known:
            await client.upsert_entity(_index_entity(e), mode=UpdateMode.REPLACE)
            if rec.body is not None:
                self._remember([rec.message_id])

    async def _insert_new(self, client: TableClient, batch: list[dict[str, Any]]) -> set[str]:
        """Create each entity; where one exists, merge into it unless it holds an outcome. Returns the
        message ids of any found existing and then deleted before the merge (not made again)."""
        if len(batch) > 1:
            try:
                await client.submit_transaction([("create", e) for e in batch])
                return set()
            except (TableTransactionError, ResourceExistsError) as exc:
                if getattr(exc, "error_code", None) != "EntityAlreadyExists":
                    raise
            # rare (a worker beat the producer, or a lease was released): one by one
        gone: set[str] = set()
        for e in batch:
            try:
                await client.create_entity(e)
            except ResourceExistsError:
                if not await self._merge_unless_outcome(client, e):
                    gone.add(e["MessageId"])
        return gone

    @classmethod
    async def _merge_unless_outcome(cls, client: TableClient, e: dict[str, Any]) -> bool:
        """``_merge_on_etag`` keeping a stored outcome; False: no entity to merge into."""
        return await cls._merge_on_etag(
            client, e, lambda stored: stored.get("Status") in OUTCOMES, create=False
        )

    @staticmethod
    async def _merge_on_etag(
        client: TableClient, e: dict[str, Any], keep: Callable[[Mapping[str, Any]], bool], *, create: bool
    ) -> bool:
        """MERGE ``e`` over the stored entity unless ``keep(stored)``, on the read's ETag (a change in
        between: look again). A missing entity is created when ``create``, else left alone (a purge
        deleted it meanwhile: nothing to record against) and False."""
        for _ in range(5):
            try:
                stored = await client.get_entity(e["PartitionKey"], e["RowKey"])
            except ResourceNotFoundError as exc:
                if not _entity_missing(exc):
                    raise
                if not create:
                    return False
                try:
                    await client.create_entity(e)
                    return True
                except ResourceExistsError:
                    continue  # written meanwhile: compare with that one
            if keep(stored) or await _merge_unchanged(client, e, stored):
                return True
        return True  # (changed under it five times: history that moves that fast is newer anyway)

    @staticmethod
    async def _update_existing(client: TableClient, batch: list[dict[str, Any]]) -> set[str]:
        """MERGE each entity into the stored one; a missing one is left missing, and its message id
        returned. One missing entity fails the whole transaction, so then one by one (rare: only
        after a delete)."""
        if len(batch) > 1:
            try:
                await client.submit_transaction([("update", e, {"mode": UpdateMode.MERGE}) for e in batch])
                return set()
            except (TableTransactionError, ResourceNotFoundError) as exc:
                if not _entity_missing(exc):
                    raise
        gone: set[str] = set()
        for e in batch:
            try:
                await client.update_entity(e, mode=UpdateMode.MERGE)
            except ResourceNotFoundError as exc:
                if not _entity_missing(exc):
                    raise  # (the table itself missing: the history writer keeps the record)
                gone.add(e["MessageId"])
        return gone

    @staticmethod
    async def _write(client: TableClient, batch: list[dict[str, Any]], mode: UpdateMode) -> None:
        if len(batch) == 1:
            await client.upsert_entity(batch[0], mode=mode)
        else:
            await client.submit_transaction([("upsert", e, {"mode": mode}) for e in batch])

    async def get(self, message_id: UUID) -> MessageRecord | None:
        with _boundary("read history"):
            client = await self._table.ready()
            try:
                ix = await client.get_entity(_INDEX_PK, str(message_id))
                e = await client.get_entity(str(ix["Pk"]), str(ix["Rk"]))
            except ResourceNotFoundError:
                return None
        return _record_from_entity(e)

    async def query(
        self, query: MessageQuery, *, limit: int = 50, cursor: str | None = None
    ) -> Page[MessageRecord]:
        if limit < 1:
            raise ValueError("limit must be at least 1")
        if query.status == ():
            return Page[MessageRecord](items=[])
        f = _query_filter(query)
        token = _decode_cursor(cursor)
        items: list[MessageRecord] = []
        with _boundary("query history"):
            client = await self._table.ready()
            # The service may return short (even empty) pages with a continuation; ask only for what
            # is still missing so the token never points past an item we did not return.
            for request in range(_PAGE_REQUESTS):
                try:
                    entities, token = await self._page(client, f, min(limit - len(items), 1000), token)
                except HttpResponseError as exc:
                    if request == 0 and token is not None and exc.status_code == 400:
                        raise invalid_cursor() from exc  # the caller's token, refused by the service
                    raise
                items.extend(_record_from_entity(e) for e in entities if _entity_matches(query, e))
                if token is None or len(items) >= limit:
                    break
        return Page[MessageRecord](items=items, next_cursor=_encode_cursor(token))

    @staticmethod
    async def _page(
        client: TableClient,
        f: _Filter,
        size: int,
        token: dict[str, str] | None,
        select: list[str] | None = None,
    ) -> tuple[list[TableEntity], dict[str, str] | None]:
        pages = client.query_entities(
            f.text, parameters=f.params, results_per_page=size, select=select
        ).by_page(continuation_token=cast(Any, token))  # typed as str; Tables uses a dict
        entities: list[TableEntity] = []
        async for page in pages:
            entities = [e async for e in page]
            break
        return entities, _continuation(getattr(pages, "continuation_token", None))

    async def counts(self) -> dict[tuple[str, str], int]:
        # A projected scan of the table (two properties per record). Counter entities would make this
        # O(queues) but cost a read-modify-write on a few hot entities for every status change, which
        # serializes all instances on them; the scan is bounded by retention and only the ops API asks.
        f = _Filter()
        f.add(f"PartitionKey ne {f.param(_INDEX_PK)}")
        found: Counter[tuple[str, str]] = Counter()
        with _boundary("count history"):
            client = await self._table.ready()
            entities = client.query_entities(
                f.text, parameters=f.params, select=["Queue", "Status"], results_per_page=1000
            )
            async for e in entities:
                found[(str(e["Queue"]), str(e["Status"]))] += 1
        return dict(found)

    async def delete(self, query: MessageQuery, only: Only | None = None) -> int:
        if query.status == () or (only is not None and not only):
            return 0
        keys = None if only is None else {str(i): s for i, s in as_listed(only).items()}

        def listed(e: Mapping[str, Any]) -> bool:
            key = str(e.get("MessageId"))
            return keys is None or (
                key in keys and still_as_listed(keys[key], e.get("Status"), e.get("UpdatedAt"))
            )

        return await self._delete_where(
            _query_filter(query), lambda e: _entity_matches(query, e) and listed(e)
        )

    async def prune(self, now: datetime, keep: Collection[str] = ()) -> int:
        """Delete terminal records last updated before ``now - retention``, but none in ``keep`` (the
        transport's ``dead_letters_kept``); returns how many."""
        f = _Filter()
        f.add(f"PartitionKey ne {f.param(_INDEX_PK)}")
        f.add(f"UpdatedAt lt {f.param(as_utc(now) - self.retention)}")
        f.any_of("Status", [s for s in _TERMINAL if s not in keep])
        return await self._delete_where(f, lambda e: True)

    async def _delete_where(self, f: _Filter, keep: Callable[[Mapping[str, Any]], bool]) -> int:
        deleted = 0
        token: dict[str, str] | None = None
        with _boundary("delete history"):
            client = await self._table.ready()
            while True:
                # Deleting rows behind the continuation token does not disturb the pages after it.
                entities, token = await self._page(client, f, 1000, token, _MATCH_PROPS)
                doomed = [e for e in entities if keep(e)]
                # Each index entry too only as read before its record goes: a host that finds the
                # record deleted writes it again whole, record then index entry, and an index entry
                # deleted after that would leave the record listed but found by no lookup.
                index = await self._index_entries(client, doomed)
                # each record only as it was read (its ETag): one written meanwhile (an operator's
                # retry reopened it, a run recorded it) no longer says what chose it, and stays
                records = [
                    {"PartitionKey": e["PartitionKey"], "RowKey": e["RowKey"], "etag": e.metadata["etag"]}
                    for e in doomed
                ]
                gone: set[tuple[str, str]] = set()
                for batch in _batches(records):
                    gone.update(await self._delete_unchanged(client, batch))
                left = [e for e in doomed if (e["PartitionKey"], e["RowKey"]) in gone]
                entries = [index[k] for e in left if (k := (e["PartitionKey"], e["RowKey"])) in index]
                for batch in _batches(entries):
                    await self._delete_unchanged(client, batch)
                for e in left:  # a message written again later needs its index and body again
                    self._written.pop(UUID(e["MessageId"]), None)
                deleted += len(left)
                if token is None:
                    return deleted

    @staticmethod
    async def _index_entries(
        client: TableClient, records: Sequence[Mapping[str, Any]]
    ) -> dict[tuple[str, str], dict[str, Any]]:
        """The id index entries of ``records`` with their ETags, by the record's keys; an entry that
        is missing or points at another record (the id written again in another queue) is left out."""
        limit = asyncio.Semaphore(_LATE_WRITES)  # a point read per record: a few at once
        found: dict[tuple[str, str], dict[str, Any]] = {}

        async def one(e: Mapping[str, Any]) -> None:
            async with limit:
                try:
                    ix = await client.get_entity(_INDEX_PK, str(e["MessageId"]))
                except ResourceNotFoundError as exc:
                    if not _entity_missing(exc):
                        raise
                    return
            if (ix.get("Pk"), ix.get("Rk")) == (e["PartitionKey"], e["RowKey"]):
                found[(e["PartitionKey"], e["RowKey"])] = {
                    "PartitionKey": _INDEX_PK,
                    "RowKey": ix["RowKey"],
                    "etag": ix.metadata["etag"],
                }

        await asyncio.gather(*(one(e) for e in records))
        return found

    @staticmethod
    async def _delete_unchanged(client: TableClient, batch: list[dict[str, Any]]) -> list[tuple[str, str]]:
        """Delete the entities of ``batch`` (one partition) that are as read (their ETags); the keys of
        those gone (one already gone counts: a concurrent delete)."""
        condition = {"match_condition": MatchConditions.IfNotModified}
        try:
            await client.submit_transaction(
                [
                    (
                        "delete",
                        {"PartitionKey": e["PartitionKey"], "RowKey": e["RowKey"]},
                        {"etag": e["etag"], **condition},
                    )
                    for e in batch
                ]
            )
            return [(str(e["PartitionKey"]), str(e["RowKey"])) for e in batch]
        except TableTransactionError:
            pass  # one changed or gone fails the whole transaction: one by one, where it alone stays
        return [
            (str(e["PartitionKey"]), str(e["RowKey"]))
            for e in batch
            if await _delete_if_unchanged(client, str(e["PartitionKey"]), str(e["RowKey"]), str(e["etag"]))
        ]


# --- factory -----------------------------------------------------------------------------------

_TABLE_NAME = re.compile(r"[A-Za-z][A-Za-z0-9]{2,62}")


def tables_from_connection(
    connection_string: str | None = None,
    *,
    table_service_uri: str | None = None,
    credential: Credential | None = None,
    client_id: str | None = None,
    control_table: str = "queueingcontrol",
    tracker_table: str = "queueinghistory",
    retention: timedelta = timedelta(days=14),
) -> tuple[TablesControlStore, TablesTracker]:
    """The control store and tracker on one account; the tables are created on first use.

    Give a connection string, or a table service URI (``https://<acct>.table.core.windows.net``)
    with a credential; without one, ``DefaultAzureCredential`` (managed identity in Azure: the
    user-assigned one with ``client_id``, from ``QueueingStorage__clientId``).
    """
    for setting, name in (
        ("QUEUEING_CONTROL_TABLE", control_table),
        ("QUEUEING_TRACKER_TABLE", tracker_table),
    ):
        if not _TABLE_NAME.fullmatch(name):
            raise ConfigurationError(
                setting, f"invalid table name {name!r}", "3-63 letters or digits, a letter first"
            )
    closers: list[Closer] = []
    policy = retry_policy.azure_tables()
    if connection_string:
        if table_service_uri:
            raise ConfigurationError(
                "QueueingStorage",
                "both a connection string and a table service URI were given",
                "one of them",
            )
        try:
            control = TableClient.from_connection_string(connection_string, control_table, **policy)
            tracker = TableClient.from_connection_string(connection_string, tracker_table, **policy)
        except ValueError as exc:
            raise ConfigurationError("QueueingStorage", f"invalid connection string: {exc}") from None
    elif table_service_uri:
        if credential is None:
            from ..connections import identity_credential

            owned = identity_credential(client_id)
            credential = owned
            closers.append(owned.close)  # closing twice (both stores) is harmless
        try:
            control = TableClient(table_service_uri, control_table, credential=credential, **policy)
            tracker = TableClient(table_service_uri, tracker_table, credential=credential, **policy)
        except ValueError as exc:
            raise ConfigurationError("QueueingStorage__tableServiceUri", str(exc)) from None
    else:
        raise ConfigurationError(
            "QueueingStorage",
            "no connection string and no table service URI",
            "QueueingStorage=<connection string> or QueueingStorage__tableServiceUri=https://<account>.table.core.windows.net",
        )
    return (
        TablesControlStore(control, create_table=True, close_also=closers),
        TablesTracker(tracker, retention=retention, create_table=True, close_also=closers),
    )


async def _delete_if_unchanged(client: TableClient, pk: str, rk: str, etag: str) -> bool:
    """Delete one entity only while its ETag is still ``etag``; False when it was written since (it
    stays). One already gone counts as deleted (the SDK ignores "not found")."""
    try:
        await client.delete_entity(pk, rk, etag=etag, match_condition=MatchConditions.IfNotModified)
    except ResourceModifiedError:
        return False
    except ResourceNotFoundError as exc:
        if not _entity_missing(exc):
            raise
    return True


async def _write_if_unchanged(client: TableClient, entity: dict[str, Any], etag: str | None) -> None:
    """Compare-and-set on one entity: create it where there was none (``etag`` None), else replace it
    only while its ETag is still ``etag``. Another writer first raises ResourceExistsError or
    ResourceModifiedError (ResourceNotFoundError if it deleted the entity). REPLACE, not MERGE:
    fields that became None are dropped."""
    if etag is None:
        await client.create_entity(entity)
    else:
        await client.update_entity(
            entity, mode=UpdateMode.REPLACE, etag=etag, match_condition=MatchConditions.IfNotModified
        )
