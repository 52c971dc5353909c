"""Message contracts and the ``@queue`` class decorator.

A message is a pydantic model deriving from :class:`QueueMessage`. The base fields (id, creation time,
correlation id, properties) travel in the envelope, not in the body, so there is one source of truth.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterator
from datetime import datetime
from enum import StrEnum
from typing import Any, ClassVar, TypeVar, cast
from uuid import UUID, uuid4

from pydantic import BaseModel, ConfigDict, Field, Secret, SecretBytes, SecretStr, field_validator
from pydantic_core import to_json

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

        Refused, as the message would not arrive as sent: a number JSON cannot carry (NaN, an
        infinity: it would go out as null, or a literal ``NaN`` no store keeps), and a secret
        (``SecretStr``, ``SecretBytes``, ``Secret[...]``): pydantic writes it out as ``"**********"``,
        and the handler would get that. So are a body nested more than :data:`MAX_BODY_DEPTH` levels
        deep (past about 255 pydantic-core cannot write it, and each store, answer and page wraps it in
        more) and a dict key that is not Unicode text (a lone surrogate). Computed fields are left
        out: they are not input, and a model that forbids extra fields refused its own body."""
        if _DUMPS_WITHOUT_COMPUTED:
            dump: dict[str, Any] = {"exclude": set(BASE_FIELDS), "exclude_computed_fields": True}
        else:  # pydantic before 2.12: the message's own computed fields (a nested model's stay in)
            dump = {"exclude": set(BASE_FIELDS).union(type(self).model_computed_fields)}
        try:
            body = self.model_dump(mode="json", **dump)
        except UnicodeEncodeError:  # a lone surrogate in a dict key, as from "\udc00" (but see below)
            raise InvalidArgument(
                "message", f"{type(self).__name__}: a key {NOT_UTF8} (a lone surrogate)"
            ) from None
        except ValueError as exc:  # pydantic-core's own limit, over 250 levels: a bare ValueError
            if too_deep(exc):
                raise InvalidArgument("message", f"{type(self).__name__}: {TOO_DEEP}") from None
            raise
        if _check_nesting(body, type(self).__name__) and _surrogate_key(self, dump):
            # JSON mode writes a dict key holding a high lone surrogate ("\ud800") as U+FFFD (so the
            # envelope's encoding does not refuse it, as it does such a value): the message would be
            # stored, and run, with a key other than the one sent
            raise InvalidArgument("message", f"{type(self).__name__}: a key {NOT_UTF8} (a lone surrogate)")
        for path, secret in _lost_on_the_wire(body, self):
            where = f"{type(self).__name__}.{dotted(path)}"
            if secret:
                raise InvalidArgument(
                    "message",
                    f"{where} is a secret: its JSON is the mask {_body_at(body, path)!r}, not its value, "
                    "so the message would not arrive as sent; send it as plain text (a str field) and keep "
                    "it out of logs yourself, or send a reference to where the handler can read it",
                )
            raise InvalidArgument(
                "message",
                f"{where} is NaN or infinite: JSON has no such number, and the message would not arrive "
                "as sent",
            )
        return body


#: how deep objects and arrays may nest in a body (the body itself is the first level): well below
#: pydantic-core's own limit (about 255, counting what wraps the body: the envelope, an API answer), so
#: a message that is accepted can also be written to every store, read back and shown
MAX_BODY_DEPTH = 128
TOO_DEEP = (
    f"the body nests objects and arrays more than {MAX_BODY_DEPTH} levels deep; the kit sends at most that"
)
NOT_UTF8 = "holds text that cannot be encoded as UTF-8"


def too_deep(exc: BaseException) -> bool:
    """Whether pydantic-core refused to write a value for nesting past its limit (its only sign is the
    text: a plain ``ValueError`` from ``model_dump``, a ``PydanticSerializationError`` from ``to_json``)."""
    return "serialization depth" in str(exc)


def _check_nesting(body: dict[str, Any], name: str) -> bool:
    """Refuse a body that nests deeper than :data:`MAX_BODY_DEPTH`; return whether it holds a dict key
    with U+FFFD, which may be JSON mode's stand-in for a lone surrogate (the caller then checks). Walked
    without recursion."""
    suspect = False
    stack: list[tuple[Any, int]] = [(body, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_BODY_DEPTH:
            raise InvalidArgument("message", f"{name}: {TOO_DEEP}")
        if isinstance(value, dict):
            suspect = suspect or any("\ufffd" in k for k in value if isinstance(k, str))
            stack.extend((v, depth + 1) for v in value.values() if isinstance(v, dict | list))
        else:
            stack.extend((v, depth + 1) for v in value if isinstance(v, dict | list))
    return suspect


def _surrogate_key(message: QueueMessage, dump: dict[str, Any]) -> bool:
    """Whether the message's body holds a dict key that is not Unicode text (a lone surrogate). JSON
    mode, both to Python values and to text, writes such a key of a typed ``dict[str, ...]`` as U+FFFD,
    so it is looked for in the Python-mode dump, which keeps keys as they are."""
    try:
        stack: list[Any] = [message.model_dump(**dump)]
    except UnicodeEncodeError:
        return True
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            if any(isinstance(k, str) and not encodable(k) for k in value):
                return True
            stack.extend(value.values())
        elif isinstance(value, list | tuple | set | frozenset):
            stack.extend(value)
    return False


def encodable(text: str) -> bool:
    """Whether ``text`` can be encoded as UTF-8 (it holds no lone surrogate)."""
    if text.isascii():
        return True
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


_UNCHECKED = object()
_DUMPS_WITHOUT_COMPUTED = "exclude_computed_fields" in inspect.signature(BaseModel.model_dump).parameters
#: pydantic's secret types: written to JSON as a mask (``"**********"``, or ``""`` for an empty value)
_SECRETS = (SecretStr, SecretBytes, Secret)
#: a typed field's value the walk follows: one it goes into, or a secret
_WALKED = (dict, list, tuple, BaseModel, *_SECRETS)


def _lost_on_the_wire(dumped: Any, model: BaseModel) -> Iterator[tuple[tuple[str | int, ...], bool]]:
    """Where the dump (what goes on the wire) holds NaN or an infinity, as a typed float keeps it; or
    None where the value dumped was one and nothing of the model's chose that None: pydantic's JSON
    mode turns a NaN held untyped (``Any``, a ``dict[str, Any]``) into None. Also (the flag True) where
    it holds a secret's mask in place of its value. Only what is dumped is walked: a field excluded
    from the dump, or one whose own serializer writes None (or a secret's value), is the model's
    choice. The dump refused a cycle, so the walk ends."""
    stack: list[tuple[Any, Any, tuple[str | int, ...]]] = [(dumped, model, ())]
    while stack:
        out, raw, at = stack.pop()
        if isinstance(out, float):
            if not math.isfinite(out):
                yield at, False
        elif out is None:
            if isinstance(raw, float) and not math.isfinite(raw):
                yield at, False
        elif isinstance(out, str):
            # (a typed str field's raw is _UNCHECKED: one identity test per text, no more)
            if raw is not _UNCHECKED and isinstance(raw, _SECRETS) and _masked(out, raw):
                yield at, True
        elif isinstance(out, dict):
            stack.extend((v, _dumped_from(raw, k), (*at, k)) for k, v in reversed(out.items()))
        elif isinstance(out, list):
            stack.extend((v, _dumped_from(raw, i), (*at, i)) for i, v in reversed(list(enumerate(out))))


def _masked(out: str, secret: Secret[Any] | SecretStr | SecretBytes) -> bool:
    """Whether ``out`` is the mask pydantic wrote for ``secret``, which would not read back as it."""
    value = secret.get_secret_value()
    # (its own display, which pydantic writes: a subclass may show part of it, "****3000")
    shown = secret._display() if value else ""
    if out != (shown.decode() if isinstance(shown, bytes) else shown):
        return False  # its own serializer's doing (one that writes the value out, say)
    if isinstance(value, str):
        return value != out
    if isinstance(value, bytes):
        return value != out.encode()
    return True  # a Secret[int] and the like: the mask does not even read back as its type


def _body_at(body: Any, path: tuple[str | int, ...]) -> Any:
    """What the dump holds at ``path``."""
    for key in path:
        body = body[key]
    return body


def _dumped_from(raw: Any, key: str | int) -> Any:
    """The value ``raw[key]`` was dumped from, where a None in its place is not the model's choice
    (or where it is a secret, whose mask is not)."""
    if isinstance(raw, BaseModel):
        field = type(raw).model_fields.get(key) if isinstance(key, str) else None
        if field is None or not isinstance(key, str):
            return _UNCHECKED
        value = getattr(raw, key, None)
        # a typed field's None is its type's or its serializer's doing; an untyped one's may be a NaN
        return value if field.annotation is Any or isinstance(value, _WALKED) else _UNCHECKED
    if isinstance(raw, dict):
        return raw.get(key, _UNCHECKED)
    if isinstance(raw, list | tuple) and isinstance(key, int) and key < len(raw):
        return raw[key]
    return _UNCHECKED


QM = TypeVar("QM", bound=BaseModel)
#: each model's reader (see :func:`read_body`), decided the first time one of its bodies is read
_READERS: dict[type[BaseModel], Callable[[dict[str, Any]], Any]] = {}


def read_body(model: type[QM], data: dict[str, Any]) -> QM:
    """A message of ``model`` from JSON data: a body read back (with the envelope's base fields), or
    one given to the CLI or the ops API. Validated as JSON, which is how :meth:`QueueMessage.body`
    wrote it: in pydantic's Python mode a strict model refused the text of its own UUID, Decimal,
    datetime or Enum (every message of it was dead-lettered), as did any type whose JSON form is not
    its Python one. A model whose fields read the same either way (decided once per model, see
    :func:`_same_in_python`) is validated from the data as it is: writing it out as JSON to validate
    it again doubled what reading a message cost. The keys of computed fields are dropped (bodies
    written before they were left out)."""
    reader = _READERS.get(model)
    if reader is None:
        reader = _reader(model)
        if not model.__pydantic_complete__:
            return cast(QM, reader(data))  # (not kept: decided again once the model is complete)
        _READERS[model] = reader
    return cast(QM, reader(data))


def _reader(model: type[QM]) -> Callable[[dict[str, Any]], QM]:
    computed = frozenset(model.model_computed_fields)
    same = model.__pydantic_complete__ and _same_in_python(model.__pydantic_core_schema__)
    if same and not computed:
        return model.model_validate

    def read(data: dict[str, Any]) -> QM:
        if computed and not computed.isdisjoint(data):
            data = {k: v for k, v in data.items() if k not in computed}
        if same:
            return model.model_validate(data)
        # (NaN as a literal, as Python's json read it: the model's float fields decide, as before)
        return model.model_validate_json(to_json(data, inf_nan_mode="constants"))

    return read


#: core schema types that validate JSON's values (str, int, float, bool, None, lists, objects) in
#: Python's lax mode as JSON mode does: the same parser takes a UUID, a Decimal or a time from its text
_SAME_LEAVES = frozenset(
    {
        *("any", "none", "bool", "int", "float", "str"),
        *("uuid", "decimal", "datetime", "date", "time", "timedelta", "enum"),
    }
)
_SAME_NODES = frozenset(
    {
        # (no plain union: Python mode takes a UUID's or a time's text for a ``str`` member where JSON
        # mode reads the UUID, and ``datetime | date`` each its own way; ``X | None`` is nullable)
        *("list", "set", "frozenset", "tuple", "dict", "nullable", "default", "tagged-union"),
        *("model", "model-fields", "model-field", "typed-dict", "typed-dict-field"),
        *("dataclass", "dataclass-args", "dataclass-field", "definitions", "definition-ref"),
        *("function-before", "function-after", "function-wrap", "function-plain"),
    }
)
_CHILDREN = ("schema", "items_schema", "keys_schema", "values_schema", "extras_schema")


def _same_in_python(schema: Any) -> bool:
    """Whether a model validates JSON data in Python mode exactly as in JSON mode: no strict part (a
    strict UUID, datetime, tuple... takes no text in Python mode), and only the schema types above
    (anything else, a ``json_or_python`` one such as a secret, bytes, a URL, a path, may read its
    JSON form otherwise). Validators see the same values either way. Conservative: a type not
    listed takes the JSON way, which is always right, only slower."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if node.get("strict") or (node.get("config") or {}).get("strict"):
            return False
        kind = node.get("type")
        if kind in _SAME_LEAVES:
            continue
        if kind == "literal":
            if not all(v is None or type(v) in (str, int, bool) for v in node.get("expected", ())):
                return False
            continue
        if kind not in _SAME_NODES:
            return False
        for key in _CHILDREN:
            child = node.get(key)
            if isinstance(child, dict):
                stack.append(child)
            elif isinstance(child, list):  # a tuple's items
                stack.extend(child)
        if kind == "union":
            stack.extend(c[0] if isinstance(c, tuple) else c for c in node["choices"])
        elif kind == "tagged-union":
            stack.extend(node["choices"].values())
        elif kind in ("model-fields", "typed-dict"):
            stack.extend(node["fields"].values())
        elif kind in ("dataclass-args", "definitions"):
            stack.extend(node["fields" if kind == "dataclass-args" else "definitions"])
    return True


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
