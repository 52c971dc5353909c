"""The Functions host's side of a Service Bus trigger, for tests.

A message received (peek-lock) from the in-memory Service Bus is turned into what the host's Service
Bus extension (.NET) hands the Python worker, and decoded by the binding extension's own decoder (the
converter registered for ``serviceBusTrigger``, which the worker looks up), with the trigger metadata
the host passes beside it:

- content: the 16 lock-token bytes in .NET ``Guid.ToByteArray()`` order, then the AMQP message
  (``ConvertReceivedMessageToBindingData`` in the WebJobs Service Bus extension);
- the AMQP header's delivery count is the .NET SDK's, which added one on receive (1 on the first
  delivery), so here it is the in-memory broker's count (the Python SDK's, 0 first) plus one;
- trigger metadata ``DeliveryCount``: that same number.

The AMQP bytes are written by azure-servicebus's own AMQP encoder (``_pyamqp``); the test
``test_host_bytes_match_the_payload_the_extension_was_captured_with`` holds this against the payload
captured from the real host that the extension's own tests use.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from azurefunctions.extensions.base import Datum
from azurefunctions.extensions.base.meta import _ConverterMeta
from azurefunctions.extensions.bindings.servicebus import ServiceBusReceivedMessage

#: the payload the extension's own tests decode (tests/test_servicebus.py, captured from the host)
CAPTURED_CONTENT = (
    b"_\241S\374f\335OI\202]\356\033|4<\373\000Sp\300\013\005@@pH\031\010\000@R\001\000Sq\301$\002\243\020"
    b"x-opt-lock-token\230\374S\241_\335fIO\202]\356\033|4<\373\000Sr\301U\006\243\023x-opt-enqueued-time"
    b"\203\000\000\001\216v\307\333\310\243\025x-opt-sequence-numberU\014\243\022x-opt-locked-until\203\000"
    b"\000\001\216v\310\3067\000Ss\300?\r\241 f00d2a33551440389d68e299d31adc7c@@@@@@@\203\000\000\001\216"
    b"\276\340\343\310\203\000\000\001\216v\307\333\310@@@\000Su\240\005hello"
)


class _ModelBindingData:
    """What the worker hands the converter for ``model_binding_data`` (the proto's four fields)."""

    def __init__(self, content: bytes) -> None:
        self.version = "1.0"
        self.source = "AzureServiceBusReceivedMessage"
        self.content_type = "application/octet-stream"
        self.content = content


def _ms(when: datetime | None) -> int | None:
    return None if when is None else int(when.timestamp() * 1000)


def _text(value: Any) -> Any:
    return value.decode("utf-8") if isinstance(value, bytes) else value


def amqp_bytes(
    *,
    delivery_count: int,
    lock_token: uuid.UUID,
    body: bytes,
    message_id: str | None,
    sequence_number: int,
    enqueued_time: datetime | None,
    locked_until: datetime | None,
    time_to_live_ms: int | None = None,
    correlation_id: str | None = None,
    subject: str | None = None,
    content_type: str | None = None,
    application_properties: dict[Any, Any] | None = None,
) -> bytes:
    """An AMQP message in the order the .NET SDK writes its sections, by the SDK's own encoder."""
    from azure.servicebus._pyamqp import _encode as enc
    from azure.servicebus._pyamqp.message import Header, Message, Properties
    from azure.servicebus._pyamqp.types import TYPE, VALUE, AMQPTypes

    out = bytearray()
    header = Header(
        durable=True, ttl=time_to_live_ms, first_acquirer=delivery_count == 1, delivery_count=delivery_count
    )
    enc.encode_value(out, enc.describe_performative(header))
    # encode_payload writes no delivery annotations (a sender never does): the section by hand, 0x71
    delivery_annotations = {b"x-opt-lock-token": {TYPE: AMQPTypes.uuid, VALUE: lock_token}}
    enc.encode_value(
        out,
        {
            TYPE: AMQPTypes.described,
            VALUE: ({TYPE: AMQPTypes.ulong, VALUE: 0x71}, enc.encode_annotations(delivery_annotations)),
        },
    )
    annotations: dict[bytes, Any] = {b"x-opt-sequence-number": {TYPE: AMQPTypes.long, VALUE: sequence_number}}
    if enqueued_time is not None:
        annotations[b"x-opt-enqueued-time"] = {TYPE: AMQPTypes.timestamp, VALUE: _ms(enqueued_time)}
    if locked_until is not None:
        annotations[b"x-opt-locked-until"] = {TYPE: AMQPTypes.timestamp, VALUE: _ms(locked_until)}
    props = Properties(
        message_id=message_id, correlation_id=correlation_id, subject=subject, content_type=content_type
    )
    app_props = {_text(k): _text(v) for k, v in (application_properties or {}).items()} or None
    enc.encode_payload(
        out,
        Message(
            message_annotations=annotations, properties=props, application_properties=app_props, data=[body]
        ),
    )
    return bytes(out)


def host_content(received: Any) -> bytes:
    """The binding data the host builds for a message the in-memory broker handed out (peek-lock)."""
    assert received.lock_token is not None, "only a locked (peek-lock) message reaches a trigger"
    message = amqp_bytes(
        delivery_count=received.delivery_count + 1,  # .NET's count: 1 on the first delivery
        lock_token=received.lock_token,
        body=b"".join(received.body),
        message_id=received.message_id,
        sequence_number=received.sequence_number,
        enqueued_time=received.enqueued_time_utc,
        locked_until=received.locked_until_utc,
        time_to_live_ms=(
            int(received.time_to_live.total_seconds() * 1000) if received.time_to_live is not None else None
        ),
        correlation_id=received.correlation_id,
        subject=received.subject,
        content_type=received.content_type,
        application_properties=received.application_properties,
    )
    return received.lock_token.bytes_le + message


def decode_as_worker(content: bytes, delivery_count: int | None) -> Any:
    """The binding extension's decoder as the worker calls it, with the host's trigger metadata."""
    converter = _ConverterMeta.get("serviceBusTrigger")
    metadata = {} if delivery_count is None else {"DeliveryCount": Datum(value=delivery_count, type="int")}
    return converter.decode(
        Datum(value=_ModelBindingData(content), type="model_binding_data"),
        trigger_metadata=metadata,
        pytype=ServiceBusReceivedMessage,
    )


def as_delivered(received: Any, *, metadata: bool = True) -> Any:
    """``received`` as the trigger function gets it under the real host (see the module doc)."""
    return decode_as_worker(host_content(received), received.delivery_count + 1 if metadata else None)


@dataclass
class HostActions:
    """Stands in for ``ServiceBusMessageActions`` (whose constructor needs the worker's gRPC channel):
    records each settlement by lock token, the only thing the real one sends, and then carries them out
    on the in-memory broker as the host does."""

    done: list[tuple[str, uuid.UUID, dict[str, Any]]] = field(default_factory=list)

    def _record(self, action: str, message: Any, **kw: Any) -> None:
        if not message.lock_token:
            raise ValueError("lockToken is required in ServiceBusReceivedMessage.")
        self.done.append((action, message.lock_token, kw))

    def complete(self, message: Any) -> None:
        self._record("complete", message)

    def abandon(self, message: Any) -> None:
        self._record("abandon", message)

    def renew_message_lock(self, message: Any) -> None:
        """Nothing to carry out later: the messages it is given hold their locks until ``apply``
        (``LiveActions`` in test_review_functions_host.py renews on the broker and can be refused)."""
        if not message.lock_token:
            raise ValueError("lockToken is required in ServiceBusReceivedMessage.")

    def deadletter(
        self,
        message: Any,
        deadletter_reason: str | None = None,
        deadletter_error_description: str | None = None,
    ) -> None:
        self._record(
            "deadletter", message, reason=deadletter_reason, error_description=deadletter_error_description
        )

    async def apply(self, receiver: Any, received: list[Any]) -> None:
        by_token = {m.lock_token: m for m in received}
        for action, token, kw in self.done:
            message = by_token[token]
            if action == "complete":
                await receiver.complete_message(message)
            elif action == "abandon":
                await receiver.abandon_message(message)
            else:
                await receiver.dead_letter_message(message, **kw)


async def host_delivers(receiver: Any, fn: Any, *, metadata: bool = True) -> HostActions:
    """The host's whole part for one message: peek-lock it, hand it over, then settle as told."""
    [received] = await receiver.receive_messages(max_message_count=1, max_wait_time=1)
    actions = HostActions()
    await fn(as_delivered(received, metadata=metadata), actions)
    await actions.apply(receiver, [received])
    return actions
