"""Property-based runs of the served OpenAPI document (schemathesis) over a real HTTP server on a
SQLite database holding messages in several states, with a key and without one (loopback only).

The checks are named, not left to a default: no 5xx; every status, content type, header and body
documented; authentication enforced where the document declares it (`ignored_auth` sends each
request again without the key and with a wrong one); valid data accepted, invalid data refused.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest
import schemathesis
from fastapi import FastAPI, Security
from fastapi.security import APIKeyHeader
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    IgnoredAuth,
    content_type_conformance,
    ignored_auth,
    positive_data_acceptance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from queueing_core.ops import OpsService
from queueing_core.ops.api import PREFIX, create_app
from queueing_core.ops.guard import LocalOnly
from queueing_core.providers.sql import SqlProvider
from queueing_core.runtime import Runtime

from .served import free_port, served
from .test_ops_api import AUTH, KEY, Email, build_app

pytestmark = pytest.mark.slow

CONFORMANCE = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]


@pytest.fixture(scope="module", params=["key", "keyless"])
def server(request, tmp_path_factory):
    """(base url, headers that authenticate, whether the document declares a key)."""
    db = tmp_path_factory.mktemp("schemathesis") / "api.db"
    app, _ = build_app()
    opened: list[Runtime] = []

    async def make_ops() -> OpsService:  # built inside the server's own event loop
        rt = Runtime(app, SqlProvider(f"sqlite:///{db}"))
        opened.append(rt)
        await rt.open()
        await app.enqueue_many([Email(to=f"{i}@x.io", subject="s", fail=i % 2 == 0) for i in range(6)])
        sub = app.subscription("Email")
        for d in await rt.provider.receive(sub, 3):  # some leased, some settled by the pipeline
            await rt.process_and_settle(d) if d.attempt == 1 and d.envelope.body["to"] != "0@x.io" else None
        return OpsService(rt)

    port = free_port()
    keyless = request.param == "keyless"
    api = create_app(
        make_ops,
        api_key=None if keyless else KEY,
        local=LocalOnly("127.0.0.1", port) if keyless else None,
    )

    @contextlib.asynccontextmanager
    async def lifespan(_app: Any) -> AsyncIterator[None]:
        yield
        # closed in the server's own loop, before it ends: the SQLite connection's aiosqlite thread
        # would otherwise outlive that loop and report to a closed one
        for rt in opened:
            await rt.close()

    api.router.lifespan_context = lifespan
    with served(api, port, lifespan="on") as url:
        # without a key a local tool marks its requests (a browser cannot send this to another site)
        yield url, {"X-Requested-With": "schemathesis"} if keyless else AUTH, not keyless


@pytest.fixture(scope="module")
def cursor(server):
    """A real cursor, taken before any fuzzing: `cursor` is opaque and an undecodable one is rightly a
    422, so generated cases carry this one (it stays decodable after the rows are gone)."""
    url, headers, _ = server
    page = httpx.get(f"{url}{PREFIX}/messages", params={"limit": 1}, headers=headers).json()
    assert page["next_cursor"], "the fixture should hold more than one message"
    return page["next_cursor"]


def operations(url: str, headers: dict[str, str]):
    schema = schemathesis.openapi.from_url(f"{url}{PREFIX}/openapi.json", headers=headers)
    # the key is configuration, so schemathesis treats it as real credentials (and probes without it);
    # it must not invent a second X-API-Key beside it: a wrong key next to the right one is refused
    schema.config.update(base_url=url, headers=headers)
    schema.config.generation.update(with_security_parameters=False)
    # a body over the size limit is refused with 413 before it is read: that is a rejection too
    rejection = schema.config.checks.negative_data_rejection
    rejection.expected_statuses = [*rejection.expected_statuses, "413"]
    return [result.ok() for result in schema.get_all_operations()]


def _outside_utc(query: dict[str, Any] | None) -> bool:
    """Does ``query`` carry a time that no ``datetime`` holds once converted to UTC?"""
    for value in (query or {}).values():
        try:
            when = datetime.fromisoformat(str(value))
        except ValueError:
            continue
        try:
            when.astimezone(UTC)
        except OverflowError:
            return True
    return False


def test_a_time_out_of_range_once_in_utc_is_told_apart():
    assert _outside_utc({"created_to": "0001-01-01T00:00:00+00:01"})
    assert _outside_utc({"created_from": "9999-12-31T23:59:59-14:00"})
    assert not _outside_utc({"created_to": "0001-01-01T00:00:00-00:01", "status": "Pending", "limit": 3})
    assert not _outside_utc(None)


# schemathesis's pytest plugin does not run on this pytest; its strategies drive Hypothesis directly
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_server_errors_responses_match_the_schema_and_auth_is_enforced(server, cursor, mode):
    url, headers, keyed = server
    checks = [*CONFORMANCE, *([ignored_auth] if keyed else [])]
    # In negative mode the "schema-violating request accepted" heuristic misfires on string query
    # parameters (it sends `status=false` as "not a string", but a query value is always a string and
    # "false" is a valid custom status on SQL); the command run below keeps it, with a fixed seed.
    if mode is GenerationMode.POSITIVE:
        checks.append(positive_data_acceptance)
    checked: list[str] = []
    for op in operations(url, headers):

        @given(case=op.as_strategy(generation_mode=mode))
        @settings(
            max_examples=25,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            phases=[Phase.explicit, Phase.generate],
        )
        def check(case):
            if case.query and "cursor" in case.query:
                case.query["cursor"] = cursor
            run = list(checks)
            if case.method == "DELETE" or _outside_utc(case.query):
                # a purge needs a filter or all=true, and refuses a status no message has (a typo must
                # not read as "deleted 0"); a time filter out of the years 1-9999 once in UTC is refused
                # (``0001-01-01T00:00:00+00:01``): OpenAPI cannot say any of these, so valid-looking
                # ones get a 422
                run.remove(positive_data_acceptance) if positive_data_acceptance in run else None
            # generous: on a loaded machine one answer took over schemathesis's default 10 s (this
            # checks what comes back, not how fast)
            case.call_and_validate(checks=run, timeout=60)

        try:
            check()
        except Unsatisfiable:
            # nothing to make invalid (no parameters, no body): only the positive run covers it
            assert mode is GenerationMode.NEGATIVE, op.label
            checked.append(f"{op.label} (positive only)")
        else:
            checked.append(op.label)
    assert len(checked) == 24


def test_every_phase_and_check_of_the_schemathesis_command(server, tmp_path):
    """The `schemathesis run` command as a user would point it at the API: its coverage phase adds
    boundary values, missing parameters and undocumented methods to what the fuzzing phase sends."""
    url, headers, _ = server
    config = tmp_path / "schemathesis.toml"
    config.write_text(
        "[checks.negative_data_rejection]\n"
        'expected-statuses = ["400", "401", "403", "404", "405", "406", "409", "413", "415", "422"]\n'
    )
    cmd = [
        os.path.join(os.path.dirname(sys.executable), "schemathesis"),
        "--config-file",
        str(config),
        "run",
        f"{url}{PREFIX}/openapi.json",
        "--phases",
        "examples,coverage,fuzzing",
        "--checks",
        "all",
        # schema-valid but not issued by the API: an arbitrary cursor, a status no message has in a
        # purge; the test above sends real cursors and checks valid data there
        "--exclude-checks",
        "positive_data_acceptance",
        "--generation-with-security-parameters",
        "false",
        "--max-examples",
        "15",
        # fixed: its negative_data_rejection can misfire on a string query value such as `status=false`
        # (a valid custom status on SQL); with a seed a failure is the same on every run, and real
        "--seed",
        "1",
        "--no-color",
        *(arg for name, value in headers.items() for arg in ("-H", f"{name}: {value}")),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path, check=False)
    assert r.returncode == 0, r.stdout[-8000:] + r.stderr[-2000:]
    assert "24 selected / 24 total" in r.stdout


def test_the_auth_check_catches_a_route_that_does_not_enforce_its_key():
    """`ignored_auth` is not vacuous here: on a route that documents the key and ignores it, it fails."""
    app = FastAPI(openapi_url=f"{PREFIX}/openapi.json")

    @app.get(f"{PREFIX}/open")
    def open_route(_key: str | None = Security(APIKeyHeader(name="X-API-Key", auto_error=False))) -> dict:
        return {}

    with served(app) as url:
        [op] = operations(url, {"X-API-Key": KEY})

        @given(case=op.as_strategy())
        @settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def check(case):
            case.call_and_validate(checks=[ignored_auth])

        with pytest.raises(BaseException, match="distinct failure") as caught:  # a group of failures
            check()
        failures = getattr(caught.value, "exceptions", [caught.value])
        assert any(isinstance(f, IgnoredAuth) for f in failures), failures


def test_the_document_is_complete(server):
    url, headers, keyed = server
    doc = httpx.get(f"{url}{PREFIX}/openapi.json", headers=headers).json()
    assert len([op for path in doc["paths"].values() for op in path]) == 24
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            assert op.get("responses"), (method, path)
            assert bool(op.get("security")) == keyed, f"{method} {path}: security as the server asks"
            for status in ("401", "403", "422", "500", "503"):
                assert list(op["responses"][status]["content"]) == ["application/problem+json"]
    if keyed:
        assert {"APIKeyHeader", "HTTPBearer"} <= set(doc["components"]["securitySchemes"])
