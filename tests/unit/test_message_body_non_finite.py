"""A message body JSON cannot carry (NaN, an infinity) is refused at enqueue, by what goes on the wire:
the first check walked the Python values, and refused models whose wire JSON is valid (a NaN in a
field excluded from the dump, one a serializer writes as null), found in review."""

from __future__ import annotations

import math
from typing import Annotated, Any

import pytest
from pydantic import BaseModel, Field, PlainSerializer

from queueing_core import QueueMessage
from queueing_core.errors import InvalidArgument

NAN = float("nan")


class Inner(BaseModel):
    shown: int = 1
    scratch: float = Field(default=NAN, exclude=True)  # never on the wire


class WithExcludedNested(QueueMessage):
    inner: Inner = Field(default_factory=Inner)


NanAsNull = Annotated[float | None, PlainSerializer(lambda v: None if v is not None and math.isnan(v) else v)]


class WithSerializer(QueueMessage):
    reading: NanAsNull = None


class Typed(QueueMessage):
    amount: float


class Untyped(QueueMessage):
    extra: dict[str, Any] = Field(default_factory=dict)
    anything: Any = None


def test_what_the_model_keeps_off_the_wire_or_writes_as_null_is_sent():
    assert WithExcludedNested().body() == {"inner": {"shown": 1}}
    assert WithSerializer(reading=NAN).body() == {"reading": None}


@pytest.mark.parametrize(
    ("message", "where"),
    [
        (Typed(amount=NAN), "Typed.amount"),
        (Typed(amount=math.inf), "Typed.amount"),
        # pydantic's JSON mode writes a NaN held untyped as null: the message would arrive changed
        (Untyped(extra={"rows": [1.0, NAN]}), "Untyped.extra.rows.1"),
        (Untyped(anything=-math.inf), "Untyped.anything"),
    ],
)
def test_a_number_json_has_no_place_for_is_refused_by_where_it_is(message, where):
    with pytest.raises(InvalidArgument, match=f"{where} is NaN or infinite"):
        message.body()
