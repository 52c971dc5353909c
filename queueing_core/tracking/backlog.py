"""History that has not landed yet: written until it does, kept on disk so a restart does not forget it.

The transports without their own history (Storage Queues, Service Bus, RabbitMQ, SQS) settle a message
and record what happened in a separate store. That store can be down while the transport is up, and a
process can die between the two. So a record is first put in a small journal on local disk (SQLite,
one row per message), *before* the transport is settled; once the store has it, the row is deleted.
A write that fails stays in the backlog and is retried with a short capped backoff until it lands; a
process that opens the same store later (a restarted worker, the CLI, the ops API) writes what an
earlier one left in the journal.

A row kept before its settlement is marked settled once the transport has applied it. A row a dead
process left unmarked may describe a settlement that never happened (the process died first): the
message is then still on its queue and runs again once its lease lapses. Such a row is written only
after that (``unsettled_after``, longer than any lease), through the rule below: if the message ran
again meanwhile, its newer record stays; if the settlement had happened, the row lands late. If the
message has not run again by then, history shows that outcome until its run records its own (the
runtime never skips a run on such a record: only a success marks a repeated forward a duplicate).

Late writes never replace newer history: the backlog writes through the tracker's ``upsert_newer``
(a record whose ``updated_at`` is older than the stored one is dropped), so a retried "Failed" cannot
overwrite the "Succeeded" of the retry that ran meanwhile, and a late "Pending" from a producer cannot
overwrite an outcome. A run's record is not held back by a producer's, whatever their clocks say: a
producer reads its clock after the send, a worker that ran the message at once may read an earlier
time. The same rule (:func:`~queueing_core.tracking.base.supersedes`) holds while records wait, in the
backlog and in the journal, and for records written at once that another host's record may overtake
(:meth:`HistoryWriter.write`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import sqlite3
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable
from uuid import UUID

from ..clock import Clock, as_utc, utcnow
from ..errors import ProviderUnavailable
from ..messages import MessageStatus
from .base import OUTCOMES, MessageRecord, Tracker, is_enqueue_record, is_producers_record, supersedes

log = logging.getLogger("queueing.history")

#: the longest pause between two tries of the backlog (the store's recovery is seen within this)
RETRY_MAX = 2.0
RETRY_FIRST = 0.25
#: how often a running process looks for rows of processes that are gone (seconds)
ADOPT_EVERY = 5.0
#: a journal row older than this (seconds) is a record not written, not one on its way
JOURNAL_STALE = 10.0
#: records per write while draining (one request batch)
DRAIN_CHUNK = 200
#: refusals of one record, while the store takes the others, before it is dropped (see ``_isolate``)
POISON_STRIKES = 3
#: statuses no run follows
FINAL = frozenset(s.value for s in MessageStatus.terminal())


@runtime_checkable
class WritesLate(Protocol):
    """A tracker that can write a record unless the stored one is newer (by ``updated_at``)."""

    async def upsert_newer(self, records: Sequence[MessageRecord]) -> None: ...


@runtime_checkable
class NamesItsStore(Protocol):
    """A tracker that can say which store it writes to (the journal is kept per store)."""

    @property
    def store_id(self) -> str: ...


#: the journals open in this process (by owner mark): a row whose mark is not here, under this
#: process's id, was left by a journal that is closed (or by an earlier process with the same id)
_OPEN: set[str] = set()


def _alive(owner: str) -> bool:
    """Whether the journal that kept a row still runs (the journal is on local disk: one machine)."""
    pid_text, _, _ = owner.partition(":")
    pid = int(pid_text) if pid_text.isdigit() else 0
    if pid == os.getpid():
        return owner in _OPEN
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return pid > 0


def _producers(text: str) -> bool:
    """Whether a journal row's stored record is a producer's (one that no longer reads: not)."""
    try:
        return is_producers_record(MessageRecord.model_validate_json(text))
    except ValueError:
        return False


def may_be_overtaken(rec: MessageRecord) -> bool:
    """A run's record after which the message runs again (released, retried, deferred, paused): the
    next run's record may reach the store before it, whatever the delay, since one write to a store
    can take longer than that (an SDK's tries and timeouts: up to minutes on Azure Tables), so it is
    written by the late write's rule. An outcome has no next run, and a producer's record is kept from
    outcomes by the stores themselves."""
    return not (rec.status in FINAL or is_enqueue_record(rec))


def default_journal_dir() -> Path:
    return Path(tempfile.gettempdir()) / "queueing-history"


class Journal:
    """Records waiting for the history store, in a SQLite file on local disk. One row per message (a
    later record of the same message replaces the earlier one, by :func:`supersedes`: never an older one,
    which another process on this machine may journal after it); rows are keyed by a sequence number so
    that deleting a written record never deletes a newer one of the same message."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        # several processes on one machine may share the file (a worker, the CLI): WAL and a busy wait
        self._db = sqlite3.connect(str(path), timeout=10.0, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        # a killed process loses nothing the OS already has; only a power cut could (then the message
        # history is behind, never the messages themselves)
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS pending ("
            " seq INTEGER PRIMARY KEY AUTOINCREMENT,"
            " message_id TEXT NOT NULL UNIQUE,"
            " record TEXT NOT NULL,"
            " added REAL NOT NULL,"
            " owner TEXT NOT NULL,"  # <process id>:<journal>, of the journal that kept the row
            " settled INTEGER NOT NULL DEFAULT 1,"  # 0: kept before a settlement not yet applied
            " updated REAL NOT NULL DEFAULT 0,"  # the record's updated_at (epoch seconds)
            " outcome INTEGER NOT NULL DEFAULT 0,"  # 1: the record is an outcome (see supersedes())
            " enqueue INTEGER NOT NULL DEFAULT 0)"  # 1: the record is a producer's (likewise)
        )
        columns = {str(c[1]) for c in self._db.execute("PRAGMA table_info(pending)").fetchall()}
        # a journal file of an earlier version of the kit (its rows: replaced by any record, as then)
        for name, default in (("settled", 1), ("updated", 0), ("outcome", 0), ("enqueue", 0)):
            if name in columns:
                continue
            kind = "REAL" if name == "updated" else "INTEGER"
            with self._db:
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    self._db.execute(
                        f"ALTER TABLE pending ADD COLUMN {name} {kind} NOT NULL DEFAULT {default}"
                    )
                except sqlite3.OperationalError as exc:  # another process upgraded it just now
                    if "duplicate column" not in str(exc):
                        raise
                    continue
                if name == "enqueue":  # what the rows already kept are, read from the records themselves
                    rows = self._db.execute("SELECT seq, record FROM pending").fetchall()
                    self._db.executemany(
                        "UPDATE pending SET enqueue = 1 WHERE seq = ?",
                        [(seq,) for seq, text in rows if _producers(text)],
                    )
        self.owner = f"{os.getpid()}:{uuid.uuid4().hex[:12]}"
        _OPEN.add(self.owner)

    @classmethod
    def for_store(cls, directory: Path, store_id: str) -> Journal:
        digest = hashlib.sha256(store_id.encode()).hexdigest()[:16]
        return cls(directory / f"history-{digest}.sqlite3")

    def add(self, records: Sequence[MessageRecord], *, settled: bool = True) -> dict[UUID, int]:
        """Keep ``records`` (``settled=False``: before their settlement is applied); returns each
        message's row number (for :meth:`forget` and :meth:`mark_settled`). A record older than the row
        its message has (see :func:`supersedes`) is not kept, and has no row number: the row is not its."""
        rows: dict[UUID, int] = {}
        now = time.time()
        with self._db:
            self._db.execute("BEGIN IMMEDIATE")
            for r in records:
                cur = self._db.execute(
                    "INSERT INTO pending (message_id, record, added, owner, settled, updated, outcome, "
                    "enqueue) VALUES (?, ?, ?, ?, ?, ?, ?, ?) "
                    "ON CONFLICT (message_id) DO UPDATE SET seq = "
                    "(SELECT COALESCE(MAX(seq), 0) + 1 FROM pending), record = excluded.record, "
                    "added = excluded.added, owner = excluded.owner, settled = excluded.settled, "
                    "updated = excluded.updated, outcome = excluded.outcome, enqueue = excluded.enqueue "
                    # supersedes(), in the journal's terms
                    "WHERE CASE WHEN excluded.enqueue = 1 "
                    "THEN excluded.updated >= pending.updated AND pending.outcome = 0 "
                    "ELSE excluded.updated >= pending.updated OR pending.enqueue = 1 END "
                    "RETURNING seq",
                    (
                        str(r.message_id),
                        r.model_dump_json(),
                        now,
                        self.owner,
                        int(settled),
                        as_utc(r.updated_at).timestamp(),
                        int(r.status in OUTCOMES),
                        int(is_producers_record(r)),
                    ),
                )
                row = cur.fetchone()
                if row is not None:
                    rows[r.message_id] = int(row[0])
        return rows

    def mark_settled(self, rows: Sequence[int]) -> None:
        """The transport applied the settlements these rows were kept for."""
        if not rows:
            return
        with self._db:
            self._db.execute("BEGIN IMMEDIATE")
            self._db.executemany("UPDATE pending SET settled = 1 WHERE seq = ?", [(r,) for r in rows])

    def forget(self, rows: Sequence[int]) -> None:
        if not rows:
            return
        with self._db:
            self._db.execute("BEGIN IMMEDIATE")
            self._db.executemany("DELETE FROM pending WHERE seq = ?", [(r,) for r in rows])

    def take_over(self, unsettled_after: float = 0.0) -> list[tuple[int, MessageRecord]]:
        """The rows of processes that are gone (killed, stopped): this process writes them now. A live
        process's rows are its own: it may be settling them right now, and a settlement that is refused
        is dropped, not written. A row left before its settlement was applied is taken only once it is
        ``unsettled_after`` seconds old (see the module's notes)."""
        cutoff = time.time() - unsettled_after
        owners = [str(o) for (o,) in self._db.execute("SELECT DISTINCT owner FROM pending").fetchall()]
        gone = [o for o in owners if not _alive(o)]
        taken: list[tuple[int, MessageRecord]] = []
        if not gone:
            return taken
        with self._db:
            self._db.execute("BEGIN IMMEDIATE")
            for owner in gone:
                rows = self._db.execute(
                    "SELECT seq, record FROM pending WHERE owner = ? AND (settled = 1 OR added <= ?)",
                    (owner, cutoff),
                ).fetchall()
                mine = [(int(seq), MessageRecord.model_validate_json(text)) for seq, text in rows]
                self._db.executemany(
                    "UPDATE pending SET owner = ? WHERE seq = ?", [(self.owner, seq) for seq, _ in mine]
                )
                taken += mine
        return sorted(taken, key=lambda row: row[0])

    def count(self, older_than: float = 0.0) -> int:
        """Rows kept more than ``older_than`` seconds (a row lives milliseconds while the store answers)."""
        cutoff = time.time() - older_than
        return int(self._db.execute("SELECT COUNT(*) FROM pending WHERE added <= ?", (cutoff,)).fetchone()[0])

    def close(self) -> None:
        _OPEN.discard(self.owner)
        self._db.close()


class HistoryWriter:
    """Writes history for a host: at once when the store answers, else from the backlog until it lands.

    ``ahead`` keeps records in the journal before the transport is settled; ``write`` writes them once
    it is (``drop`` forgets those the transport refused). ``backlog`` is what has not landed yet."""

    def __init__(
        self,
        tracker: Tracker,
        *,
        journal_dir: Path | None = None,
        unsettled_after: float = 60.0,
        clock: Clock = utcnow,
    ) -> None:
        self.tracker = tracker
        #: the clock the records are stamped by (the runtime's)
        self.clock = clock
        self._journal_dir = journal_dir
        #: seconds before a dead process's row kept ahead of an unapplied settlement is written (longer
        #: than any lease, so a message whose settlement never happened has run again by then)
        self.unsettled_after = unsettled_after
        self.journal: Journal | None = None
        #: the journal's file (kept after close, for messages that point at it)
        self.journal_path: Path | None = None
        #: message id -> (journal row or 0, record) not yet in the store, oldest first
        self._pending: dict[UUID, tuple[int, MessageRecord]] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._opened = False
        #: a write failed and no write has succeeded since: new records go straight to the backlog
        self._down = False
        #: message id -> refusals of its waiting record while the store answered (see ``_isolate``)
        self._strikes: dict[UUID, int] = {}

    # -- lifecycle -----------------------------------------------------------------------------------
    def open(self) -> None:
        """Open the journal (when the store can be named) and take over what an earlier process left."""
        if self._opened:
            return
        self._opened = True
        if self._journal_dir is not None and isinstance(self.tracker, NamesItsStore):
            try:
                self.journal = Journal.for_store(self._journal_dir, self.tracker.store_id)
                self.journal_path = self.journal.path
            except (OSError, sqlite3.Error) as exc:
                log.warning(
                    "history journal in %s cannot be opened (%s): history that fails to land is "
                    "retried in memory only",
                    self._journal_dir,
                    exc,
                )
        if self.journal is not None:
            self._adopt()
            self._watcher = asyncio.get_running_loop().create_task(
                self._watch(), name="queueing-history-journal"
            )

    async def _watch(self) -> None:
        """A process on this machine that dies leaves its rows: take them over while this one runs."""
        while True:
            await asyncio.sleep(ADOPT_EVERY)
            self._adopt()

    def _adopt(self) -> None:
        """Take over the journal rows of processes that are gone, and write them."""
        if self.journal is None:
            return
        try:
            left = self.journal.take_over(self.unsettled_after)
        except sqlite3.Error as exc:
            log.warning("history journal cannot be read (%s)", exc)
            return
        for seq, rec in left:
            self._keep(seq, rec)
        if left:
            log.warning("%d history record(s) left by a process that is gone: writing them", len(left))
            self._start()

    async def close(self, *, grace: float = 2.0) -> None:
        """One last try at the backlog; what is still not written stays in the journal."""
        if self._pending:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._drain_once(), grace)
        for task in (self._task, self._watcher):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._task = self._watcher = None
        if self._pending:
            where = f"kept in {self.journal.path}" if self.journal else "lost with this process"
            log.error("%d history record(s) not written (%s)", len(self._pending), where)
        if self.journal is not None:
            self.journal.close()
            self.journal = None
        self._pending.clear()
        self._strikes.clear()
        self._opened = False
        self._down = False

    async def settle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the backlog to be written; True when it is."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._pending and loop.time() < deadline:
            self._wake.set()
            await asyncio.sleep(0.05)
        return not self._pending

    @property
    def backlog(self) -> int:
        """Records not yet in the history store (in this process, or in its journal on this machine)."""
        if self.journal is not None:
            with contextlib.suppress(sqlite3.Error):
                return max(len(self._pending), self.journal.count(older_than=JOURNAL_STALE))
        return len(self._pending)

    # -- writing -------------------------------------------------------------------------------------
    def ahead(self, records: Sequence[MessageRecord], *, settled: bool = False) -> dict[UUID, int]:
        """Journal ``records`` before the transport is settled (so a crash right after the settlement
        still leaves them to write); :meth:`settled` marks them once it is. Never raises: a journal
        that fails only narrows the guarantee."""
        if self.journal is None or not records:
            return {}
        try:
            return self.journal.add(records, settled=settled)
        except sqlite3.Error as exc:
            log.warning("history journal write failed (%s); continuing without it", exc)
            return {}

    def settled(self, rows: Sequence[int]) -> None:
        """The transport applied the settlements these journal rows were kept for."""
        if self.journal is not None and rows:
            try:
                self.journal.mark_settled(rows)
            except sqlite3.Error as exc:  # the row stays unmarked: written later, never wrongly
                log.warning("history journal update failed (%s)", exc)

    def drop(self, rows: Sequence[int]) -> None:
        """Forget journaled records whose settlement did not happen (refused, or given up)."""
        if self.journal is not None and rows:
            with contextlib.suppress(sqlite3.Error):
                self.journal.forget(rows)

    async def write(self, records: Sequence[MessageRecord], rows: dict[UUID, int] | None = None) -> bool:
        """Write ``records`` now; on failure keep them in the backlog (and journal) and retry until they
        land. True when they are in the store."""
        if not records:
            return True
        rows = dict(rows or {})
        if self._down:
            # the store has not answered since a write failed: do not make every caller wait for it
            self._queue(records, rows)
            return False
        try:
            await self._write_now(records)
        except Exception as exc:
            if not self._down:
                log.warning(
                    "history store unavailable (%s: %s): records are kept and retried until written",
                    type(exc).__name__,
                    exc,
                )
            self._down = True
            self._queue(records, rows)
            return False
        # Written. Older records of these messages still waiting in the backlog would be dropped by
        # the late write's rule anyway (a newer record is stored); forget them now. A waiting outcome
        # stays for a producer's record (the store did not let that replace an outcome either).
        for r in records:
            old = self._pending.get(r.message_id)
            if old is not None and supersedes(r, old[1]):
                del self._pending[r.message_id]
                self._strikes.pop(r.message_id, None)
                rows.setdefault(r.message_id, old[0])
        self.drop([seq for seq in rows.values() if seq])
        return True

    async def _write_now(self, records: Sequence[MessageRecord]) -> None:
        """A direct write. A record after which the message runs again (released at a stop, retried or
        deferred: :func:`may_be_overtaken`) can land after the record of that next run, which another host
        wrote first: such records are written by the late write's rule
        (:func:`~queueing_core.tracking.base.supersedes`), so the next run's record stays. The rest goes as
        it is, in one write: no run follows an outcome, and the stores keep outcomes from producers' records
        themselves. (Newer by ``updated_at``, as every late write: a host whose clock runs ahead by more
        than the time between the two settlements can still put its record over the next run's.)"""
        tracker = self.tracker
        if not isinstance(tracker, WritesLate):
            await tracker.upsert(records)
            return
        # a message's records go together, the way its last one goes (the store folds them as before)
        last = {r.message_id: r for r in records}
        checked = {mid for mid, r in last.items() if may_be_overtaken(r)}
        if len(checked) < len(last):
            await tracker.upsert([r for r in records if r.message_id not in checked])
        if checked:
            await tracker.upsert_newer([r for r in records if r.message_id in checked])

    def _queue(self, records: Sequence[MessageRecord], rows: dict[UUID, int]) -> None:
        missing = [r for r in records if r.message_id not in rows]
        if missing:  # records of what already happened (a settlement applied, a send accepted)
            rows.update(self.ahead(missing, settled=True))
        for r in records:
            self._keep(rows.get(r.message_id, 0), r)
        self._start()

    def _keep(self, seq: int, rec: MessageRecord) -> None:
        """Wait with ``rec`` (journal row ``seq``, 0: none) in place of a waiting record of its message
        that it :func:`supersedes`, else keep that one (with what only ``rec`` knew: its body, its raw
        text). The journal has one row per message: the latest row number given is the message's."""
        old = self._pending.pop(rec.message_id, None)
        if old is not None:
            keep, other = (rec, old[1]) if supersedes(rec, old[1]) else (old[1], rec)
            if keep.body is None or keep.raw is None or keep.copied_from is None:
                # (the original a copy left behind, too: its return is recognised by it)
                keep = keep.model_copy(
                    update={
                        "body": other.body if keep.body is None else keep.body,
                        "raw": other.raw if keep.raw is None else keep.raw,
                        "copied_from": other.copied_from if keep.copied_from is None else keep.copied_from,
                    }
                )
            rec, seq = keep, seq or old[0]
        self._pending[rec.message_id] = (seq, rec)

    def _start(self) -> None:
        self._wake.set()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(
                self._retry(), name="queueing-history-backlog"
            )

    async def _retry(self) -> None:
        delay = RETRY_FIRST
        while self._pending:
            try:
                await self._drain_once()
                delay = RETRY_FIRST
            except Exception as exc:
                log.debug("history backlog still not written (%s); next try in %.1fs", exc, delay)
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), delay)
                delay = min(RETRY_MAX, delay * 2)
        log.info("history backlog written")

    async def _drain_once(self) -> None:
        while self._pending:
            chunk = list(self._pending.items())[:DRAIN_CHUNK]
            try:
                await self._write_late([rec for _, (_, rec) in chunk])
            except Exception as exc:
                if not await self._isolate(chunk, exc):
                    raise
                continue
            self._down = False  # the store answers: new records are written directly again
            self._forget(chunk)

    async def _write_late(self, records: list[MessageRecord]) -> None:
        if isinstance(self.tracker, WritesLate):
            await self.tracker.upsert_newer(records)
        else:
            await self.tracker.upsert(records)

    def _forget(self, chunk: Sequence[tuple[UUID, tuple[int, MessageRecord]]]) -> None:
        done: list[int] = []
        for mid, (seq, rec) in chunk:
            # a newer record of the same message may have arrived during the write: it stays
            now = self._pending.get(mid)
            if now is not None and now[1] is rec:
                del self._pending[mid]
                self._strikes.pop(mid, None)
                if seq:
                    done.append(seq)
        self.drop(done)

    async def _isolate(self, chunk: Sequence[tuple[UUID, tuple[int, MessageRecord]]], exc: Exception) -> bool:
        """After a failed write of ``chunk``: one record the store can never take (text no store keeps,
        say) must not hold back every record behind it for ever. The records are written one by one;
        one refused before another lands (so the store answers) counts a strike, and after
        ``POISON_STRIKES`` it is dropped with an error naming it (history only: the transport is not
        affected). Refusals in a row end the round once they took half a second (a store that is down
        and slow to say so), or at twenty (one that says so fast); quick refusals of a few records the
        store cannot keep go on to the records behind them. Nothing is counted against a record no
        write of the store's vouched for. While a refused record waits, new records wait behind it too
        (so the next round, with them, can vouch). True when the round made progress."""
        if isinstance(exc, ProviderUnavailable):
            return False
        written: list[tuple[UUID, tuple[int, MessageRecord]]] = []
        refused: list[tuple[tuple[UUID, tuple[int, MessageRecord]], Exception]] = []
        vouched: list[tuple[tuple[UUID, tuple[int, MessageRecord]], Exception]] = []
        first_refusal = 0.0
        for item in chunk:
            try:
                await self._write_late([item[1][1]])
            except ProviderUnavailable:
                break
            except Exception as one:
                if not refused:
                    first_refusal = time.monotonic()
                refused.append((item, one))
                if len(refused) >= 20 or (len(refused) >= 3 and time.monotonic() - first_refusal > 0.5):
                    break
            else:
                written.append(item)
                vouched += refused  # refused although the store answers: counted
                refused = []
        if written:
            self._forget(written)
        dropped = []
        for (mid, (seq, rec)), error in vouched:
            self._strikes[mid] = strikes = self._strikes.get(mid, 0) + 1
            if strikes >= POISON_STRIKES and self._pending.get(mid, (0, None))[1] is rec:
                log.error(
                    "history record of message %s (%s) dropped: the store refused it %d times while it "
                    "took the others (%s: %s); the message itself is not affected",
                    mid,
                    rec.status,
                    strikes,
                    type(error).__name__,
                    error,
                )
                dropped.append((mid, (seq, rec)))
        self._forget(dropped)
        # refused records still waiting: new ones wait behind them, to vouch for the store next round
        self._down = len(refused) + len(vouched) > len(dropped)
        return bool(written or dropped)
