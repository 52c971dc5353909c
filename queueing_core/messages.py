"""Message contracts and the ``@queue`` class decorator.

A message is a pydantic model deriving from :class:`QueueMessage`. The base fields (id, creation time,
correlation id, properties) travel in the envelope, not in the body, so there is one source of truth.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from datetime import datetime
from enum import StrEnum
from typing import Any, ClassVar, TypeVar
from uuid import UUID, uuid4

from pydantic import BaseModel, ConfigDict, Field, field_validator

from .clock import to_utc, utcnow
from .errors import InvalidArgument
from .options import QueueOptions


class MessageStatus(StrEnum):
    """The statuses the kit itself sets. Operators may set custom statuses as well."""

    PENDING = "Pending"
    LEASED = "Leased"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"  # a retry is scheduled
    DEAD_LETTERED = "DeadLettered"
    EXPIRED = "Expired"
    WAITING_FOR_HANDLER = "WaitingForHandler"
    PAUSED = "Paused"
    SLEEPING = "Sleeping"  # scheduled for later
    ABANDONED = "Abandoned"  # lease expired and the queue says a person should look
    ARCHIVED = "Archived"  # a filter over the archived flag: archived rows keep their final status
    CANCELLED = "Cancelled"

    @classmethod
    def terminal(cls) -> frozenset[MessageStatus]:
        return frozenset({cls.SUCCEEDED, cls.DEAD_LETTERED, cls.EXPIRED, cls.CANCELLED})

    @classmethod
    def runnable(cls) -> frozenset[MessageStatus]:
        """Statuses processing may pick up; anything else (terminal, Abandoned, custom) it leaves alone."""
        return frozenset({cls.PENDING, cls.FAILED, cls.SLEEPING, cls.WAITING_FOR_HANDLER, cls.PAUSED})


BASE_FIELDS = frozenset({"message_id", "created_at", "correlation_id", "properties"})


class QueueMessage(BaseModel):
    """Base of every queued message type.

    Subclass it and add your fields; decorate the class with :func:`queue` to set its options.
    """

    model_config = ConfigDict(frozen=False, populate_by_name=True)

    __queue_options__: ClassVar[QueueOptions] = QueueOptions()

    message_id: UUID = Field(default_factory=uuid4)
    created_at: datetime = Field(default_factory=utcnow)
    correlation_id: str | None = None
    properties: dict[str, str] = Field(default_factory=dict)

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        # A subclass does not inherit its parent's queue (it is another type with its own queue).
        if "__queue_options__" not in cls.__dict__:
            cls.__queue_options__ = QueueOptions()

    @field_validator("created_at")
    @classmethod
    def _utc(cls, value: datetime) -> datetime:
        return to_utc(value)  # a time UTC cannot hold is a validation error, not an OverflowError

    @classmethod
    def type_name(cls) -> str:
        return cls.__queue_options__.type_name or cls.__name__

    @classmethod
    def queue_options(cls) -> QueueOptions:
        return cls.__queue_options__

    @classmethod
    def example(cls) -> QueueMessage | None:
        """An example instance for the ops API; override, or pass ``example=`` to ``@queue``."""
        ex = cls.__queue_options__.example
        if isinstance(ex, dict):
            return cls.model_validate(ex)
        return ex if isinstance(ex, cls) else None

    def body(self) -> dict[str, Any]:
        """The JSON body that goes on the wire (the message's own fields, without the base fields).

        A number JSON cannot carry (NaN, an infinity) is refused: it would go out as null (or a
        literal ``NaN`` no store keeps), and the message would no longer match its own model."""
        body = self.model_dump(mode="json", exclude=set(BASE_FIELDS))
        for path in _lost_on_the_wire(body, self):
            raise InvalidArgument(
                "message",
                f"{type(self).__name__}.{dotted(path)} is NaN or infinite: JSON has no such number, "
                "and the message would not arrive as sent",
            )
        return body


_UNCHECKED = object()


def _lost_on_the_wire(dumped: Any, model: BaseModel) -> Iterator[tuple[str | int, ...]]:
    """Where the dump (what goes on the wire) holds NaN or an infinity, as a typed float keeps it; or
    None where the value dumped was one and nothing of the model's chose that None: pydantic's JSON
    mode turns a NaN held untyped (``Any``, a ``dict[str, Any]``) into None. Only what is dumped is
    walked: a field excluded from the dump, or one whose own serializer writes None, is the model's
    choice. The dump refused a cycle, so the walk ends."""
    stack: list[tuple[Any, Any, tuple[str | int, ...]]] = [(dumped, model, ())]
    while stack:
        out, raw, at = stack.pop()
        if isinstance(out, float):
            if not math.isfinite(out):
                yield at
        elif out is None:
            if isinstance(raw, float) and not math.isfinite(raw):
                yield at
        elif isinstance(out, dict):
            stack.extend((v, _dumped_from(raw, k), (*at, k)) for k, v in reversed(out.items()))
        elif isinstance(out, list):
            stack.extend((v, _dumped_from(raw, i), (*at, i)) for i, v in reversed(list(enumerate(out))))


def _dumped_from(raw: Any, key: str | int) -> Any:
    """The value ``raw[key]`` was dumped from, where a None in its place is not the model's choice."""
    if isinstance(raw, BaseModel):
        field = type(raw).model_fields.get(key) if isinstance(key, str) else None
        if field is None or not isinstance(key, str):
            return _UNCHECKED
        value = getattr(raw, key, None)
        # a typed field's None is its type's or its serializer's doing; an untyped one's may be a NaN
        return (
            value
            if field.annotation is Any or isinstance(value, dict | list | tuple | BaseModel)
            else _UNCHECKED
        )
    if isinstance(raw, dict):
        return raw.get(key, _UNCHECKED)
    if isinstance(raw, list | tuple) and isinstance(key, int) and key < len(raw):
        return raw[key]
    return _UNCHECKED


def non_finite(value: Any, path: tuple[str | int, ...] = ()) -> Iterator[tuple[str | int, ...]]:
    """Where ``value`` (JSON read by Python, or a message's field values) holds NaN or an infinity.

    Python's json module reads ``NaN``, ``Infinity`` and ``1e999`` (as infinity) and writes them back;
    standard JSON has none of them: SQLite's JSON stores null instead and PostgreSQL refuses them.
    Iterative, so a body nested as deep as the parser allowed does not exhaust the stack here."""
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(value, path)]
    while stack:
        item, at = stack.pop()
        if isinstance(item, float):
            if not math.isfinite(item):
                yield at
        elif isinstance(item, dict):
            stack.extend((v, (*at, str(k))) for k, v in reversed(item.items()))
        elif isinstance(item, list | tuple | set | frozenset):
            stack.extend((v, (*at, i)) for i, v in reversed(list(enumerate(item))))
        elif isinstance(item, BaseModel):
            stack.extend((v, (*at, k)) for k, v in reversed(list(item.__dict__.items())))


def dotted(path: tuple[str | int, ...]) -> str:
    return ".".join(str(p) for p in path)


M = TypeVar("M", bound=type[QueueMessage])


def queue(name: str | None = None, **options: Any) -> Callable[[M], M]:
    """Declare a message type's queue options, like Nexus's ``[Queue]`` attribute.

    >>> @queue("send-order-confirmation", max_attempts=3)
    ... class SendOrderConfirmation(QueueMessage):
    ...     order_id: str
    """

    def decorate(cls: M) -> M:
        if not (isinstance(cls, type) and issubclass(cls, QueueMessage)):
            raise TypeError("@queue decorates QueueMessage subclasses")
        fields = dict(options)
        if name is not None:
            fields["name"] = name
        cls.__queue_options__ = QueueOptions(**fields)
        return cls

    return decorate


CUSTOM_STATUS_PATTERN = r"^[A-Za-z][A-Za-z0-9_-]{0,63}$"
