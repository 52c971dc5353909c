"""Handle and enqueue middleware: an onion of ``call_next``.

Handle middleware: ``async def mw(ctx: HandlerContext, call_next) -> Any`` wraps the handler; it may
act before and after, transform the result, or raise. Enqueue middleware:
``async def mw(envelope, call_next) -> Envelope`` may stamp headers or refuse by raising; it returns
the envelope that will be sent (usually ``await call_next(changed_envelope)``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .context import HandlerContext
    from .envelope import Envelope

CallNext = Callable[[], Awaitable[Any]]
HandleMiddleware = Callable[["HandlerContext", CallNext], Awaitable[Any]]
EnqueueNext = Callable[["Envelope"], Awaitable["Envelope"]]
EnqueueMiddleware = Callable[["Envelope", EnqueueNext], Awaitable["Envelope"]]


def same_middleware(built_from: Sequence[object], now: Sequence[object]) -> bool:
    """Whether a chain built from ``built_from`` still fits the list ``now`` (middleware may be added,
    removed or swapped while a host runs). By identity, not ``==``: an equal but different object
    (or one whose ``__eq__`` misbehaves) must still be the one that runs."""
    return len(built_from) == len(now) and all(a is b for a, b in zip(built_from, now, strict=True))


def compose_handle(
    middleware: Sequence[HandleMiddleware], terminal: Callable[[HandlerContext], Awaitable[Any]]
) -> Callable[[HandlerContext], Awaitable[Any]]:
    """The first middleware is the outermost layer."""
    if not middleware:
        return terminal

    def layer(index: int) -> Callable[[HandlerContext], Awaitable[Any]]:
        if index == len(middleware):
            return terminal
        mw = middleware[index]
        inner = layer(index + 1)

        async def run(ctx: HandlerContext) -> Any:
            return await mw(ctx, lambda: inner(ctx))

        return run

    return layer(0)


def compose_enqueue(middleware: Sequence[EnqueueMiddleware]) -> EnqueueNext:
    async def terminal(env: Envelope) -> Envelope:
        return env

    chain: EnqueueNext = terminal
    for mw in reversed(middleware):

        def bind(mw: EnqueueMiddleware, inner: EnqueueNext) -> EnqueueNext:
            async def run(env: Envelope) -> Envelope:
                return await mw(env, inner)

            return run

        chain = bind(mw, chain)
    return chain
