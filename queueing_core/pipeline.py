"""The one decision pipeline: an envelope + control state + the handler's outcome -> a decision.

Order of the checks (each is a decision the transports only settle):

1. malformed envelope           -> DeadLetter(malformed-envelope), raw kept by the settler (so is one
   whose ``created_at`` is too late for its queue's expiration to be added: the producer refuses it)
2. expired                      -> Expire, never handed to a handler
3. not yet due (early delivery) -> Defer(Sleeping)
4. queue or type paused         -> Defer(Paused), no attempt counted
5. circuit open                 -> Defer(Paused) until the cooldown ends; then one probe goes
6. no handler / unknown type   -> Defer(WaitingForHandler), no attempt counted
7. body invalid for the model   -> DeadLetter(invalid-body)
8. attempts used up already     -> DeadLetter(max-attempts-exceeded), never run: earlier runs ended
   unsettled (their worker died, their lease lapsed), so a message that kills every worker ends
9. run the handler through the middleware, under the type's concurrency and time limits (a message
   that had to wait for a slot is looked at again first: expired (2), cancelled, paused (4) or its
   circuit no longer closed (5) meanwhile, it is decided as at the start and does not start);
   success -> Complete (or Defer(Sleeping) if it returned a time to run again);
   ``Retry(after=)`` / exception (any ``BaseException`` but the host's own cancellation) / time limit
   -> RetryAfter(backoff) until max attempts, then DeadLetter(max-attempts-exceeded);
   ``NonRetryableError`` -> DeadLetter(non-retryable);
   the host cancelling (shutdown) -> Release, no attempt counted; but a host whose time for the
   run is over (``cut_short``: a scheduled host's budget and its stop grace) counts a failed attempt.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import random
import traceback
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import datetime, timedelta
from time import perf_counter
from typing import Any
from uuid import UUID

from pydantic import TypeAdapter, ValidationError

from .app import RUN_THREADS, HandlerThreads, QueueingApp, Subscription
from .clock import Clock, utcnow
from .context import HandlerContext
from .control import CachedControlStore, circuit
from .control.base import CircuitState, ControlState, ControlStore
from .decisions import (
    LATEST,
    Complete,
    DeadLetter,
    DeadLetterReason,
    Decision,
    Defer,
    Expire,
    Release,
    RetryAfter,
)
from .envelope import Envelope
from .errors import NonRetryableError, Retry, first_line, text_of
from .hooks import Event, Observation
from .messages import BASE_FIELDS, MessageStatus, QueueMessage, read_body
from .middleware import HandleMiddleware, compose_handle, same_middleware
from .producer import identity_of
from .storable import cut_short_marker, storable
from .throughput import Throughput
from .transport import Delivery, RunBound

log = logging.getLogger("queueing.pipeline")
#: the least time before its bound a run is started with: a slot that comes free later defers the
#: message (no attempt counted) rather than start a run that is cut at once and counted
LEAST_RUN = 1.0
_HANDLER_LOG = logging.getLogger("queueing.handler")
_RESULT: TypeAdapter[Any] = TypeAdapter(Any)

MAX_ERROR_TEXT = 4000
#: largest result kept, as JSON text; a larger one is replaced by a marker (see :func:`fit_result`)
MAX_RESULT_CHARS = 64_000
#: how much of an oversized result the marker keeps
RESULT_PREVIEW_CHARS = 1000


def fit_result(value: Any, log_to: logging.LoggerAdapter[logging.Logger] | None = None) -> Any:
    """A handler's return value as it is kept: JSON-ready data, or, when its JSON is longer than
    :data:`MAX_RESULT_CHARS`, the marker ``{"_truncated": true, "_original_chars": N, "_preview": ...}``.
    The message still succeeds: the work is done, only its result is too large to keep."""
    if value is None:
        return None  # what most handlers return: nothing to dump
    try:
        data = _RESULT.dump_python(value, mode="json", fallback=repr)
    except Exception:
        # text JSON mode cannot encode (a lone surrogate) or bytes that are not UTF-8: the work is
        # done, so this must not raise (it would run the message again, for ever): cleaned, or kept
        # as its repr
        try:
            data = _RESULT.dump_python(value, mode="python", fallback=_safe_repr)
            data = _RESULT.dump_python(storable(data)[0], mode="json", fallback=_safe_repr)
        except Exception:
            data = storable(_safe_repr(value))[0]
        _unstorable_result(log_to)
    if data is None or isinstance(data, bool | int | float):
        return data
    text = json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    if "\\u0000" in text or not _utf8(text):  # (a raw lone surrogate stays in the text)
        data, replaced = storable(data)
        if replaced:
            _unstorable_result(log_to)
            text = json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    if len(text) <= MAX_RESULT_CHARS:
        return data
    if log_to is not None:
        log_to.warning("the handler's result is %d characters of JSON; only a preview is kept", len(text))
    return cut_short_marker(len(text), text[:RESULT_PREVIEW_CHARS])


def _safe_repr(value: Any) -> str:
    try:
        return repr(value)
    except Exception:  # a __repr__ that raises (an ORM object whose session closed): the type only
        return f"<{type(value).__name__} object whose repr failed>"


def _unstorable_result(log_to: logging.LoggerAdapter[logging.Logger] | None) -> None:
    if log_to is not None:
        log_to.warning(
            "the handler's result holds text no store keeps (U+0000 or a lone surrogate): "
            "replaced with U+FFFD"
        )


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


#: how early a delivery may come and be held until it is due rather than sent back to wait: a host
#: whose clock runs behind the one that forwarded it (a delayed store's dispatcher, another worker, the
#: database) sent it back, and that one, finding it due, forwarded it again at once: one message
#: bounced between them until the clocks agreed (a few seconds of skew, a hundred and more bounces)
EARLY_HOLD = timedelta(seconds=5)


async def _held(seconds: float, closing: asyncio.Event | None) -> bool:
    """Wait ``seconds`` for an early delivery to fall due; False if the host began closing meanwhile."""
    if closing is None:
        await asyncio.sleep(seconds)
        return True
    try:
        await asyncio.wait_for(closing.wait(), seconds)
    except TimeoutError:
        return True
    return False


#: the longest a retry waits: a retry a thousand years away is "never" as far as anyone can wait, and a
#: longer one ("no cap", ``timedelta.max``) made a due time no timestamp holds, which failed the
#: settlement (on the brokers, the worker's settler with it: nothing more was settled)
LONGEST_RETRY = timedelta(days=365_000)


def run_again(sub: Subscription, when: datetime, now: datetime) -> Defer:
    """A handler's success that asks to run again at ``when``: a new run with fresh attempts, which
    expires the type's expiration after ``when``, or after now for a time already past (never, if
    the type never expires). A message's own ``ttl=`` was its first run's."""
    later = Defer(
        when,  # (in UTC, a naive time taken as UTC: ``Defer`` sees to it)
        MessageStatus.SLEEPING,
        "handler asked to run again later",
        reset_attempts=True,
    )
    life = sub.options.expiration
    if life is None:
        return later
    try:
        expires_at = min(max(later.until, now) + life, LATEST)
    except OverflowError:
        expires_at = LATEST
    return dataclasses.replace(later, expires_at=expires_at)


def describe_error(exc: BaseException) -> str:
    """``Type: message`` followed by the innermost frames, bounded so it fits any store."""
    head = f"{type(exc).__name__}: {text_of(exc)}"
    frames = "".join(traceback.format_tb(exc.__traceback__)[-3:]) if exc.__traceback__ else ""
    text = f"{head}\n{frames}".rstrip()
    return text if len(text) <= MAX_ERROR_TEXT else text[: MAX_ERROR_TEXT - 3] + "..."


@dataclass(slots=True)
class _Run:
    """One running handler (or one waiting for its slot), so a cancellation by message id can reach it."""

    cancelled: asyncio.Event
    task: asyncio.Task[Any] | None
    grace: float
    requested: bool = False
    timer: asyncio.TimerHandle | None = None
    #: set by a cancel while the message waits for its slot, which ends the wait (see _wait_for_slot)
    woken: asyncio.Event | None = None


class _MessageLog(logging.LoggerAdapter[logging.Logger]):
    """``ctx.log``: the ``queueing.handler`` logger with the message's id, correlation id and queue
    as extra fields. The fields are made the first time they are read (a line logged), not for every
    message: most handlers never log through it."""

    def __init__(self, env: Envelope, queue: str) -> None:
        self._env, self._queue = env, queue
        self._fields: Mapping[str, object] | None = None
        super().__init__(_HANDLER_LOG)

    @property
    def extra(self) -> Mapping[str, object]:
        if self._fields is None:
            env = self._env
            self._fields = {
                "message_id": str(env.message_id),
                "correlation_id": env.correlation_id,
                "queue": self._queue,
            }
        return self._fields

    @extra.setter
    def extra(self, value: Mapping[str, object] | None) -> None:
        self._fields = value


#: (envelope, progress) -> None: stores a running handler's progress report
#: where a running handler's progress goes: given the delivery, so that a provider can fence the
#: write by the run's own lease (a run whose lease passed on must not write over the live run's)
ProgressSink = Callable[[Delivery, dict[str, Any]], Awaitable[None]]
#: (subscription, message) -> the last successfully processed version of its identity
PreviousLookup = Callable[[Subscription, QueueMessage], Awaitable[QueueMessage | None]]
#: the newer version that superseded an idempotent message, if one did
SupersedeCheck = Callable[[Subscription, QueueMessage], Awaitable[UUID | None]]
#: (subscription, message, its expiry, now) -> whether an idempotent message past its expiry expires
ExpiryCheck = Callable[[Subscription, QueueMessage, datetime, datetime], Awaitable[bool]]
#: asked when the host cancels a running handler, with the seconds it has run: why the host's time
#: for the run is over (a run cut then counts a failed attempt), or None for a stop that hands the
#: message back uncounted
CutShort = Callable[[float], str | None]


def read_message(sub: Subscription, env: Envelope) -> QueueMessage | DeadLetter:
    """The user's model of ``env``, or the dead letter of a body that does not read as one. Whatever
    a validator of the model raises is the body's fault, not only a ValidationError (pydantic wraps
    ValueError and AssertionError, and lets the rest through: the AttributeError of a validator that
    expected text), and so is an identity an idempotent type cannot key the body by; another run could
    only raise it again. (Raised on, such a body crash-looped: a worker handed it back without counting
    an attempt, for ever; a Functions host until the broker dead-lettered it with no reason.)"""
    try:
        message = decode_message(sub, env)
        if sub.options.idempotent:
            identity_of(sub.options, message)
    except ValidationError as exc:
        return DeadLetter(DeadLetterReason.INVALID_BODY, _validation_text(exc))
    except Exception as exc:
        return DeadLetter(
            DeadLetterReason.INVALID_BODY,
            f"body could not be read as {sub.type_name}: {first_line(exc)}",
        )
    return message


def decode_message(sub: Subscription, env: Envelope) -> QueueMessage:
    """Rebuild the user's model: body fields plus the base fields from the envelope, read as the JSON
    the body was written as (:func:`read_body`)."""
    body = env.body
    # a body without base fields (every body the kit writes) is copied whole, in C, instead of being
    # filtered key by key; one that carries them still has them dropped (the envelope's values win)
    data: dict[str, Any] = (
        dict(body)
        if BASE_FIELDS.isdisjoint(body)
        else {k: v for k, v in body.items() if k not in BASE_FIELDS}
    )
    data["message_id"] = env.message_id
    data["created_at"] = env.created_at
    data["correlation_id"] = env.correlation_id
    data["properties"] = env.headers
    return read_body(sub.message_type, data)


class Pipeline:
    def __init__(
        self,
        app: QueueingApp,
        control: ControlStore,
        *,
        clock: Clock = utcnow,
        pause_recheck: timedelta = timedelta(seconds=5),
        waiting_recheck: timedelta = timedelta(seconds=30),
        rand: Callable[[], float] = random.random,
        producer: Any = None,
    ) -> None:
        self.app = app
        self.control = control
        self.clock = clock
        self.pause_recheck = pause_recheck
        self.waiting_recheck = waiting_recheck
        self.rand = rand
        self.producer = producer
        #: the longest any run may go on here from its receive, whatever its type's time limit (the
        #: transport's consumer timeout, the host's function timeout): see :class:`RunBound`
        self.run_bound: RunBound | None = None
        self._chains_version = -1
        self._chains: dict[str, Callable[[HandlerContext], Awaitable[Any]]] = {}
        #: the app's handle middleware the chains were built with (a middleware added later rebuilds them)
        self._chains_middleware: list[HandleMiddleware] = []
        #: the control state without an await while the cache holds a fresh one (decided here, once)
        self._fresh_state = control.fresh if isinstance(control, CachedControlStore) else None
        self._limits: dict[str, asyncio.Semaphore] = {}
        #: each type's own threads for its plain ``def`` handlers, as many as its concurrency slots
        self._threads: dict[str, HandlerThreads] = {}
        #: handlers running now, by message id
        self.running: dict[UUID, _Run] = {}
        self.progress_sink: ProgressSink | None = None
        self.previous_lookup: PreviousLookup | None = None
        self.supersede_check: SupersedeCheck | None = None
        self.expiry_check: ExpiryCheck | None = None
        #: this process's handled messages and waiting times (``GET metrics``), the app's one tally
        self.tally = Throughput.of(app.hooks)

    # -- cancellation by message id --------------------------------------------------------------
    def cancel_running(self, message_id: UUID) -> bool:
        """Tell the running handler of ``message_id`` to stop (``ctx.cancelled``) and cancel its task
        after the type's ``cancel_grace``; its outcome is recorded Cancelled. False: not running here."""
        run = self.running.get(message_id)
        if run is None or run.requested:
            return run is not None
        run.requested = True
        run.cancelled.set()
        if run.woken is not None:
            run.woken.set()
        if run.task is not None:
            run.timer = asyncio.get_running_loop().call_later(run.grace, run.task.cancel)
        return True

    def stop_running(self) -> None:
        """The host is going away: every running handler sees ``ctx.cancelled``."""
        for run in self.running.values():
            run.cancelled.set()

    # -- resolved registry, cached until the app's registrations change -------------------------
    def subscription(self, type_name: str) -> Subscription | None:
        if self._chains_version != self.app.version:  # a new registration: rebuild the chains
            self._chains.clear()
            self._chains_version = self.app.version
        return self.app.subscription(type_name)

    def limiter(self, sub: Subscription) -> asyncio.Semaphore:
        sem = self._limits.get(sub.type_name)
        if sem is None:
            sem = self._limits[sub.type_name] = asyncio.Semaphore(sub.options.max_concurrency)
        return sem

    def threads(self, sub: Subscription) -> HandlerThreads:
        """The type's threads for a plain ``def`` handler: as many as its concurrency slots, as a
        thread keeps its slot until it ends (see :meth:`_run`), so a call never waits for one."""
        pool = self._threads.get(sub.type_name)
        if pool is None:
            pool = self._threads[sub.type_name] = HandlerThreads(sub.options.max_concurrency, sub.type_name)
        return pool

    def _chain(self, sub: Subscription) -> Callable[[HandlerContext], Awaitable[Any]]:
        middleware = self.app.handle_middleware
        # asked for every message: with no middleware then and now (the usual case) the chains still fit,
        # without the element-wise comparison
        built = self._chains_middleware
        if (middleware or built) and not same_middleware(built, middleware):
            self._chains.clear()
            self._chains_middleware = list(middleware)
        chain = self._chains.get(sub.type_name)
        if chain is None:
            spec = sub.handler
            assert spec is not None
            threads = None if spec.is_async else self.threads(sub)

            # a plain function handing on the handler's awaitable: awaited by the pipeline (or the
            # innermost middleware) directly, without a coroutine of its own per message
            def terminal(ctx: HandlerContext) -> Awaitable[Any]:
                return spec.call(ctx.message, ctx, threads)

            chain = self._chains[sub.type_name] = compose_handle(self._chains_middleware, terminal)
        return chain

    # -- the decision ------------------------------------------------------------------------------
    async def process(
        self,
        delivery: Delivery,
        *,
        stopping: asyncio.Event | None = None,
        closing: asyncio.Event | None = None,
        slot_wait: float | None = None,
        cut_short: CutShort | None = None,
    ) -> Decision:
        """Decide what becomes of ``delivery``. ``stopping`` is what the handler sees as
        ``ctx.cancelled``; once ``closing`` is set (the host is shutting down) no handler starts:
        a message still waiting for a concurrency slot is handed back untouched. ``slot_wait``: the
        longest a message waits for a concurrency slot of its type before it is deferred, no attempt
        counted (a host pushing messages in, whose invocations a timeout ends, the wait included).
        ``cut_short``: asked when the host cancels the running handler (see :data:`CutShort`)."""
        now = self.clock()
        if delivery.malformed is not None or delivery.envelope is None:
            reason = delivery.malformed.reason if delivery.malformed else "no envelope"
            return await self._emit_final(delivery, DeadLetter(DeadLetterReason.MALFORMED_ENVELOPE, reason))
        env = delivery.envelope
        sub = self.subscription(env.type)

        expires_at = env.expires_at
        if expires_at is None and sub is not None and sub.options.expiration is not None:
            try:
                expires_at = env.created_at + sub.options.expiration
            except OverflowError:
                # past the year 9999: the producer refuses such a message, and raised here it failed
                # every delivery (a worker handed it back for ever, a Functions host unrecorded)
                too_late = (
                    f"created_at {env.created_at.isoformat()} is too late to add the queue's expiration "
                    f"({sub.options.expiration}) to"
                )
                return await self._emit_final(
                    delivery, DeadLetter(DeadLetterReason.MALFORMED_ENVELOPE, too_late)
                )
        if expires_at is not None and await self._expired(sub, env, expires_at, now):
            return await self._emit_final(delivery, Expire(expires_at))

        if env.not_before is not None and env.not_before > now:
            early = (env.not_before - now).total_seconds()
            if early > EARLY_HOLD.total_seconds() or not await _held(early, closing):
                return await self._emit_final(
                    delivery, Defer(env.not_before, MessageStatus.SLEEPING, "not due yet")
                )
            now = self.clock()

        if sub is None:
            return await self._emit_final(
                delivery, self._waiting(now, f"no message type {env.type!r} is registered")
            )

        state = await self._state()
        if await self._cancelled(state, env):
            return await self._emit_final(delivery, Complete(None, cancelled=True))
        paused = self._paused(state, sub, now)
        if paused is not None:
            return await self._emit_final(delivery, paused)

        if sub.handler is None:
            return await self._emit_final(
                delivery, self._waiting(now, f"no handler for {sub.type_name!r} yet")
            )

        message = read_message(sub, env)
        if isinstance(message, DeadLetter):
            return await self._emit_final(delivery, message)

        if sub.options.idempotent and self.supersede_check is not None:
            newer = await self.supersede_check(sub, message)
            if newer is not None:  # a newer version was enqueued before this one ran: it runs instead
                return await self._emit_final(
                    delivery, Complete(None, cancelled=True, reason=f"superseded by {newer}")
                )
        if delivery.attempt > sub.options.max_attempts and delivery.runs_counted:
            # the attempts were used up by deliveries that never settled (a worker that died or hung
            # past its lease counts one, as does one the host could not process); another run could
            # only end the same way, and a message that kills every worker would never end
            return await self._emit_final(
                delivery,
                DeadLetter(
                    DeadLetterReason.MAX_ATTEMPTS,
                    f"delivered {delivery.attempt - 1} times for {sub.options.max_attempts} attempts; the "
                    "last deliveries ended without a settlement (the worker stopped, its lease lapsed, or "
                    "the host could not process it): not run again",
                ),
            )
        # after the superseded check: a message settled without running must not hold a circuit probe
        cb = sub.options.circuit_breaker
        probing = False
        if cb is not None:
            cstate = state.circuit(sub.type_name)
            adm = circuit.admission(cstate, now)
            if adm is circuit.Admission.PROBE:
                probing = await self.control.acquire_probe(sub.type_name, cb, now)
            if adm is circuit.Admission.HOLD or (adm is circuit.Admission.PROBE and not probing):
                return await self._emit_final(delivery, self._circuit_held(sub, cstate, now))

        decision = await self._run(
            delivery,
            sub,
            env,
            message,
            stopping,
            closing,
            slot_wait,
            now,
            cut_short,
            expires_at=expires_at,
            probing=probing,
        )
        # the probe named by the time the store acquired it until
        probe = now + cb.probe_timeout if probing and cb is not None else None
        if cb is not None and not _unrun(decision):
            await self._track_circuit(sub, decision, state.circuit(sub.type_name), probe, cb)
        elif probe is not None:
            # a probe handed back unrun (the host stopping) says nothing of the downstream: the next
            # message may probe at once, not after probe_timeout (which is for a probe whose host died)
            try:
                await self.control.release_probe(sub.type_name, probe, self.clock())
            except Exception:
                log.exception("could not hand back the circuit probe of %s", sub.type_name)
        return decision

    async def _state(self) -> ControlState:
        """The control state: the cache's without an await while it holds a fresh one."""
        state = self._fresh_state() if self._fresh_state is not None else None
        return state if state is not None else await self.control.state()

    async def _expired(
        self, sub: Subscription | None, env: Envelope, expires_at: datetime, now: datetime
    ) -> bool:
        """Past its expiry, and not kept alive by an enqueue discarded against it (:meth:`_lives_on`)."""
        return now >= expires_at and not await self._lives_on(sub, env, expires_at, now)

    async def _cancelled(self, state: ControlState, env: Envelope) -> bool:
        """An operator asked to cancel the message (and still does: :meth:`_still_cancelled`)."""
        # (a UUID hashes in Python: the usual empty set is not asked)
        return (
            bool(state.cancelled) and env.message_id in state.cancelled and await self._still_cancelled(env)
        )

    def _paused(self, state: ControlState, sub: Subscription, now: datetime) -> Defer | None:
        """The deferral of a message whose queue or type is paused, None if neither is."""
        if not state.is_paused(sub.queue, sub.type_name):
            return None
        what = f"queue {sub.queue!r}" if sub.queue in state.paused_queues else f"type {sub.type_name!r}"
        return Defer(now + self.pause_recheck, MessageStatus.PAUSED, f"{what} is paused")

    def _circuit_held(self, sub: Subscription, cstate: CircuitState, now: datetime) -> Defer:
        """The deferral of a message whose type's circuit holds it (open, or a probe out)."""
        # look again soon rather than at the cooldown's end, so an operator's reset is quick
        until = min(circuit.hold_until(cstate, now), now + self.pause_recheck)
        if until <= now:
            until = now + self.pause_recheck
        return Defer(until, MessageStatus.PAUSED, f"circuit for {sub.type_name!r} is open")

    async def _still_cancelled(self, env: Envelope) -> bool:
        """A request the cached state shows, read again from the store before the message is settled
        without running: another host may have withdrawn it within the cache's time (an operator's
        retry, a replacing version of an idempotent message), and its new run must not be cancelled."""
        if not isinstance(self.control, CachedControlStore):
            return True  # (the state was read from the store itself)
        # the store itself, leaving the cache as it is (a burst of cancelled messages would drop it
        # for every other reader each time)
        return env.message_id in (await self.control.inner.state()).cancelled

    async def _previous(self, sub: Subscription, message: QueueMessage) -> QueueMessage | None:
        """``ctx.previous``, or None when it cannot be read: the handler runs either way, and an
        error here must not escape between taking the concurrency slot and holding it."""
        assert self.previous_lookup is not None
        try:
            return await self.previous_lookup(sub, message)
        except Exception as exc:
            log.warning(
                "could not read the previous version of %s (%s): ctx.previous is None",
                message.message_id,
                str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
            )
            return None

    async def _lives_on(
        self, sub: Subscription | None, env: Envelope, expires_at: datetime, now: datetime
    ) -> bool:
        """An idempotent message past its expiry whose life an enqueue discarded against it made longer
        (the transports that keep identity documents; on SQL the discard moves the row's expiry)."""
        if sub is None or not sub.options.idempotent or self.expiry_check is None:
            return False
        message = read_message(sub, env)
        if isinstance(message, DeadLetter):
            return False  # (it expires: a body that does not read could not run anyway)
        return not await self.expiry_check(sub, message, expires_at, now)

    def _waiting(self, now: datetime, reason: str) -> Defer:
        return Defer(now + self.waiting_recheck, MessageStatus.WAITING_FOR_HANDLER, reason)

    async def _run(
        self,
        delivery: Delivery,
        sub: Subscription,
        env: Envelope,
        message: QueueMessage,
        stopping: asyncio.Event | None,
        closing: asyncio.Event | None,
        slot_wait: float | None,
        now: datetime,
        cut_short: CutShort | None = None,
        *,
        expires_at: datetime | None = None,
        probing: bool = False,
    ) -> Decision:
        # (its task is set once it starts: see _wait_for_slot)
        run = _Run(asyncio.Event(), None, sub.options.cancel_grace.total_seconds())
        if stopping is not None and stopping.is_set():
            run.cancelled.set()
        sink = self.progress_sink
        ctx = HandlerContext(
            envelope=env,
            attempt=delivery.attempt,
            subscription=sub,
            message=message,
            cancelled=run.cancelled,
            store_progress=(lambda progress: sink(delivery, progress)) if sink is not None else None,
            log=_MessageLog(env, sub.queue),
            producer=self.producer,
        )
        self.tally.began(sub.queue, env, now)
        hooks = self.app.hooks
        if hooks.wants(Event.BEGAN):
            pending = hooks.notify(Observation(Event.BEGAN, env, sub.queue, delivery.attempt))
            if pending is not None:  # (a coroutine only for a hook that returned an awaitable)
                await pending
        chain = self._chain(sub)  # before the slot: nothing that may raise runs between it and the try
        # the run's bound counts from the receive, the wait for a slot included: a message waiting
        # past it is taken back by the transport (RabbitMQ closes the channel, every message on it
        # delivered again) or the host (the Functions worker process ended) all the same (review)
        bound = self.run_bound
        deadline = delivery.received_at + bound.limit if bound is not None else None
        wait = slot_wait
        if deadline is not None:
            left = max(0.0, (deadline - utcnow()).total_seconds() - LEAST_RUN)
            wait = left if wait is None else min(wait, left)
        limiter = self.limiter(sub)
        if not limiter.locked() and (closing is None or not closing.is_set()):
            # a slot is free: taken at once (what _take_slot does first). The checks above were made
            # just now: not made again (no second read of the control state on this, the usual, path)
            await limiter.acquire()
        else:
            instead = await self._wait_for_slot(sub, env, run, limiter, closing, wait, expires_at, probing)
            if instead is not None:
                return await self._emit_final(delivery, instead)
        run.task = asyncio.current_task()
        if bound is not None and deadline is not None and (deadline - utcnow()).total_seconds() < LEAST_RUN:
            limiter.release()  # (the slot came free too late to start a run before the bound)
            late = f"held too long to start a run before its bound: {bound.because}"
            return await self._emit_final(
                delivery, Defer(self.clock() + self.waiting_recheck, MessageStatus.PENDING, late)
            )
        if sub.options.idempotent and self.previous_lookup is not None:
            try:
                ctx.previous = await self._previous(sub, message)
            except BaseException:  # a cancelled lookup (errors are caught inside) must not keep the slot
                limiter.release()
                raise
        limit, bound = self._time_limit(sub, deadline)
        started = perf_counter()
        error: BaseException | None = None
        self.running[env.message_id] = run
        result: Any = None
        # a plain def handler's threads, told to the pipeline as they start (app.HandlerThreads.run)
        spawned: list[Future[Any]] | None = None
        if sub.handler is not None and not sub.handler.is_async:
            spawned = []
            watching = RUN_THREADS.set(spawned)
        try:  # the slot taken above is given back on the way out
            try:
                if limit is None:
                    result = await chain(ctx)  # no time limit: no timeout scope (it could never expire)
                else:
                    async with asyncio.timeout(limit.total_seconds()) as scope:
                        result = await chain(ctx)
            except asyncio.CancelledError as exc:
                task = asyncio.current_task()
                if task is None or not task.cancelling():
                    # nobody cancelled this run: the handler's own error (it awaited something another
                    # task cancelled). Handed back unrun as a shutdown is, it was delivered again for
                    # ever, never using an attempt: it fails the attempt as any other error does
                    error = exc
                    decision: Decision = self._failure(
                        sub,
                        delivery.attempt,
                        "CancelledError raised inside the handler (not a cancellation)",
                        None,
                    )
                else:
                    # our own cancellation of a cancelled message (after its grace), or the host shutting
                    # down and giving up waiting: the latter hands the message back untouched, unless
                    # the host's time for the run is over (a scheduled host's budget and stop grace):
                    # handed back uncounted, a run longer than that was cut and started again on every
                    # tick, for ever, never failing and never dead-lettered
                    task.uncancel()
                    why = cut_short(perf_counter() - started) if cut_short is not None else None
                    if why is None:
                        decision = Release("host shutting down")
                    else:
                        error = exc
                        decision = self._failure(sub, delivery.attempt, why, None)
            except Retry as exc:
                error = exc
                decision = self._failure(sub, delivery.attempt, f"Retry: {exc.reason}", exc.after)
            except NonRetryableError as exc:
                error = exc
                decision = DeadLetter(DeadLetterReason.NON_RETRYABLE, describe_error(exc))
            except TimeoutError as exc:
                error = exc
                if limit is not None and scope.expired():
                    # a plain def handler's thread is not stopped by the timeout (asyncio cannot stop a
                    # thread): it is told, as for a cancel, so it can stop before its retry runs
                    run.cancelled.set()
                    if bound is None:
                        text = f"execution time limit of {limit.total_seconds():g}s exceeded"
                    else:
                        text = f"cut after {perf_counter() - started:.0f} s: {bound.because}"
                else:
                    text = describe_error(exc)
                decision = self._failure(sub, delivery.attempt, text, None)
            except BaseException as exc:  # (asyncio.CancelledError is dealt with above)
                if not isinstance(exc, Exception):
                    # SystemExit (sys.exit, argparse), KeyboardInterrupt, or a library's own (gevent's
                    # Timeout, GreenletExit, pytest's Failed): a failed attempt like any error. Let
                    # through, it left the message leased and renewed for ever, or ended the process
                    # without a stop (every other message's lease then lapsed, counting an attempt)
                    log.error(
                        "the handler of message %s raised %s, which is not an Exception: a failed "
                        "attempt like any error; the host goes on",
                        env.message_id,
                        type(exc).__name__,
                        extra={"message_id": str(env.message_id), "correlation_id": env.correlation_id},
                    )
                error = exc
                decision = self._failure(sub, delivery.attempt, describe_error(exc), None)
            else:
                if isinstance(result, datetime):
                    decision = run_again(sub, result, self.clock())
                else:
                    decision = Complete(fit_result(result, ctx.log))
            finally:
                self._forget(env.message_id, run)
                if run.timer is not None:
                    run.timer.cancel()
                if spawned is not None:
                    RUN_THREADS.reset(watching)
        finally:
            if spawned:
                _release_when_ended(limiter, spawned)
            else:
                limiter.release()
        if run.requested:
            # cancelled while it ran: whatever the handler did after that, the message is not retried
            decision = Complete(decision.result if isinstance(decision, Complete) else None, cancelled=True)
        if ctx.progress is not None:  # a report not stored yet is stored now
            await ctx.flush_progress()
        pending = self._emit(delivery, decision, error, started)
        if pending is not None:
            await pending
        return decision

    async def _wait_for_slot(
        self,
        sub: Subscription,
        env: Envelope,
        run: _Run,
        limiter: asyncio.Semaphore,
        closing: asyncio.Event | None,
        wait: float | None,
        expires_at: datetime | None,
        probing: bool,
    ) -> Decision | None:
        """Wait for a concurrency slot of ``sub``'s type: None once the message holds one and may start;
        otherwise what becomes of it, no slot held: handed back if the host began closing, deferred if
        none came within ``wait`` seconds, or what changed while it waited (:meth:`_changed_meanwhile`).

        Meanwhile it is in :attr:`running`, so that a cancel reaches it, and has no task to cancel: a
        cancel's timer ending the wait would hand the message back as a host's stop does."""
        # (not over a copy of the same id running here already, a duplicate delivery: a cancel must
        # reach that one; this one reads the cancellation requests again once it has its slot)
        self.running.setdefault(env.message_id, run)
        # a cancel ends the wait (it waited a whole run, or a Functions host's minute, told Cancelled)
        run.woken = asyncio.Event()
        try:
            if not await _take_slot(limiter, closing, wait, run.woken):
                if closing is not None and closing.is_set():
                    return Release("host shutting down before the handler started")
                if run.requested:
                    return Complete(None, cancelled=True)
                # (a Functions host: waited on, the invocation ran into the host's timeout with the
                # handler still to run, and the restart that ends a Python worker's timed-out invocation
                # ended every other one of the process too; review)
                return self._busy(sub, wait)
            try:
                changed = await self._changed_meanwhile(sub, env, run, expires_at, probing)
            except BaseException:  # (a control store that failed, or a stop, must not keep the slot)
                limiter.release()
                raise
            if changed is not None:
                limiter.release()
            return changed
        finally:
            self._forget(env.message_id, run)

    async def _changed_meanwhile(
        self, sub: Subscription, env: Envelope, run: _Run, expires_at: datetime | None, probing: bool
    ) -> Decision | None:
        """The checks :meth:`process` made at the start, made again for a message that waited for its
        slot (a handler's whole run, a Functions host's minute): one paused, expired or cancelled
        meanwhile must not start (its cancel said Cancelled, then it ran and was recorded Succeeded).
        None: it starts. The control state is the cache's, as at the start."""
        now = self.clock()
        if expires_at is not None and await self._expired(sub, env, expires_at, now):
            return Expire(expires_at)
        state = await self._state()
        if run.requested or await self._cancelled(state, env):
            return Complete(None, cancelled=True)
        paused = self._paused(state, sub, now)
        if paused is not None:
            return paused
        cstate = state.circuit(sub.type_name)
        # (a message holding the probe runs: its probe is what keeps the circuit half-open)
        if sub.options.circuit_breaker is not None and not probing and cstate.state != "closed":
            return self._circuit_held(sub, cstate, now)
        return None

    def _forget(self, message_id: UUID, run: _Run) -> None:
        """``run`` is no longer in :attr:`running`. One lookup (a UUID hashes in Python); another run of
        the same id (a duplicate delivery beside this one) that took the entry meanwhile keeps it."""
        other = self.running.pop(message_id, run)
        if other is not run:
            self.running[message_id] = other

    def _time_limit(
        self, sub: Subscription, deadline: datetime | None
    ) -> tuple[timedelta | None, RunBound | None]:
        """The run's time limit, and the bound that set it when its ``deadline`` (the receive plus the
        bound, on the wall clock: a message may have waited in a consumer's buffer, its broker's timer
        running) is nearer than the type's own limit."""
        limit = sub.options.time_limit
        if deadline is None or self.run_bound is None:
            return limit, None
        left = max(deadline - utcnow(), timedelta(0))
        if limit is not None and limit <= left:
            return limit, None
        return left, self.run_bound

    def _busy(self, sub: Subscription, waited: float | None) -> Defer:
        """No slot of ``sub``'s type came free within ``waited`` seconds (or too late to start a run
        before its bound): deferred, no attempt counted."""
        busy = f"no free slot of {sub.type_name!r} (max_concurrency {sub.options.max_concurrency})"
        return Defer(
            self.clock() + self.waiting_recheck, MessageStatus.PENDING, f"{busy} within {waited or 0:g} s"
        )

    def _failure(self, sub: Subscription, attempt: int, error: str, after: timedelta | None) -> Decision:
        if attempt >= sub.options.max_attempts:
            return DeadLetter(
                DeadLetterReason.MAX_ATTEMPTS,
                f"attempt {attempt} of {sub.options.max_attempts} failed; last error: {error}",
            )
        delay = after if after is not None else sub.options.retry.delay(attempt, self.rand)
        # a negative delay (a handler's, or a policy's negative cap) retries at once: one too far back
        # made a due time no timestamp holds, which failed the settlement
        return RetryAfter(max(timedelta(0), min(delay, LONGEST_RETRY)), error)

    async def _track_circuit(
        self, sub: Subscription, decision: Decision, before: Any, probe: datetime | None, cb: Any
    ) -> None:
        # transient failures trip the breaker; a handler's success resets the count (and a probe's
        # closes the circuit)
        failed = isinstance(decision, RetryAfter) or (
            isinstance(decision, DeadLetter) and decision.reason is DeadLetterReason.MAX_ATTEMPTS
        )
        succeeded = (isinstance(decision, Complete) and not decision.cancelled) or (
            isinstance(decision, Defer) and decision.reset_attempts  # (a success that runs again later)
        )
        try:
            if failed:
                # a half-open circuit is reopened only by the probe that is out (circuit.on_failure)
                await self.control.record_failure(sub.type_name, cb, self.clock(), probe)
            elif not succeeded:
                # neither: a deliberate refusal (NonRetryableError) or a run cancelled by an operator
                # says nothing of the downstream's health. The count stays as it was (a refusal between
                # two failures does not break their run), and a probe's question is still open: it is
                # handed back, so the next message probes at once (the circuit stays half-open)
                if probe is not None:
                    await self.control.release_probe(sub.type_name, probe, self.clock())
            elif probe is not None:
                # closes the circuit only while this probe is still the one out
                await self.control.record_success(sub.type_name, probe)
            elif before.consecutive_failures:
                # resets the count only while the circuit is still closed (it may have opened while
                # this run ran)
                await self.control.record_success(sub.type_name)
            else:
                # failures counted while this run ran (the state read at its start showed none): the
                # success resets them too. ``state`` is the cached read (control_ttl), not a round trip
                # per success
                # a closed circuit's count only: an open or half-open one is the cooldown's and the
                # probe's to close (this run started before it opened)
                current = (await self.control.state()).circuit(sub.type_name)
                if current.state == "closed" and current.consecutive_failures:
                    await self.control.record_success(sub.type_name)
        except Exception:
            # the breaker is advisory: a control-store outage must not fail the message
            log.exception("could not record the circuit outcome for %s", sub.type_name)

    async def _emit_final(self, delivery: Delivery, decision: Decision) -> Decision:
        pending = self._emit(delivery, decision, None, None)
        if pending is not None:
            await pending
        return decision

    def _emit(
        self, delivery: Delivery, decision: Decision, error: BaseException | None, started: float | None
    ) -> Awaitable[None] | None:
        """Tell the hooks of ``decision`` (the handler's run took from ``started`` until now); what is
        left to await, if a hook returned an awaitable (see :meth:`Hooks.notify`)."""
        event = _EVENT_OF[type(decision)]
        self.tally.count(delivery.queue, event)
        hooks = self.app.hooks
        if not hooks.wants(event):
            return None
        duration = None if started is None else timedelta(seconds=perf_counter() - started)
        return hooks.notify(
            Observation(event, delivery.envelope, delivery.queue, delivery.attempt, decision, error, duration)
        )


def _release_when_ended(limiter: asyncio.Semaphore, threads: list[Future[Any]]) -> None:
    """Give the slot back once every thread of the run has ended. asyncio cannot stop a thread: one
    past its time limit, cancelled or cut short by the host runs on after the run is decided, and
    given back at once, its slot let another run of the type start beside it (``max_concurrency=1``
    and ordered types ran one message on several threads at once) and the hung threads piled up."""
    running = [t for t in threads if not t.done()]
    if not running:
        limiter.release()
        return
    loop = asyncio.get_running_loop()
    left = len(running)

    def one_ended() -> None:
        nonlocal left
        left -= 1
        if not left:
            limiter.release()

    def ended(_: Future[Any]) -> None:  # (on the thread, or here if it ended meanwhile)
        try:
            loop.call_soon_threadsafe(one_ended)
        except RuntimeError:
            # the loop is closed: nothing waits on it, and the slot is given back here (a pipeline
            # used again on a new loop found its type's slot taken for good)
            one_ended()

    for thread in running:
        thread.add_done_callback(ended)


def _unrun(decision: Decision) -> bool:
    """The handler did not run: handed back (the host stopping) or deferred for want of a free slot;
    says nothing of the downstream's health."""
    return isinstance(decision, Release) or (
        isinstance(decision, Defer) and decision.status is MessageStatus.PENDING
    )


async def _take_slot(
    limiter: asyncio.Semaphore,
    closing: asyncio.Event | None,
    within: float | None = None,
    cancelled: asyncio.Event | None = None,
) -> bool:
    """Wait for a concurrency slot; False (and no slot held) if ``closing`` or ``cancelled`` is set
    first, or when ``within`` seconds have passed without one."""
    ends = [event for event in (closing, cancelled) if event is not None]
    if any(event.is_set() for event in ends):
        return False
    if not limiter.locked() or (not ends and within is None):
        await limiter.acquire()  # free (or nothing to race): taken without waiting on two things
        return True
    acquiring = asyncio.ensure_future(limiter.acquire())
    ending = [asyncio.ensure_future(event.wait()) for event in ends]
    unwinding = True
    try:
        await asyncio.wait({acquiring, *ending}, timeout=within, return_when=asyncio.FIRST_COMPLETED)
        unwinding = False
    finally:
        for waiting in ending:
            waiting.cancel()
        if not acquiring.done():
            acquiring.cancel()  # the semaphore passes a slot granted meanwhile on to the next waiter
            with contextlib.suppress(asyncio.CancelledError):
                await acquiring
        got = acquiring.done() and not acquiring.cancelled()
        if got and (unwinding or any(event.is_set() for event in ends)):
            limiter.release()  # an end won the race (or we were cancelled): start nothing
            got = False
    return got


_EVENT_OF: dict[type, Event] = {
    Complete: Event.SUCCEEDED,
    RetryAfter: Event.FAILED,
    DeadLetter: Event.DEAD_LETTERED,
    Expire: Event.EXPIRED,
    Defer: Event.DEFERRED,
    Release: Event.RELEASED,
}


def _validation_text(exc: ValidationError) -> str:
    parts = [f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()[:10]]
    return "body does not match the message model: " + "; ".join(parts)
