"""Schedule ticks on Azure Tables (Service Bus and Storage Queues deployments): one entity per
schedule, ``("schedule", <name>)``, in the control table, changed only by ETag-guarded writes.

A tick is claimed, then sent, then confirmed. The entity holds the newest tick, its state
(``claimed`` or ``sent``) and how long the claim lasts. Exactly one host's conditional write claims a
tick. A host that dies after its claim leaves the tick ``claimed``; once the claim lapses, the next
round on any host takes it over and sends it again, with the same message ids (so a send that did
happen before the crash comes out as a duplicate with the same id, never as a lost tick). A newer
tick is not claimed while an older one is unconfirmed, so ticks go out in order.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import suppress
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Final

from azure.core import MatchConditions
from azure.core.exceptions import ResourceExistsError, ResourceModifiedError, ResourceNotFoundError
from azure.data.tables import UpdateMode

from ..errors import ProviderUnavailable
from .tables import _CAS_ATTEMPTS, _boundary, _cas_backoff, _plain_utc, _Table, escape_key

if TYPE_CHECKING:
    from ..envelope import Envelope
    from ..schedules import Announce, Send

_PK: Final = "schedule"
CLAIMED: Final = "claimed"
SENT: Final = "sent"


class TablesTickStore:
    def __init__(self, table: _Table, *, lease: timedelta = timedelta(seconds=30)) -> None:
        self._table = table
        self.lease = lease

    async def _read(self, name: str) -> tuple[dict[str, Any] | None, str | None]:
        client = await self._table.ready()
        try:
            e = await client.get_entity(_PK, escape_key(name))
        except ResourceNotFoundError:
            return None, None
        return dict(e), str(e.metadata["etag"])

    async def last_ticks(self, names: Sequence[str]) -> dict[str, datetime]:
        wanted = set(names)
        out: dict[str, datetime] = {}
        with _boundary("read schedule ticks"):
            client = await self._table.ready()
            async for e in client.query_entities("PartitionKey eq @p", parameters={"p": _PK}):
                if e.get("Name") in wanted:
                    out[str(e["Name"])] = _plain_utc(e["LastTick"])
        return out

    async def unfinished(self, schedule: str, now: datetime) -> list[datetime]:
        with _boundary("read schedule tick"):
            e, _ = await self._read(schedule)
        if e is not None and e["State"] == CLAIMED and _plain_utc(e["ClaimedUntil"]) <= now:
            return [_plain_utc(e["LastTick"])]
        return []

    async def fire(
        self,
        schedule: str,
        tick: datetime,
        envelopes: Sequence[Envelope],
        send: Send,
        now: datetime,
        identities: Sequence[str | None] = (),
        announce: Announce | None = None,
    ) -> bool:
        etag = await self._claim(schedule, tick, now)
        if etag is None:
            return False
        try:
            await send(envelopes)
        except BaseException:
            # give the claim up at once (lapsed), so the next round on any host sends it again
            await self._replace(schedule, self._entity(schedule, tick, CLAIMED, now), etag, "release")
            raise
        await self._replace(schedule, self._entity(schedule, tick, SENT, None), etag, "confirm")
        return True

    async def _replace(self, schedule: str, entity: dict[str, Any], etag: str, action: str) -> None:
        """Write over our own claim; if it changed since, another host took the lapsed tick over and
        sends it again itself (with the same message ids), so there is nothing left for us to do."""
        with _boundary(f"{action} schedule tick"):
            client = await self._table.ready()
            with suppress(ResourceModifiedError, ResourceNotFoundError):
                await client.update_entity(
                    entity, mode=UpdateMode.REPLACE, etag=etag, match_condition=MatchConditions.IfNotModified
                )

    @staticmethod
    def _entity(schedule: str, tick: datetime, state: str, until: datetime | None) -> dict[str, Any]:
        entity: dict[str, Any] = {
            "PartitionKey": _PK,
            "RowKey": escape_key(schedule),
            "Name": schedule,
            "LastTick": tick,
            "State": state,
        }
        if until is not None:
            entity["ClaimedUntil"] = until
        return entity

    async def _claim(self, schedule: str, tick: datetime, now: datetime) -> str | None:
        """The ETag of our claim, or None when the tick is not ours to send."""
        with _boundary("claim schedule tick"):
            client = await self._table.ready()
            for attempt in range(_CAS_ATTEMPTS):
                current, etag = await self._read(schedule)
                if current is not None:
                    last = _plain_utc(current["LastTick"])
                    claimed = current["State"] == CLAIMED
                    lapsed = claimed and _plain_utc(current["ClaimedUntil"]) <= now
                    if last > tick or (last == tick and not lapsed):
                        return None  # done or being done
                    if last < tick and claimed:
                        return None  # an older tick is unconfirmed: it goes first
                entity = self._entity(schedule, tick, CLAIMED, now + self.lease)
                try:
                    if etag is None:
                        result = await client.create_entity(entity)
                    else:
                        result = await client.update_entity(
                            entity,
                            mode=UpdateMode.REPLACE,
                            etag=etag,
                            match_condition=MatchConditions.IfNotModified,
                        )
                    return str(result["etag"])
                except (ResourceModifiedError, ResourceExistsError, ResourceNotFoundError):
                    await _cas_backoff(attempt)  # another host wrote first: read again
        raise ProviderUnavailable(f"schedule {schedule!r}: too much contention, gave up")
