"""A type's ``example=`` is checked against its own model when the type is registered.

The ops API's `GET subscriptions` and the dashboard's Enqueue pages build every type's example; one
that no longer validates (a field renamed since) made them answer 500 for every type, while the app
registered and ran and `queueing check` said ok. Registration now refuses it, naming the type and the
field, so start-up and `queueing check` catch it.
"""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap

import pytest

from queueing_core import QueueingApp, QueueMessage, RegistrationError, Router, queue


@queue("example-renamed", example={"customer": "acme"})  # the field was renamed to account
class Renamed(QueueMessage):
    account: str


@queue("example-good", example={"account": "acme"})
class Good(QueueMessage):
    account: str


@queue("example-nan", example={"ratio": math.nan})
class NotJson(QueueMessage):
    ratio: float


class Overridden(QueueMessage):
    account: str

    @classmethod
    def example(cls) -> QueueMessage | None:
        raise LookupError("fixture file missing")


def test_a_stale_example_is_refused_at_registration_naming_type_and_field():
    app = QueueingApp()
    with pytest.raises(RegistrationError) as refused:
        app.message(Renamed)
    text = str(refused.value)
    assert "'Renamed'" in text
    assert "account: Field required" in text
    assert app.subscriptions() == []  # nothing half-registered

    with pytest.raises(RegistrationError, match="example of message type 'Renamed'"):

        @app.handler()
        async def handle(msg: Renamed) -> None: ...

    router = Router()
    with pytest.raises(RegistrationError, match="example of message type 'Renamed'"):
        router.message(Renamed)


def test_an_example_json_cannot_carry_or_one_that_fails_to_build_is_refused():
    app = QueueingApp()
    with pytest.raises(RegistrationError, match=r"'NotJson' cannot be built: .*NaN or infinite"):
        app.message(NotJson)
    with pytest.raises(
        RegistrationError, match="'Overridden' cannot be built: LookupError: fixture file missing"
    ):
        app.message(Overridden)


def test_a_valid_example_or_none_registers():
    app = QueueingApp()
    app.message(Good)

    class Plain(QueueMessage):
        n: int

    app.message(Plain)
    assert [s.type_name for s in app.subscriptions()] == ["Good", "Plain"]
    example = Good.example()
    assert example is not None
    assert example.body() == {"account": "acme"}


def test_queueing_check_exits_1_naming_the_example(tmp_path):
    (tmp_path / "staleapp.py").write_text(
        textwrap.dedent(
            """
            from queueing_core import QueueingApp, QueueMessage, queue
            @queue("stale", example={"customer": "acme"})
            class Sync(QueueMessage):
                account: str
            app = QueueingApp()
            app.message(Sync)
            """
        )
    )
    r = subprocess.run(
        [sys.executable, "-m", "queueing_core.cli", "check", "--app", "staleapp:app"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        check=False,
    )
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "example of message type 'Sync'" in r.stderr
    assert "account: Field required" in r.stderr


async def test_a_type_met_first_as_it_is_enqueued_is_not_refused_for_its_example():
    """A type only produced (never registered up front) is registered at its first enqueue: its stale
    example failed that enqueue (a handler's follow-up message would be retried, then dead-lettered;
    found in review). The enqueue goes ahead, and the ops API lists the type without the example."""
    from queueing_core.ops import OpsService
    from queueing_core.testing import in_process

    app = QueueingApp("example-produced")
    rt = in_process(app)
    await rt.open()
    try:
        receipt = await app.enqueue(Renamed(account="acme"))
        assert receipt.message_id
        [info] = [s for s in OpsService(rt).subscriptions() if s.type == Renamed.type_name()]
        assert info.example is None
    finally:
        await rt.close()
