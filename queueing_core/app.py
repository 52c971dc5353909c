"""The app registry: message types, their one handler each, middleware and hooks.

Importing a module that registers handlers opens no connection: the registry only records. A
:class:`Router` lets several modules register on their own and be included into one app, like a
blueprint. A second handler for a type raises :class:`DuplicateHandlerError` naming both handlers.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import sys
import threading
import typing
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar, cast
from uuid import UUID

from pydantic import ValidationError

from .errors import DuplicateHandlerError, NotConfigured, RegistrationError
from .hooks import Hooks
from .messages import QueueMessage
from .naming import QueueNaming, Transport
from .options import QueueOptions
from .schedules import CatchUp, Schedule, ScheduleBook

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from .context import HandlerContext
    from .jobs import CancelReceipt
    from .middleware import EnqueueMiddleware, HandleMiddleware
    from .producer import EnqueueOptions, EnqueueReceipt, Producer
    from .runtime import Runtime
    from .tracking import MessageRecord

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True, slots=True)
class HandlerSpec:
    """A registered handler, normalized to ``await call(message, context)``."""

    message_type: type[QueueMessage]
    func: Callable[..., Any]
    origin: str
    is_async: bool
    wants_context: bool
    overrides: dict[str, Any] = field(default_factory=dict)

    def call(
        self, message: QueueMessage, context: HandlerContext, threads: HandlerThreads | None = None
    ) -> Awaitable[Any]:
        """The handler's run, to be awaited: an ``async def`` handler's own coroutine (no coroutine of
        ours wrapped around it, a frame less for every message), a plain ``def`` on a thread of
        ``threads`` (the pipeline passes its type's own; without, the loop's default executor)."""
        args = (message, context) if self.wants_context else (message,)
        if self.is_async:
            return cast(Awaitable[Any], self.func(*args))
        # Plain ``def`` handlers run on a worker thread so they never block the event loop.
        if threads is None:
            return asyncio.to_thread(self.func, *args)
        return threads.run(self.func, *args)


#: the threads a run of a plain ``def`` handler started, while the pipeline watches for them (set by
#: the pipeline around the handler's call): it holds the type's concurrency slot until they have ended
RUN_THREADS: contextvars.ContextVar[list[Future[Any]] | None] = contextvars.ContextVar(
    "queueing_run_threads", default=None
)
#: a handler thread idle this long ends: nothing closes a pipeline's threads, they go by themselves
THREAD_IDLE = 10.0


class HandlerThreads:
    """The threads one message type's plain ``def`` handlers run on: at most ``size`` (the type's
    ``max_concurrency``), started when needed, ended after :data:`THREAD_IDLE` seconds idle.

    Not the loop's default executor: a handler asyncio cannot stop (past its time limit, cancelled, the
    host stopping) held one of its few threads, and enough of them starved every other type's handlers,
    DNS lookups (``loop.getaddrinfo``) and the Functions host's settlement calls. Here a type's hung
    threads hold only its own slots. Daemon threads, as ``asyncio.to_thread``'s never stopped the host
    from ending either: a ``ThreadPoolExecutor`` joins its threads at exit, and a hung handler would
    hang the process's exit for ever (past the worker's shutdown deadline)."""

    def __init__(self, size: int, name: str) -> None:
        self.size = max(1, size)
        self.name = name
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._work: deque[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]] = deque()
        self._threads = 0
        self._idle = 0
        self._started = 0

    @property
    def threads(self) -> int:
        """Threads alive now, busy or idle."""
        return self._threads

    def run(self, func: Callable[..., Any], /, *args: Any) -> asyncio.Future[Any]:
        """``func(*args)`` on one of these threads with the caller's context variables (as
        ``asyncio.to_thread`` passes them), to be awaited; the run watching (:data:`RUN_THREADS`) is
        told of the thread, whose end the awaitable's cancellation does not wait for."""
        future = self.submit(contextvars.copy_context().run, func, *args)
        watching = RUN_THREADS.get()
        if watching is not None:
            watching.append(future)
        return asyncio.wrap_future(future)

    def submit(self, func: Callable[..., Any], /, *args: Any) -> Future[Any]:
        future: Future[Any] = Future()
        with self._lock:
            self._work.append((future, func, args))
            if self._idle >= len(self._work):
                self._ready.notify()  # an idle thread for each waiting call: one takes it
                return future
            if self._threads >= self.size:
                return future  # taken by the first thread that finishes
            self._threads += 1
            self._started += 1
            number = self._started
        try:
            threading.Thread(target=self._serve, name=f"queueing-{self.name}-{number}", daemon=True).start()
        except BaseException as exc:  # (the system refused another thread)
            with self._lock:
                self._threads -= 1
                if self._threads:
                    return future  # waits for one of the threads there are
                stranded = [waiting for waiting, _, _ in self._work if waiting is not future]
                self._work.clear()
            for waiting in stranded:  # no thread to take them: they fail now rather than wait for ever
                if waiting.set_running_or_notify_cancel():
                    waiting.set_exception(exc)
            raise
        return future

    def _serve(self) -> None:
        while True:
            with self._lock:
                while not self._work:
                    self._idle += 1
                    try:
                        told = self._ready.wait(THREAD_IDLE)
                    finally:
                        self._idle -= 1
                    # (a notify may reach a wait that has just timed out: the call it announced is taken)
                    if not told and not self._work:
                        self._threads -= 1
                        return
                future, func, args = self._work.popleft()
            if future.set_running_or_notify_cancel():  # False: cancelled while it waited, not run
                try:
                    result = func(*args)
                except BaseException as exc:
                    future.set_exception(exc)
                else:
                    future.set_result(result)
            del future, func, args  # (not kept alive while idle: the message, its context)


@dataclass(frozen=True, slots=True)
class Subscription:
    """One message type as the runtime sees it: its queue, options and (maybe) handler."""

    type_name: str
    queue: str  # logical name, before prefix/suffix and transport sanitizing
    message_type: type[QueueMessage]
    options: QueueOptions
    handler: HandlerSpec | None

    def physical_queue(self, naming: QueueNaming, transport: Transport) -> str:
        return naming.physical(self.queue, transport)


def _origin(func: Callable[..., Any]) -> str:
    """``module.qualname (file:line)`` from the code object: no source file is read (cold start)."""
    code = getattr(inspect.unwrap(func), "__code__", None)
    where = getattr(func, "__module__", "?")
    if code is not None:
        where = f"{code.co_filename}:{code.co_firstlineno}"
    return f"{getattr(func, '__module__', '?')}.{getattr(func, '__qualname__', repr(func))} ({where})"


def _infer_message_type(
    func: Callable[..., Any], localns: dict[str, Any] | None = None
) -> type[QueueMessage]:
    params = list(inspect.signature(func).parameters.values())
    if not params:
        raise RegistrationError(f"handler {func!r} takes no parameters; it must take the message")
    try:
        # localns: the decorating scope, for message classes defined inside a function with
        # ``from __future__ import annotations`` (their names are not module globals)
        hints = typing.get_type_hints(func, localns=localns)
    except Exception as exc:
        raise RegistrationError(f"cannot resolve the annotations of {func!r}: {exc}") from exc
    ann = hints.get(params[0].name)
    if isinstance(ann, type) and issubclass(ann, QueueMessage):
        return ann
    raise RegistrationError(
        f"cannot tell which message type {func.__qualname__} handles: annotate its first parameter "
        "with a QueueMessage subclass or pass the type to @handler(MessageType)"
    )


def _check_example(mtype: type[QueueMessage]) -> None:
    """The type's example must be a message of its own model: the ops API and the dashboard's
    Enqueue pages show it, and one that no longer validates (a field renamed since) would make them
    fail for every type. Refused here so that start-up and ``queueing check`` name it."""
    try:
        example = mtype.example()
        if example is not None:
            example.body()  # what the ops API shows: JSON, so no NaN either
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or '(body)'}: {e['msg']}"
            for e in exc.errors(include_url=False)[:5]
        )
        raise RegistrationError(
            f"the example of message type {mtype.type_name()!r} does not validate against "
            f"{mtype.__module__}.{mtype.__qualname__}: {problems}"
        ) from None
    except Exception as exc:  # an overridden example() that fails, or a body JSON cannot carry
        raise RegistrationError(
            f"the example of message type {mtype.type_name()!r} cannot be built: {type(exc).__name__}: {exc}"
        ) from exc


def _wants_context(func: Callable[..., Any]) -> bool:
    params = [
        p
        for p in inspect.signature(func).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    if len(params) > 2:
        raise RegistrationError(f"handler {func.__qualname__} must take (message) or (message, context)")
    return len(params) == 2


class Router:
    """Collects message types and handlers. Include routers into a :class:`QueueingApp`."""

    def __init__(self) -> None:
        self._types: dict[str, type[QueueMessage]] = {}
        self._handlers: dict[str, HandlerSpec] = {}
        self.schedules = ScheduleBook()
        #: bumped on every registration so caches of the resolved view know to refresh
        self.version = 0

    # -- registration ----------------------------------------------------------------------------
    def message(self, message_type: type[QueueMessage]) -> type[QueueMessage]:
        """Register a type that this app produces (it may be handled elsewhere, or later)."""
        self._add_type(message_type)
        return message_type

    def handler(
        self,
        message_type: type[QueueMessage] | None = None,
        *,
        max_concurrency: int | None = None,
        time_limit: timedelta | None = None,
    ) -> Callable[[F], F]:
        """Register the one handler of a message type: ``async def`` or plain ``def``.

        The handler takes ``(message)`` or ``(message, context)``. Without ``message_type`` the type
        comes from the first parameter's annotation.
        """

        def decorate(func: F) -> F:
            mtype = message_type or _infer_message_type(func, sys._getframe(1).f_locals)
            overrides: dict[str, Any] = {}
            if max_concurrency is not None:
                overrides["max_concurrency"] = max_concurrency
            if time_limit is not None:
                overrides["time_limit"] = time_limit
            target = func.func if isinstance(func, functools.partial) else func
            spec = HandlerSpec(
                message_type=mtype,
                func=func,
                origin=_origin(target),
                is_async=inspect.iscoroutinefunction(target),
                wants_context=_wants_context(func),
                overrides=overrides,
            )
            self._add_handler(spec)
            return func

        return decorate

    def include(self, other: Router) -> None:
        """Accumulate another router's registrations (duplicates fail here, naming both)."""
        for mtype in other._types.values():
            self._add_type(mtype)
        for spec in other._handlers.values():
            self._add_handler(spec)
        self.schedules.include(other.schedules)

    def schedule(
        self, cron: str, *, timezone: str = "UTC", name: str | None = None, catch_up: CatchUp = "once"
    ) -> Callable[[F], F]:
        """Run the decorated function at each tick of ``cron`` (five fields, in ``timezone``) and
        enqueue the message(s) it returns. It takes ``()`` or ``(tick)``, the tick's time in UTC.

        ``catch_up``: after every host was down past a tick, ``"once"`` runs the newest missed tick
        one time, ``"skip"`` runs none; either way there is never a burst of catch-up ticks.
        """

        def decorate(func: F) -> F:
            self.schedules.add_cron(
                func, cron, timezone=timezone, name=name, catch_up=catch_up, origin=_origin(func)
            )
            return func

        return decorate

    def every(
        self,
        interval: timedelta,
        message: QueueMessage | Callable[..., Any],
        *,
        name: str | None = None,
        catch_up: CatchUp = "once",
    ) -> Schedule:
        """Enqueue ``message`` (a copy with a new id each time, or what a function returns) every
        ``interval`` (whole seconds), on ticks aligned to the Unix epoch."""
        return self.schedules.add_every(interval, message, name=name, catch_up=catch_up)

    def produced(self, message_type: type[QueueMessage]) -> None:
        """Register a type met first as it is enqueued (so the ops API knows its queue). Its example is
        not checked here: a stale one would fail a valid enqueue (a handler's follow-up message then
        retried and dead-lettered); registering the type, or ``queueing check``, names it."""
        self._add_type(message_type, check_example=False)

    def _add_type(self, mtype: type[QueueMessage], *, check_example: bool = True) -> None:
        if not (isinstance(mtype, type) and issubclass(mtype, QueueMessage)):
            raise RegistrationError(f"{mtype!r} is not a QueueMessage subclass")
        name = mtype.type_name()
        known = self._types.get(name)
        if known is not None and known is not mtype:
            raise RegistrationError(
                f"two message classes use the type name {name!r}: "
                f"{known.__module__}.{known.__qualname__} and {mtype.__module__}.{mtype.__qualname__}"
            )
        queue = mtype.queue_options().name or name
        for other in self._types.values():
            if other is not mtype and (other.queue_options().name or other.type_name()) == queue:
                raise RegistrationError(
                    f"queue {queue!r} is declared by both {other.type_name()!r} and {name!r}: "
                    "each message type has its own queue"
                )
        if known is None:
            if check_example:
                _check_example(mtype)
            self._types[name] = mtype
            self.version += 1

    def _add_handler(self, spec: HandlerSpec) -> None:
        self._add_type(spec.message_type)
        name = spec.message_type.type_name()
        existing = self._handlers.get(name)
        if existing is not None and existing.func is not spec.func:
            raise DuplicateHandlerError(name, existing.origin, spec.origin)
        if existing is None:
            self._handlers[name] = spec
            self.version += 1

    # -- queries -----------------------------------------------------------------------------------
    @property
    def message_types(self) -> dict[str, type[QueueMessage]]:
        return dict(self._types)

    def handler_for(self, type_name: str) -> HandlerSpec | None:
        return self._handlers.get(type_name)


HandleMiddlewareT = TypeVar("HandleMiddlewareT", bound="HandleMiddleware")
EnqueueMiddlewareT = TypeVar("EnqueueMiddlewareT", bound="EnqueueMiddleware")


class QueueingApp(Router):
    """The app: registrations + defaults + naming + middleware + hooks. Pure configuration."""

    def __init__(
        self,
        name: str = "queueing",
        *,
        defaults: QueueOptions | None = None,
        naming: QueueNaming | None = None,
    ) -> None:
        super().__init__()
        self.name = name
        self.defaults = defaults or QueueOptions()
        self.naming = naming or QueueNaming()
        self.hooks = Hooks()
        self.handle_middleware: list[HandleMiddleware] = []
        self.enqueue_middleware: list[EnqueueMiddleware] = []
        self._producer: Producer | None = None
        self._runtime: Runtime | None = None
        self._subs: dict[str, Subscription | None] = {}
        self._subs_version = -1

    # -- middleware ------------------------------------------------------------------------------
    def use_handle_middleware(self, mw: HandleMiddlewareT) -> HandleMiddlewareT:
        """Add a handle middleware ``async def mw(ctx, call_next)``; the first added is outermost."""
        self.handle_middleware.append(mw)
        return mw

    def use_enqueue_middleware(self, mw: EnqueueMiddlewareT) -> EnqueueMiddlewareT:
        """Add an enqueue middleware ``async def mw(envelope, call_next)``; it may return a changed one."""
        self.enqueue_middleware.append(mw)
        return mw

    # -- resolved view ---------------------------------------------------------------------------
    def options_for(self, message_type: type[QueueMessage]) -> QueueOptions:
        sub = self.subscription(message_type.type_name())
        if sub is not None and sub.message_type is message_type:
            return sub.options
        return self._options(message_type)

    def _options(self, message_type: type[QueueMessage]) -> QueueOptions:
        opts = message_type.queue_options().merged_over(self.defaults)
        spec = self.handler_for(message_type.type_name())
        if spec is not None and spec.overrides:
            opts = QueueOptions.model_validate({**opts.model_dump(), **spec.overrides})
        return opts

    def subscription(self, type_name: str) -> Subscription | None:
        """The resolved view of one type, cached until a registration changes the app."""
        if self._subs_version != self.version:
            self._subs.clear()
            self._subs_version = self.version
        try:
            return self._subs[type_name]
        except KeyError:
            sub = self._subs[type_name] = self._resolve(type_name)
            return sub

    def _resolve(self, type_name: str) -> Subscription | None:
        mtype = self._types.get(type_name)
        if mtype is None:
            return None
        return Subscription(
            type_name=type_name,
            queue=mtype.queue_options().name or type_name,
            message_type=mtype,
            options=self._options(mtype),
            handler=self.handler_for(type_name),
        )

    def subscriptions(self) -> list[Subscription]:
        subs = (self.subscription(name) for name in sorted(self._types))
        return [s for s in subs if s is not None]

    def by_queue(self) -> dict[str, Subscription]:
        return {s.queue: s for s in self.subscriptions()}

    def __iter__(self) -> Iterator[Subscription]:
        return iter(self.subscriptions())

    # -- producing -------------------------------------------------------------------------------
    def bind(self, producer: Producer, runtime: Runtime | None = None) -> None:
        """Attach the producer (and runtime) the runtime built; ``enqueue`` and job control use them."""
        self._producer = producer
        if runtime is not None:
            self._runtime = runtime

    @property
    def runtime(self) -> Runtime:
        if self._runtime is None:
            self.producer  # noqa: B018 - raises the NotConfigured that explains what to do
            raise NotConfigured("this app's producer was bound without a runtime: use app.use(provider)")
        return self._runtime

    # -- job control -------------------------------------------------------------------------------
    async def cancel(self, tracking_id: UUID) -> CancelReceipt:
        """Cancel a message by its tracking id (or message id): one not yet running never runs, a
        running one sees ``ctx.cancelled`` and is cancelled after its type's ``cancel_grace``. A
        tracking id names the newest message carrying it, even where it is also the first message's
        own id (the default tracking id).
        Raises :class:`~queueing_core.errors.InvalidOperation` for a finished message."""
        from . import jobs

        return await jobs.cancel(self.runtime, tracking_id)

    async def status(self, tracking_id: UUID) -> MessageRecord:
        """The message's record now: status, attempt, progress, result, reason... By tracking id (the
        newest message carrying it, as :meth:`cancel` names it) or message id."""
        from . import jobs

        return await jobs.find(self.runtime, tracking_id)

    async def result(
        self, tracking_id: UUID, *, timeout: float | None = None, poll: float | None = None
    ) -> Any:
        """Wait until the message finishes and return its handler's result; raises
        :class:`~queueing_core.errors.JobCancelled` / :class:`~queueing_core.errors.JobFailed` when
        it ended without one and ``TimeoutError`` after ``timeout`` seconds. On PostgreSQL a NOTIFY
        wakes the wait as the message finishes; ``poll`` is the longest time between two looks at
        the history otherwise (0.2 s; 5 s where NOTIFY wakes it). ``tracking_id`` names the message
        as :meth:`cancel` does."""
        from . import jobs

        return await jobs.result(self.runtime, tracking_id, timeout=timeout, poll=poll)

    @property
    def producer(self) -> Producer:
        if self._producer is None:
            raise NotConfigured(
                "this app has no provider yet: call queueing_core.runtime.bootstrap(app) (reads "
                "QUEUEING_* settings) or app.use(provider) at start-up"
            )
        return self._producer

    def use(self, provider: Any, **kwargs: Any) -> Any:
        """Bind a provider (and optionally control store / tracker) and return the runtime."""
        from .runtime import Runtime  # the runtime wires hosts; registry modules stay I/O free

        return Runtime(self, provider, **kwargs)

    async def enqueue(self, message: QueueMessage, **options: Unpack[EnqueueOptions]) -> EnqueueReceipt:
        """Enqueue one message (see :class:`~queueing_core.producer.EnqueueOptions`)."""
        return await self.producer.enqueue(message, **options)

    async def enqueue_many(
        self, messages: typing.Iterable[QueueMessage], **options: Unpack[EnqueueOptions]
    ) -> list[EnqueueReceipt]:
        """Enqueue many messages in one batch."""
        return await self.producer.enqueue_many(messages, **options)

    async def enqueue_and_wait(
        self, message: QueueMessage, **options: Unpack[EnqueueOptions]
    ) -> EnqueueReceipt:
        """Enqueue and return once the transport has durably accepted the message."""
        return await self.producer.enqueue_and_wait(message, **options)


Handler = Callable[..., Awaitable[Any] | Any]
