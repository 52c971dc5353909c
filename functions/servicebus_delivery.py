"""What survives of a Service Bus delivery count on its way from the Functions host to Python.

The host's Service Bus extension (.NET) hands the SDK-type binding 16 bytes of lock token followed by
the AMQP message as the .NET SDK re-encodes it. The .NET SDK raised the header's delivery count by one
when it received the message, so that count is 1 on the first delivery. Beside the binding data the
host passes trigger metadata, among it ``DeliveryCount`` (the same number).

The binding extension (``azurefunctions-extensions-bindings-servicebus`` 1.0.0b2) decodes the message
from just after the first ``x-opt-lock-token`` in those bytes, which drops the header before it: the
message's ``delivery_count`` is None. And it does not keep the trigger metadata. Counting every such
delivery as the first would never count a crash, a timeout or a lost lock towards ``max_attempts``.

So :func:`capture_delivery_counts` wraps the extension's decoder (the one the Python worker calls, with
the trigger metadata) and notes on each decoded message its delivery number: the trigger metadata's
``DeliveryCount``, else the message's own ``delivery_count`` (a later extension that keeps the header),
else the header decoded here from the host's bytes. :func:`delivery_number` reads it back.
"""

from __future__ import annotations

import json
import logging
from typing import Any

log = logging.getLogger("queueing.functions")

#: where the delivery number is noted on a decoded message
_NOTE = "_queueing_delivery_number"
_LOCK_TOKEN_BYTES = 16
_WRAPPED = "_queueing_wraps"


def capture_delivery_counts() -> None:
    """Wrap ``ServiceBusConverter.decode`` once per process (idempotent)."""
    from azurefunctions.extensions.bindings.servicebus import ServiceBusConverter

    current = ServiceBusConverter.__dict__["decode"]
    if getattr(current.__func__, _WRAPPED, None) is not None:
        return
    original = current.__func__

    def decode(cls: type, data: Any, *, trigger_metadata: Any, pytype: Any) -> Any:
        result = original(cls, data, trigger_metadata=trigger_metadata, pytype=pytype)
        if result is None:
            return result
        if isinstance(result, list):
            counts = _metadata_counts(trigger_metadata, "DeliveryCountArray")
            contents = [getattr(mbd, "content", None) for mbd in data.value.model_binding_data]
            for i, (message, content) in enumerate(zip(result, contents, strict=False)):
                _note(message, counts[i] if i < len(counts) else None, content)
        else:
            counts = _metadata_counts(trigger_metadata, "DeliveryCount")
            _note(result, counts[0] if counts else None, getattr(data.value, "content", None))
        return result

    setattr(decode, _WRAPPED, original)
    ServiceBusConverter.decode = classmethod(decode)  # type: ignore[method-assign,assignment]


def delivery_number(message: Any) -> int:
    """This delivery's number as the host counts it (1 = first); 1 when nothing says otherwise."""
    noted = getattr(message, _NOTE, None)
    if isinstance(noted, int) and noted >= 1:
        return noted
    count = getattr(message, "delivery_count", None)
    return count if isinstance(count, int) and count >= 1 else 1


def _note(message: Any, from_metadata: int | None, content: bytes | None) -> None:
    number = from_metadata
    if number is None:
        own = getattr(message, "delivery_count", None)
        number = own if isinstance(own, int) and own >= 1 else _header_count(content)
    if number is not None:
        try:
            setattr(message, _NOTE, number)
        except AttributeError:  # a message type that takes no attributes: delivery_count alone then
            log.debug("cannot note the delivery number on %s", type(message).__name__)


def _metadata_counts(trigger_metadata: Any, key: str) -> list[int]:
    """``DeliveryCount`` (or the batch's ``DeliveryCountArray``) as the worker hands it: a datum whose
    value is an int, or JSON text of one (or of a list)."""
    if not trigger_metadata:
        return []
    datum = trigger_metadata.get(key)
    if datum is None:
        return []
    value = getattr(datum, "value", datum)
    if isinstance(value, bytes | str):
        try:
            value = json.loads(value)
        except ValueError:
            return []
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool) and v >= 1]


def _header_count(content: bytes | None) -> int | None:
    """The AMQP header's delivery count in the host's bytes (after the lock token), if it has one."""
    if not content or len(content) <= _LOCK_TOKEN_BYTES:
        return None
    try:
        import uamqp  # the binding extension's own AMQP decoder

        header = uamqp.Message().decode_from_bytes(bytes(content[_LOCK_TOKEN_BYTES:])).header
    except Exception:  # not AMQP after all: the extension has already said so, or not
        return None
    count = getattr(header, "delivery_count", None) if header is not None else None
    return count if isinstance(count, int) and count >= 1 else None
