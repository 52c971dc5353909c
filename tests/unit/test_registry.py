"""The app registry: one handler per type, accumulation across modules, no I/O at import."""

import subprocess
import sys
import textwrap

import pytest

from queueing_core import DuplicateHandlerError, QueueingApp, QueueMessage, RegistrationError, Router, queue


class Ping(QueueMessage):
    n: int = 0


def test_second_handler_fails_at_registration_naming_both():
    app = QueueingApp()

    @app.handler()
    async def first(msg: Ping) -> None: ...

    with pytest.raises(DuplicateHandlerError) as info:

        @app.handler()
        def second(msg: Ping) -> None: ...

    text = str(info.value)
    assert "<locals>.first (" in text
    assert "<locals>.second (" in text
    assert "'Ping'" in text


def test_registrations_from_several_routers_accumulate_and_clash_on_include():
    billing, shipping = Router(), Router()

    @queue("invoices")
    class Invoice(QueueMessage):
        pass

    @billing.handler()
    async def bill(msg: Invoice) -> None: ...

    @shipping.handler()
    def ship(msg: Ping, ctx) -> None: ...

    app = QueueingApp()
    app.include(billing)
    app.include(shipping)
    assert {s.type_name: s.handler.func for s in app.subscriptions()} == {"Invoice": bill, "Ping": ship}
    spec = app.handler_for("Ping")
    assert not spec.is_async
    assert spec.wants_context
    assert app.handler_for("Invoice").is_async
    assert not app.handler_for("Invoice").wants_context

    other = Router()

    @other.handler()
    async def bill_again(msg: Invoice) -> None: ...

    with pytest.raises(DuplicateHandlerError, match="bill_again"):
        app.include(other)


def test_handler_type_from_annotation_or_argument_and_clear_errors():
    app = QueueingApp()

    async def untyped(msg) -> None: ...

    with pytest.raises(RegistrationError, match="annotate its first parameter"):
        app.handler()(untyped)
    app.handler(Ping)(untyped)
    assert app.handler_for("Ping").func is untyped

    async def three(a: Ping, b, c) -> None: ...

    with pytest.raises(RegistrationError, match=r"\(message\) or \(message, context\)"):
        QueueingApp().handler()(three)


def test_two_types_on_one_queue_or_one_name_are_refused():
    @queue("shared")
    class A(QueueMessage):
        pass

    @queue("shared")
    class B(QueueMessage):
        pass

    app = QueueingApp()
    app.message(A)
    with pytest.raises(RegistrationError, match="queue 'shared' is declared by both"):
        app.message(B)

    @queue(type_name="Ping")
    class Impostor(QueueMessage):
        pass

    app2 = QueueingApp()
    app2.message(Ping)
    with pytest.raises(RegistrationError, match="two message classes use the type name 'Ping'"):
        app2.message(Impostor)


def test_importing_an_app_opens_no_connection(tmp_path):
    # every socket connect or DNS lookup made while importing the example app fails the import
    probe = textwrap.dedent(
        """
        import socket
        def refuse(*a, **k):
            raise AssertionError(f"network use at import: {a!r}")
        socket.socket.connect = refuse
        socket.create_connection = refuse
        socket.getaddrinfo = refuse
        import queueing_core.examples.orders
        print(len(queueing_core.examples.orders.app.subscriptions()))
        """
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=".", check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "3"
