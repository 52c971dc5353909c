"""One exception tree. Driver errors are translated into these at the provider boundary."""

from __future__ import annotations

import math
from datetime import datetime, timedelta
from typing import Any


class QueueingError(Exception):
    """Base of every error the kit raises."""


class ConfigurationError(QueueingError):
    """Invalid or missing configuration; ``setting`` names it, ``accepted`` says what would do."""

    def __init__(self, setting: str, problem: str, accepted: str | None = None) -> None:
        text = f"{setting}: {problem}" + (f" (accepted: {accepted})" if accepted else "")
        super().__init__(text)
        self.setting = setting
        self.problem = problem
        self.accepted = accepted


class RegistrationError(QueueingError):
    """An app registration that cannot work (raised at start-up, never at processing time)."""


class DuplicateHandlerError(RegistrationError):
    def __init__(self, type_name: str, existing: str, new: str) -> None:
        super().__init__(
            f"message type {type_name!r} already has a handler: {existing}; refusing a second one: {new}"
        )
        self.type_name = type_name
        self.existing = existing
        self.new = new


class MalformedEnvelope(QueueingError):
    """The bytes on the wire are not a valid envelope; ``raw`` keeps them for the dead-letter record."""

    reason_code = "malformed-envelope"

    def __init__(self, reason: str, raw: bytes | str) -> None:
        super().__init__(f"malformed envelope: {reason}")
        self.reason = reason
        self.raw = raw


class UnsupportedEnvelopeVersion(MalformedEnvelope):
    def __init__(self, version: object, raw: bytes | str) -> None:
        super().__init__(f"unsupported envelope version {version!r} (this kit reads version 1)", raw)
        self.version = version


class InvalidMessageBody(QueueingError):
    """The envelope is fine but its body does not validate against the message model."""

    reason_code = "invalid-body"


class MessageTooLarge(QueueingError, ValueError):
    def __init__(self, size: int, limit: int, transport: str) -> None:
        super().__init__(f"message is {size} bytes encoded; {transport} accepts at most {limit}")
        self.size = size
        self.limit = limit


class NotConfigured(QueueingError):
    """The app has no provider yet: call ``app.use(...)`` or set ``QUEUEING_PROVIDER``."""


class ProviderError(QueueingError):
    """A transport operation failed."""


class ProviderUnavailable(ProviderError):
    """The transport cannot be reached now; callers retry with backoff."""


class MissingPermission(ProviderError):
    """The service refused an operation the credential's identity has no right to (HTTP 401/403,
    AMQP unauthorized-access): ``right`` is what it lacks and ``role`` the built-in role that grants it."""

    def __init__(self, message: str, *, right: str, role: str) -> None:
        super().__init__(message)
        self.right = right
        self.role = role


class LeaseLost(ProviderError):
    """The lease/lock on a message moved to another owner or expired; the result was not recorded."""


class MessageNotFound(QueueingError, LookupError):
    pass


class InvalidOperation(QueueingError):
    """An ops action refused in the message's current state (HTTP 409)."""


class NotSupported(InvalidOperation):
    """The transport cannot do this (HTTP 409); the message says which transport and why."""


class JobFailed(QueueingError):
    """``app.result()`` of a message that finished without a result: dead-lettered or expired
    (``status``, ``reason`` and ``description`` say how)."""

    def __init__(self, message: str, *, status: str, reason: str | None, description: str | None) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.description = description


class JobCancelled(JobFailed):
    """``app.result()`` of a message that was cancelled."""


class InvalidArgument(QueueingError, ValueError):
    """A caller's argument the kit refuses (a cursor it did not issue, a delay past the expiry, an
    unknown status); ``argument`` names it. The message is written for the caller (HTTP 422)."""

    def __init__(self, argument: str, problem: str) -> None:
        super().__init__(f"{argument}: {problem}")
        self.argument = argument
        self.problem = problem


# --- outcomes a handler may raise -------------------------------------------------------------


class Retry(Exception):
    """Raise from a handler to retry after a delay (counts an attempt).

    ``after``: a ``timedelta`` or a number of seconds; None for the type's backoff. Anything else (a
    time to run at, text, a ``Decimal``) raises ``TypeError``, a number that is not finite
    ``ValueError``: raised inside a handler, that is a failed attempt like any error. Kept as given, it
    failed the kit's own handling of the retry on every run, which handed the message back uncounted,
    and it ran again for ever."""

    # (a subclass whose ``__init__`` does not call this one's retries after the type's backoff)
    _after: timedelta | None = None
    reason: str = "retry requested"

    def __init__(self, after: timedelta | float | None = None, reason: str = "retry requested") -> None:
        super().__init__(reason)
        self.after = after
        self.reason = reason

    @property
    def after(self) -> timedelta | None:
        """The delay asked for (None: the type's backoff); a negative one retries at once."""
        return self._after

    @after.setter
    def after(self, value: timedelta | float | None) -> None:
        self._after = _delay(value)

    def __reduce__(self) -> tuple[Any, ...]:
        # pickled (a handler's process pool), copied: an exception is rebuilt as ``cls(*args)``, whose
        # args are (reason,), which ``after`` then refused (the pool broke): rebuilt as it stands instead
        return (_remade, (type(self), self.args, self.__dict__))


def _remade(cls: type[Retry], args: tuple[Any, ...], state: dict[str, Any]) -> Retry:
    """A pickled or copied ``Retry`` (or a subclass) as it stood, its ``__init__`` not called again."""
    made = cls.__new__(cls)
    Exception.__init__(made, *args)
    made.__dict__.update(state)
    return made


def _delay(value: object) -> timedelta | None:
    """``Retry``'s ``after`` as a ``timedelta``, or the error that says what it must be."""
    if value is None or isinstance(value, timedelta):
        return value
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(
            f"Retry(after=...) takes a timedelta or a number of seconds, not {type(value).__name__}"
        )
    if not math.isfinite(value):
        raise ValueError(f"Retry(after=...) takes a finite number of seconds, not {value!r}")
    try:
        return timedelta(seconds=value)
    except OverflowError:
        # past what a timedelta holds (a few thousand million years): as long (or as short) as one can
        # be; the pipeline bounds the wait in any case
        return timedelta.max if value > 0 else timedelta.min


class NonRetryableError(Exception):
    """Raise (or subclass) to dead-letter at once: retrying cannot help."""


class ProcessAgainAt(Exception):
    """Internal carrier for a handler that returned a time to be processed again."""

    def __init__(self, when: datetime) -> None:
        super().__init__(f"process again at {when.isoformat()}")
        self.when = when


def text_of(exc: BaseException) -> str:
    """``str(exc)``, or a note that it failed. A handler's exception whose ``__str__`` raises (or
    returns no string) failed the pipeline's handling of that failure: the worker handed the message
    back uncounted, and it ran again at once, for ever, never retried or dead-lettered."""
    try:
        return str(exc)
    except Exception as err:
        return f"<str() of the {type(exc).__name__} failed: {type(err).__name__}>"


def first_line(exc: BaseException) -> str:
    """One wording of an error in a log line: its type and the first line of its text."""
    text = text_of(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__
