"""Queue names: prefix/suffix composition and one sanitizer and validator per transport.

Each transport has its own rules (checked against the services' documentation):

- Service Bus: 1-260 characters; letters, digits, ``.``, ``-``, ``_``, ``/``; starts and ends with a
  letter or digit; case-insensitive on the service.
- Storage Queues: 3-63 characters; lowercase letters, digits and single ``-``; starts and ends with a
  letter or digit.
- SQS: 1-80 characters; letters, digits, ``-``, ``_`` (a FIFO queue ends with ``.fifo``).
- RabbitMQ: 1-255 bytes of UTF-8; names starting ``amq.`` are reserved by the broker.

Sanitizing is deterministic and idempotent; a name that has to be shortened keeps an 8-character hash
of the original so two long names stay distinct.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from enum import StrEnum


class Transport(StrEnum):
    INPROCESS = "inprocess"
    SQL = "sql"
    SERVICE_BUS = "servicebus"
    STORAGE_QUEUE = "storage_queue"
    SQS = "sqs"
    RABBITMQ = "rabbitmq"


class InvalidQueueName(ValueError):
    """A queue name breaks a transport's naming rule; ``rule`` says which."""

    def __init__(self, name: str, transport: Transport, rule: str) -> None:
        super().__init__(f"queue name {name!r} is invalid for {transport.value}: {rule}")
        self.name = name
        self.transport = transport
        self.rule = rule


@dataclass(frozen=True, slots=True)
class _Rules:
    min_len: int
    max_len: int
    allowed: re.Pattern[str]  # one allowed character
    edges_alnum: bool
    lowercase: bool
    single_dashes: bool
    max_bytes: int | None = None
    reserved_prefix: str | None = None
    description: str = ""


_ALNUM = re.compile(r"[A-Za-z0-9]")

# fmt: off
_SB = "letters, digits, '.', '-', '_', '/'; starts and ends with a letter or digit"
_KEY = re.compile(r"[A-Za-z0-9._:/-]")

RULES: dict[Transport, _Rules] = {
    Transport.SERVICE_BUS: _Rules(
        min_len=1, max_len=260, allowed=re.compile(r"[A-Za-z0-9._/-]"), edges_alnum=True,
        lowercase=False, single_dashes=False, description=f"1-260 characters of {_SB}",
    ),
    Transport.STORAGE_QUEUE: _Rules(
        min_len=3, max_len=63, allowed=re.compile(r"[a-z0-9-]"), edges_alnum=True,
        lowercase=True, single_dashes=True,
        description="3-63 lowercase letters, digits and single '-'; starts and ends with a letter or digit",
    ),
    Transport.SQS: _Rules(
        min_len=1, max_len=80, allowed=re.compile(r"[A-Za-z0-9_-]"), edges_alnum=False,
        lowercase=False, single_dashes=False, description="1-80 characters of letters, digits, '-', '_'",
    ),
    Transport.RABBITMQ: _Rules(
        min_len=1, max_len=255, allowed=re.compile(r"[^\x00-\x1f\x7f]"), edges_alnum=False,
        lowercase=False, single_dashes=False, max_bytes=255, reserved_prefix="amq.",
        description="1-255 bytes of UTF-8 without control characters; must not start with 'amq.'",
    ),
    # SQL and in-process queues are rows/keys: any such name up to 200 characters.
    Transport.SQL: _Rules(
        min_len=1, max_len=200, allowed=_KEY, edges_alnum=False, lowercase=False, single_dashes=False,
        description="1-200 characters of letters, digits, '.', '_', ':', '/', '-'",
    ),
    Transport.INPROCESS: _Rules(
        min_len=1, max_len=200, allowed=_KEY, edges_alnum=False, lowercase=False, single_dashes=False,
        description="1-200 characters of letters, digits, '.', '_', ':', '/', '-'",
    ),
}
# fmt: on


def validate(name: str, transport: Transport) -> None:
    """Raise :class:`InvalidQueueName` naming the first rule ``name`` breaks."""
    rules = RULES[transport]
    if not rules.min_len <= len(name) <= rules.max_len:
        raise InvalidQueueName(name, transport, f"length must be {rules.min_len}-{rules.max_len} characters")
    if rules.max_bytes is not None and len(name.encode()) > rules.max_bytes:
        raise InvalidQueueName(name, transport, f"must be at most {rules.max_bytes} bytes of UTF-8")
    bad = sorted({c for c in name if not rules.allowed.fullmatch(c)})
    if bad:
        raise InvalidQueueName(name, transport, f"characters {bad!r} are not allowed ({rules.description})")
    if rules.lowercase and name != name.lower():
        raise InvalidQueueName(name, transport, "must be lowercase")
    if rules.edges_alnum and not (_ALNUM.fullmatch(name[0]) and _ALNUM.fullmatch(name[-1])):
        raise InvalidQueueName(name, transport, "must start and end with a letter or digit")
    if rules.single_dashes and "--" in name:
        raise InvalidQueueName(name, transport, "consecutive dashes are not allowed")
    if rules.reserved_prefix and name.startswith(rules.reserved_prefix):
        raise InvalidQueueName(name, transport, f"names starting {rules.reserved_prefix!r} are reserved")


def is_valid(name: str, transport: Transport) -> bool:
    try:
        validate(name, transport)
    except InvalidQueueName:
        return False
    return True


def _digest(name: str) -> str:
    return hashlib.sha1(name.encode(), usedforsecurity=False).hexdigest()[:8]


def _fits(name: str, rules: _Rules) -> bool:
    return len(name) <= rules.max_len and (rules.max_bytes is None or len(name.encode()) <= rules.max_bytes)


def _trim_edges(text: str, rules: _Rules) -> str:
    return re.sub(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$", "", text) if rules.edges_alnum else text


def sanitize(name: str, transport: Transport) -> str:
    """Map any name to a valid one for ``transport``; valid names come back unchanged."""
    if is_valid(name, transport):
        return name
    rules = RULES[transport]
    out = name.lower() if rules.lowercase else name
    out = "".join(c if rules.allowed.fullmatch(c) else "-" for c in out)
    if rules.single_dashes:
        out = re.sub("-{2,}", "-", out)
    out = _trim_edges(out, rules)
    if rules.reserved_prefix and out.startswith(rules.reserved_prefix):
        out = "q-" + out
    if not _fits(out, rules) or len(out) < rules.min_len:
        # Shortened or padded: keep a digest of the original so distinct names stay distinct.
        digest = _digest(name)
        head = out[: rules.max_len - len(digest) - 1]
        while not _fits(f"{head}-{digest}", rules):
            head = head[:-1]
        head = _trim_edges(head, rules).rstrip("-")
        out = f"{head}-{digest}" if head else f"q{digest}"
    validate(out, transport)
    return out


@dataclass(frozen=True, slots=True)
class QueueNaming:
    """Composes a logical queue name with a deployment prefix/suffix, then sanitizes it."""

    prefix: str = ""
    suffix: str = ""

    def physical(self, logical: str, transport: Transport) -> str:
        return sanitize(f"{self.prefix}{logical}{self.suffix}", transport)
