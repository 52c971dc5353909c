"""The dashboard's browser session: a signed cookie, and an anti-forgery token for changes.

Signing in with the API key sets a cookie holding ``<issued>.<nonce>.<signature>`` (never the key):
the signature is an HMAC under a key derived from the API key, so changing the key signs everyone
out, and a session ends on its own after :data:`LIFETIME`. The cookie is ``HttpOnly`` (no script
reads it) and ``SameSite=Strict`` (no other site's page sends it). A state-changing request must also
carry ``X-CSRF-Token``: an HMAC of the session the page was rendered with, which a page of another
site cannot read. :class:`SessionCookie` is one more :class:`~..guard.Credential` for the Guard.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import time
from collections.abc import Callable

from starlette.requests import HTTPConnection

from ..guard import STATE_CHANGING, Verdict

COOKIE = "queueing_session"
CSRF_HEADER = "x-csrf-token"
LIFETIME = 12 * 3600  # seconds: a working shift; then sign in again
#: a cookie longer than this is not ours (read before any parsing or hashing)
MAX_COOKIE = 256


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


class Sessions:
    """Issues and checks session tokens and their anti-forgery tokens for one API key."""

    def __init__(self, api_key: str, *, clock: Callable[[], float] = time.time) -> None:
        # a key of its own for the UI, so a session signature is never an HMAC under the API key itself
        self._key = hmac.new(api_key.encode(), b"queueing-dashboard-session", hashlib.sha256).digest()
        self._api_key = api_key.encode()
        self.clock = clock

    def key_matches(self, presented: str) -> bool:
        return hmac.compare_digest(presented.encode(), self._api_key)

    def _sign(self, text: str) -> str:
        return _b64(hmac.new(self._key, text.encode(), hashlib.sha256).digest())

    def issue(self) -> str:
        body = f"{int(self.clock())}.{_b64(secrets.token_bytes(16))}"
        return f"{body}.{self._sign('session|' + body)}"

    def valid(self, token: str) -> bool:
        if len(token) > MAX_COOKIE:
            return False
        issued, _, rest = token.partition(".")
        nonce, _, signature = rest.partition(".")
        if not (issued.isdigit() and len(issued) <= 12 and nonce and signature):
            return False
        body = f"{issued}.{nonce}"
        if not hmac.compare_digest(signature.encode(), self._sign("session|" + body).encode()):
            return False
        return 0 <= self.clock() - int(issued) < LIFETIME

    def csrf(self, token: str) -> str:
        return self._sign("csrf|" + token)


def session_cookies(request: HTTPConnection) -> list[str]:
    """Every value given for our cookie, across every Cookie header (a second one must not hide)."""
    values = []
    for name, value in request.scope["headers"]:
        if name != b"cookie":
            continue
        for part in value.decode("latin-1").split(";"):
            key, sep, val = part.strip().partition("=")
            if sep and key == COOKIE:
                values.append(val)
    return values


class SessionCookie:
    """A signed-in browser: see the module's docstring."""

    def __init__(self, sessions: Sessions) -> None:
        self.sessions = sessions

    def verify(self, request: HTTPConnection) -> Verdict:
        tokens = session_cookies(request)
        if not tokens:
            return Verdict.ABSENT
        if len(tokens) != 1 or not self.sessions.valid(tokens[0]):
            return Verdict.INVALID
        if request.scope["method"] in STATE_CHANGING:
            given = request.headers.getlist(CSRF_HEADER)
            expected = self.sessions.csrf(tokens[0]).encode()
            if len(given) != 1 or not hmac.compare_digest(given[0].encode(), expected):
                return Verdict.INVALID
        return Verdict.VALID
