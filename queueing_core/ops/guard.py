"""Who may use the ops API: checked first, for every request, before routing, redirects, 404 or 405.

:class:`Guard` is one ASGI middleware in front of the whole app. A request passes when

- one of its :class:`Credential` s says VALID and none says INVALID (every credential presented is
  checked: a wrong one next to a right one refuses the request), or
- it presents none, and the app runs without a key on loopback (:class:`LocalOnly`), and the request
  cannot have come from a web page on another site.

Otherwise it gets 401 (403 for a cross-site refusal) as problem details, having reached nothing else.
A request that passes but whose query string is not UTF-8 gets 400 (nothing downstream can read it).

A credential is anything that can look at a request and say absent, valid or invalid:
:class:`ApiKeyHeaders`, and the dashboard's signed-in browser session (a cookie plus an anti-forgery
token on every state-changing request, in :mod:`.ui.session`), added to the same list.
"""

from __future__ import annotations

import enum
import hmac
from collections.abc import Callable, Sequence
from typing import Protocol

from starlette.requests import HTTPConnection
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from .problems import problem

#: methods the routes change state with; any other method changes nothing (it gets 405)
STATE_CHANGING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
#: what `Sec-Fetch-Site` says for a request the page's own origin (or the user) made
SAME_ORIGIN_FETCH = frozenset({"same-origin", "none"})
WWW_AUTHENTICATE = {"WWW-Authenticate": 'Bearer realm="queueing"'}


class Verdict(enum.Enum):
    ABSENT = "absent"
    VALID = "valid"
    INVALID = "invalid"


class Credential(Protocol):
    """One way a request can prove it may use the API."""

    def verify(self, request: HTTPConnection) -> Verdict: ...


class ApiKeyHeaders:
    """``X-API-Key: <key>`` or ``Authorization: Bearer <key>``, compared in constant time. Every value
    of both headers counts, repeated or not; an empty or non-Bearer ``Authorization`` is a wrong one."""

    def __init__(self, key: str) -> None:
        self._key = key.encode()

    def verify(self, request: HTTPConnection) -> Verdict:
        presented: list[bytes] = []
        for name, value in request.scope["headers"]:  # raw bytes: no decoding surprises
            if name == b"x-api-key":
                presented.append(value)
            elif name == b"authorization":
                scheme, _, token = value.partition(b" ")
                presented.append(token.strip() if scheme.lower() == b"bearer" else b"")
        if not presented:
            return Verdict.ABSENT
        # compare every value, even after a wrong one: the time taken says nothing about which
        results = [hmac.compare_digest(p, self._key) for p in presented]
        return Verdict.VALID if all(results) else Verdict.INVALID


def is_json(content_type: str) -> bool:
    """``application/json`` or ``application/<anything>+json``, parameters aside (FastAPI's own rule for
    parsing a body as JSON, and a type a browser may not send to another site without asking first)."""
    media = content_type.split(";", 1)[0].strip().lower()
    main, _, sub = media.partition("/")
    return main == "application" and (sub == "json" or (sub.endswith("+json") and len(sub) > 5))


class LocalOnly:
    """Requests without a key, allowed only as a process on this machine makes them.

    Loopback alone does not stop a web page the operator has open: the browser is on this machine.
    So a request must (1) name this server by a loopback address and its port in ``Host`` (a page
    that rebinds its own DNS name to 127.0.0.1 still sends its name), (2) carry no ``Origin`` other
    than this server's and no ``Sec-Fetch-Site`` other than same-origin, and (3) when it changes
    state, carry a JSON content type or an ``X-Requested-With`` header: a browser sends neither to
    another site without a CORS preflight, which this API never grants.
    """

    def __init__(self, host: str, port: int) -> None:
        names = {"127.0.0.1", "localhost", "[::1]"}
        names.add(f"[{host}]" if ":" in host else host.lower())  # another loopback it listens on
        self.hosts = frozenset({f"{n}:{port}" for n in names} | (names if port == 80 else set()))
        self.origins = frozenset(f"http://{h}" for h in self.hosts)
        self.named = f"127.0.0.1:{port}, localhost:{port} or [::1]:{port}"

    def refusal(self, request: HTTPConnection, method: str) -> str | None:
        """Why the request must be refused, or None."""
        headers = request.headers
        hosts = headers.getlist("host")
        if len(hosts) != 1 or hosts[0].lower() not in self.hosts:
            return (
                f"without QUEUEING_API_KEY this API answers only requests addressed to {self.named}; "
                "set a key to reach it by another name"
            )
        if any(o.lower() not in self.origins for o in headers.getlist("origin")):
            return "a request from a page of another origin is refused (the API has no key)"
        if any(s.lower() not in SAME_ORIGIN_FETCH for s in headers.getlist("sec-fetch-site")):
            return "a request the browser made for another site is refused (the API has no key)"
        if method in STATE_CHANGING:
            types = headers.getlist("content-type")
            json_typed = bool(types) and all(is_json(t) for t in types)
            if not json_typed and "x-requested-with" not in headers:
                return (
                    "without QUEUEING_API_KEY a request that changes something must carry "
                    "`Content-Type: application/json` or an `X-Requested-With` header"
                )
        return None


#: renders a refusal (status, kind, detail) for a request in a form of its own (a browser page gets a
#: redirect to the sign-in page); None leaves it to the problem details
Refusal = Callable[[HTTPConnection, int, str, str], Response | None]


def _utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def nothing_public(path: str) -> bool:
    return False


def no_rendering(request: HTTPConnection, status: int, kind: str, detail: str) -> Response | None:
    return None


class Guard:
    """The ASGI middleware: see the module's docstring.

    ``public`` names the few paths anyone may reach (the sign-in page and its stylesheet), and
    ``render`` may answer a refusal in another form; neither changes who is refused.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        credentials: Sequence[Credential],
        local: LocalOnly | None = None,
        public: Callable[[str], bool] = nothing_public,
        render: Refusal = no_rendering,
    ) -> None:
        self.app = app
        self.credentials = tuple(credentials)
        self.local = local
        self.public = public
        self.render = render

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self.app(scope, receive, send)
            return
        if scope["type"] != "http":  # no websockets here: refuse before anything can answer
            await send({"type": "websocket.close", "code": 1008})
            return
        request = HTTPConnection(scope)
        refusal = None if self.public(scope["path"]) else self._refusal(request, scope["method"])
        if refusal is None and not _utf8(scope.get("query_string", b"")):
            # (after the credential: who is refused learns nothing more.) Starlette builds the request's
            # URL by decoding the query string as UTF-8: anything that reads it (an error handler, a
            # page) would fail with a 500 on a query string a lenient HTTP parser let through raw
            refusal = 400, "bad-request", "the query string is not UTF-8: percent-encode it"
        if refusal is None:
            await self.app(scope, receive, send)
            return
        status, kind, detail = refusal
        response = self.render(request, status, kind, detail) or problem(
            status,
            kind,
            detail,
            instance=scope["path"],
            headers=WWW_AUTHENTICATE if status == 401 else None,
        )
        await response(scope, receive, send)

    def _refusal(self, request: HTTPConnection, method: str) -> tuple[int, str, str] | None:
        verdicts = {c.verify(request) for c in self.credentials}
        if Verdict.INVALID in verdicts:
            return 401, "unauthorized", "the credential is not valid"
        if Verdict.VALID in verdicts:
            return None
        if self.local is not None:
            why = self.local.refusal(request, method)
            return None if why is None else (403, "cross-site", why)
        if not self.credentials:
            return (
                401,
                "unauthorized",
                "this API has no key configured (set QUEUEING_API_KEY); it refuses every request",
            )
        return 401, "unauthorized", "send the API key as `Authorization: Bearer <key>` or `X-API-Key: <key>`"
