"""Names the ops API, the dashboard and the CLI take hold no invisible formatting character of the Basic
Multilingual Plane: every character of Unicode's category Cf there (zero-width, bidirectional overrides
and isolates) is refused, as the docs say, both by Python's ``re`` (the CLI) and by pydantic's own
engine (the API's routes); the pattern is one a browser's engine reads the same way (the API's docs
page checks names with it)."""

from __future__ import annotations

import re
import unicodedata
from typing import Annotated

import httpx
import pytest
from pydantic import StringConstraints, TypeAdapter, ValidationError

from queueing_core.ops import OpsService
from queueing_core.ops.api import PREFIX, create_app
from queueing_core.ops.models import QUEUE_NAME, TYPE_NAME
from queueing_core.providers.inprocess import InProcessProvider
from queueing_core.runtime import Runtime
from tests.ui.app import app

FORMAT = [chr(c) for c in range(0x10000) if unicodedata.category(chr(c)) == "Cf"]


def test_every_format_character_is_refused_in_a_queue_and_a_type_name() -> None:
    assert len(FORMAT) > 40  # Python's Unicode database, not a list written here
    for pattern in (QUEUE_NAME, TYPE_NAME):
        checked = TypeAdapter(Annotated[str, StringConstraints(pattern=pattern)])
        passed = [f"U+{ord(ch):04X}" for ch in FORMAT if re.fullmatch(pattern, f"a{ch}b")]
        assert passed == []
        for ch in FORMAT:
            with pytest.raises(ValidationError):
                checked.validate_python(f"a{ch}b")
        assert checked.validate_python("billing-invoice") == "billing-invoice"


def test_the_patterns_use_only_escapes_a_browser_reads_alike() -> None:
    """Without the u flag, ECMAScript reads ``\\U0001xxxx`` as the letters U, 0, 1...: the docs page's
    own check then refused ordinary names (any with an "e", through the tags' range)."""
    for pattern in (QUEUE_NAME, TYPE_NAME):
        assert "\\U" not in pattern
        assert "\\u{" not in pattern


@pytest.mark.parametrize("ch", ["\u2066", "\u2069", "\u061c", "\u00ad"])
async def test_the_api_answers_422_for_a_name_with_an_isolate_or_a_tag(ch: str) -> None:
    rt = Runtime(app, InProcessProvider())
    async with rt:
        api = create_app(OpsService(rt), api_key="k-not-a-secret")
        transport = httpx.ASGITransport(app=api)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            headers = {"X-API-Key": "k-not-a-secret"}
            r = await c.post(f"{PREFIX}/queues/ui-orders{ch}/pause", headers=headers)
            listed = await c.get(f"{PREFIX}/messages", params={"type": f"Charge{ch}Card"}, headers=headers)
    assert r.status_code == 422, r.text
    assert listed.status_code == 422, listed.text
