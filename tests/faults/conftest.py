"""One provider setup per provider for the whole fault suite (a PostgreSQL schema, Azurite tables, a
Service Bus namespace, ...), and the suite's report: how many cases ran, and which steps cannot be
injected and why."""

from __future__ import annotations

import pytest_asyncio

from tests.contract.harness import HARNESSES, Harness

from .table import not_injectable

_ran: dict[str, int] = {"passed": 0, "xfailed": 0, "failed": 0}


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def harnesses(tmp_path_factory, request):
    made: dict[str, Harness] = {}

    def get(name: str) -> Harness:
        if name not in made:
            make = HARNESSES[name]
            if name == "sqlite":
                made[name] = make(str(tmp_path_factory.mktemp("faults")))
            elif name == "storage_queue":
                # with the optional delayed store (a SQLite file), so that its forward is a sequence here
                delayed = tmp_path_factory.mktemp("faults_delayed") / "delayed.db"
                made[name] = make(request.getfixturevalue("azurite"), delayed_url=f"sqlite:///{delayed}")
            elif name == "servicebus":
                made[name] = make(request.getfixturevalue("azurite"))
            else:
                made[name] = make()
        return made[name]

    yield get
    for h in made.values():
        if h.cleanup is not None:
            await h.cleanup()


def pytest_runtest_logreport(report):
    if report.when == "call" and "tests/faults/test_faults.py" in report.nodeid:
        key = "xfailed" if hasattr(report, "wasxfail") else report.outcome
        _ran[key] = _ran.get(key, 0) + 1


def pytest_terminal_summary(terminalreporter):
    if not any(_ran.values()):
        return
    tr = terminalreporter
    tr.write_sep("-", "fault injection")
    tr.write_line(
        f"fault cases run: {sum(_ran.values())} ({_ran['passed']} passed, {_ran['xfailed']} expected to "
        f"fail (the known defects of table.py, each a strict xfail), {_ran['failed']} failed)"
    )
    rows = not_injectable()
    tr.write_line(f"steps that cannot be injected ({len(rows)}):")
    for row in rows:
        tr.write_line(f"  {row}")
