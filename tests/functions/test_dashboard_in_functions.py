"""The dashboard through the HTTP function: the same pages, behind the same key."""

from __future__ import annotations

from .conftest import Context, user
from .test_timers_and_http import request, sql_app

UI = "/api/_system/queueing/ui"


async def test_the_http_function_serves_the_dashboard_behind_the_key(tmp_path):
    _app, host, fns, _seen = sql_app(tmp_path, api_key="fn-key")
    http = user(fns["http_app_func"])
    ctx = Context()
    away = await http(request("GET", f"{UI}/"), ctx)
    assert away.status_code == 303
    assert away.headers["location"].startswith(f"{UI}/sign-in")
    assert (await http(request("GET", f"{UI}/static/htmx.min.js"), ctx)).status_code == 200
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    refused = await http(request("POST", f"{UI}/sign-in", form, b"key=nope"), ctx)
    assert refused.status_code == 401
    signed = await http(request("POST", f"{UI}/sign-in", form, b"key=fn-key"), ctx)
    assert signed.status_code == 303
    cookie = signed.headers["set-cookie"].split(";", 1)[0]
    overview = await http(request("GET", f"{UI}/", {"Cookie": cookie}), ctx)
    assert overview.status_code == 200
    assert "timed" in overview.get_body().decode()
    await (await host.runtime()).close()
