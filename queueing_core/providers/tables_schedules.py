"""Schedule ticks on Azure Tables (Service Bus and Storage Queues deployments): one entity per
schedule, ``("schedule", <name>)``, in the control table, changed only by ETag-guarded writes.

A tick is claimed, then sent, then confirmed. The entity holds the newest claimed tick (``LastTick``)
and, in ``Held``, every claimed tick not yet confirmed with how long its claim lasts and the claim's
own token. Exactly one host's conditional write claims a tick. A newer tick can be claimed while an
older one is held, as in the SQL side database (RabbitMQ, SQS): a host that dies holding a tick does
not hold up the ticks after it. A host that dies after its claim leaves the tick held; once the claim
lapses, the next round on any host takes it over (a new token) and sends it again, with the same
message ids (so a send that did happen before the crash comes out as a duplicate with the same id,
never as a lost tick). Confirming or releasing a claim checks its token, so a host whose claim was
taken over changes nothing.

``State`` and ``ClaimedUntil`` still describe ``LastTick`` alone, as entities written before ``Held``
did; such an entity's held claim is read from them.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, Final

from azure.core import MatchConditions
from azure.core.exceptions import ResourceExistsError, ResourceModifiedError, ResourceNotFoundError
from azure.data.tables import UpdateMode

from ..control.base import cas_backoff
from ..errors import ProviderUnavailable
from .tables import _CAS_ATTEMPTS, _boundary, _plain_utc, _Table, escape_key

if TYPE_CHECKING:
    from ..envelope import Envelope
    from ..schedules import Announce, Send

_PK: Final = "schedule"
CLAIMED: Final = "claimed"
SENT: Final = "sent"


#: a held claim: until when it holds, and its token
_Claim = tuple[datetime, str]


def _key(tick: datetime) -> str:
    return tick.astimezone(UTC).isoformat()


def _held(entity: dict[str, Any]) -> dict[datetime, _Claim]:
    """The entity's unconfirmed claims, by tick."""
    raw = entity.get("Held")
    if raw is None:  # written before Held: State and ClaimedUntil describe LastTick alone
        if entity.get("State") == CLAIMED:
            return {_plain_utc(entity["LastTick"]): (_plain_utc(entity["ClaimedUntil"]), "")}
        return {}
    return {
        datetime.fromisoformat(tick): (datetime.fromisoformat(until), str(token))
        for tick, (until, token) in json.loads(str(raw)).items()
    }


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
        if e is None:
            return []
        return sorted(tick for tick, (until, _token) in _held(e).items() if until <= now)

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
        token = await self._claim(schedule, tick, now)
        if token is None:
            return False
        try:
            await send(envelopes)
        except BaseException:
            # give the claim up at once (lapsed), so the next round on any host sends it again
            await self._settle(schedule, tick, token, now, "release")
            raise
        await self._settle(schedule, tick, token, None, "confirm")
        return True

    @staticmethod
    def _entity(schedule: str, last: datetime, held: dict[datetime, _Claim]) -> dict[str, Any]:
        entity: dict[str, Any] = {
            "PartitionKey": _PK,
            "RowKey": escape_key(schedule),
            "Name": schedule,
            "LastTick": last,
            "State": CLAIMED if last in held else SENT,
            "Held": json.dumps({_key(t): [_key(u), k] for t, (u, k) in sorted(held.items())}),
        }
        if last in held:
            entity["ClaimedUntil"] = held[last][0]
        return entity

    async def _write(self, entity: dict[str, Any], etag: str | None) -> None:
        client = await self._table.ready()
        if etag is None:
            await client.create_entity(entity)
        else:
            await client.update_entity(
                entity, mode=UpdateMode.REPLACE, etag=etag, match_condition=MatchConditions.IfNotModified
            )

    async def _settle(
        self, schedule: str, tick: datetime, token: str, until: datetime | None, action: str
    ) -> None:
        """Confirm our claim (``until`` None: drop it from the held ones) or release it (lapsed at
        ``until``). If it is no longer ours, another host took the lapsed tick over and sends it again
        itself (with the same message ids), so there is nothing left for us to do."""
        with _boundary(f"{action} schedule tick"):
            for attempt in range(_CAS_ATTEMPTS):
                current, etag = await self._read(schedule)
                if current is None:
                    return
                held = _held(current)
                if held.get(tick, (None, None))[1] != token:
                    return
                if until is None:
                    del held[tick]
                else:
                    held[tick] = (until, token)
                try:
                    await self._write(self._entity(schedule, _plain_utc(current["LastTick"]), held), etag)
                    return
                except (ResourceModifiedError, ResourceNotFoundError):
                    await cas_backoff(attempt)  # another host claimed a tick meanwhile: read again
        raise ProviderUnavailable(f"schedule {schedule!r}: too much contention, gave up ({action})")

    async def _claim(self, schedule: str, tick: datetime, now: datetime) -> str | None:
        """The token of our claim, or None when the tick is not ours to send."""
        with _boundary("claim schedule tick"):
            for attempt in range(_CAS_ATTEMPTS):
                current, etag = await self._read(schedule)
                held: dict[datetime, _Claim] = {}
                last = tick
                if current is not None:
                    held = _held(current)
                    last = _plain_utc(current["LastTick"])
                    if tick in held:
                        if held[tick][0] > now:
                            return None  # being done
                    elif tick <= last:
                        return None  # done
                    last = max(last, tick)  # (older held ticks stay held: their claims run on)
                token = uuid.uuid4().hex
                held[tick] = (now + self.lease, token)
                try:
                    await self._write(self._entity(schedule, last, held), etag)
                    return token
                except (ResourceModifiedError, ResourceExistsError, ResourceNotFoundError):
                    await cas_backoff(attempt)  # another host wrote first: read again
        raise ProviderUnavailable(f"schedule {schedule!r}: too much contention, gave up")
