"""Sign-in and sign-out, the pages' shared frame (templates, headers), the static files, API docs."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urlsplit

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from jinja2 import Environment, FileSystemLoader, select_autoescape
from starlette.requests import HTTPConnection
from starlette.staticfiles import StaticFiles

from ...errors import InvalidArgument
from ..guard import SAME_ORIGIN_FETCH, Credential, LocalOnly
from ..service import OpsService
from .forms import read_form
from .session import COOKIE, LIFETIME, SessionCookie, Sessions, session_cookies

HERE = Path(__file__).parent
#: every page: only this server's own scripts, styles and images; never inside another site's frame
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'; "
    "form-action 'self'; base-uri 'none'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}
#: where sign-in may send the browser back to: a path of this app, nothing that leaves it
SAFE_NEXT = re.compile(r"/[A-Za-z0-9/_.~%=&+:-]*(\?[A-Za-z0-9/_.~%=&+:-]*)?")


def swagger_path() -> Path | None:
    """Swagger UI's files from the ``swagger-ui-bundle-v2`` package (the ``dashboard`` extra)."""
    try:
        from swagger_ui_bundle import swagger_ui_path
    except ImportError:
        return None
    return Path(str(swagger_ui_path))


class Dashboard:
    """The dashboard of one ops app: its routes, and what it adds to the app's Guard."""

    def __init__(
        self,
        service: Callable[[], Awaitable[OpsService]],
        *,
        api_key: str | None,
        local: LocalOnly | None,
        prefix: str,
    ) -> None:
        self.service = service
        self.prefix = prefix
        self.base = f"{prefix}/ui"
        self.sessions = Sessions(api_key) if api_key is not None else None
        #: "key": sign in with the API key; "local": open to this machine only; "closed": no key at all
        self.mode = "key" if api_key is not None else "local" if local is not None else "closed"
        self.credentials: tuple[Credential, ...] = (
            (SessionCookie(self.sessions),) if self.sessions is not None else ()
        )
        self.templates = Environment(
            loader=FileSystemLoader(HERE / "templates"),
            autoescape=select_autoescape(default=True, default_for_string=True),
            trim_blocks=True,
            lstrip_blocks=True,
        )
        # `/` and `/docs` redirect only a request that may see the pages: the API answers anything
        # else there with its 401, before any redirect
        self.public_paths = frozenset({f"{self.base}/sign-in"})
        self.router = APIRouter(include_in_schema=False)
        self._routes()

    # -- what the Guard asks -------------------------------------------------------------------------
    def public(self, path: str) -> bool:
        """The sign-in page and the static files (htmx, the stylesheet) need no credential."""
        return path in self.public_paths or path.startswith(f"{self.base}/static/")

    def render(self, request: HTTPConnection, status: int, kind: str, detail: str) -> Response | None:
        """A browser refused on a page is sent to sign in; the API keeps its problem details."""
        # the scope, not `request.url`: that decodes the query as UTF-8 and this request is not
        # authenticated (any bytes may come); whatever is not a safe path is dropped below anyway
        path = request.scope["path"]
        if status != 401 or not (path.startswith(f"{self.base}/") or path == f"{self.prefix}/docs"):
            return None
        target = f"{self.base}/sign-in"
        query = request.scope.get("query_string", b"").decode("latin-1")
        back = path + (f"?{query}" if query else "")
        if "hx-request" in request.headers:  # back to the page the fragment was for, not the fragment
            try:
                back = urlsplit(request.headers.get("hx-current-url", "")).path
            except ValueError:  # `http://[`: not a URL (urlsplit refuses it); sign in, go back nowhere
                back = ""
        if request.scope["method"] == "GET" and self.safe_next(back) == back:
            target += "?" + urlencode({"next": back})
        if "hx-request" in request.headers:  # htmx follows HX-Redirect with a full page load
            return Response(status_code=401, headers={"HX-Redirect": target, **SECURITY_HEADERS})
        if request.scope["method"] == "GET":
            return RedirectResponse(target, status_code=303, headers=SECURITY_HEADERS)
        return None

    # -- pages ---------------------------------------------------------------------------------------
    def page(self, request: Request, template: str, status: int = 200, **context: Any) -> HTMLResponse:
        tokens = session_cookies(request)
        csrf = self.sessions.csrf(tokens[0]) if self.sessions is not None and len(tokens) == 1 else ""
        html = self.templates.get_template(template).render(
            base=self.base,
            prefix=self.prefix,
            mode=self.mode,
            csrf=csrf,
            signed_in=bool(csrf),
            path=request.url.path,
            **context,
        )
        return HTMLResponse(html, status_code=status, headers=SECURITY_HEADERS)

    def safe_next(self, value: str) -> str:
        ok = value.startswith(f"{self.prefix}/") and SAFE_NEXT.fullmatch(value) and "//" not in value
        # no `.` or `..` step either (`%2e` is a dot to a browser): it resolves `<prefix>/../../x` to
        # `/x`, outside the app
        steps = value.split("?", 1)[0].lower().replace("%2e", ".").split("/")
        ok = ok and "." not in steps and ".." not in steps
        return value if ok and len(value) < 1024 else f"{self.base}/"

    def _routes(self) -> None:
        r, base = self.router, self.base

        @r.get("/", include_in_schema=False)
        async def root() -> Response:
            # a relative Location: never built from the request's Host header
            return RedirectResponse(f"{base}/", status_code=307)

        @r.get("/docs", include_in_schema=False)
        async def docs_redirect() -> Response:
            return RedirectResponse(f"{self.prefix}/docs", status_code=307)

        @r.get(f"{base}/sign-in")
        async def sign_in_page(request: Request, next: str = "") -> Response:
            if self.mode == "local":
                return RedirectResponse(self.safe_next(next), status_code=303, headers=SECURITY_HEADERS)
            return self.page(request, "sign_in.html", next=self.safe_next(next), error=None)

        @r.post(f"{base}/sign-in")
        async def sign_in(request: Request) -> Response:
            if self.sessions is None:
                return self.page(request, "sign_in.html", 409, next=f"{base}/", error=None)
            if not same_origin(request):  # a page of another site cannot sign a browser in
                return self.page(request, "sign_in.html", 403, next=f"{base}/", error="cross-site")
            try:
                form = await read_form(request)
            except InvalidArgument:
                return self.page(request, "sign_in.html", 400, next=f"{base}/", error="form")
            key = next((v for k, v in form if k == "key"), "")
            target = self.safe_next(next((v for k, v in form if k == "next"), ""))
            if len(key) > 1024 or not self.sessions.key_matches(key):
                return self.page(request, "sign_in.html", 401, next=target, error="key")
            response = RedirectResponse(target, status_code=303, headers=SECURITY_HEADERS)
            response.set_cookie(
                COOKIE,
                self.sessions.issue(),
                max_age=LIFETIME,
                path=self.prefix or "/",
                httponly=True,
                samesite="strict",
                secure=request.url.scheme == "https",
            )
            return response

        @r.post(f"{base}/sign-out")
        async def sign_out(request: Request) -> Response:
            # the Guard has checked the session and its anti-forgery token: a page elsewhere cannot
            # sign the operator out
            target = f"{base}/sign-in"
            response: Response
            if "hx-request" in request.headers:  # htmx would follow a 303 inside its request
                response = Response(status_code=200, headers={"HX-Redirect": target, **SECURITY_HEADERS})
            else:
                response = RedirectResponse(target, status_code=303, headers=SECURITY_HEADERS)
            response.delete_cookie(COOKIE, path=self.prefix or "/", httponly=True, samesite="strict")
            return response

        @r.get(f"{self.prefix}/docs")
        async def swagger(request: Request) -> Response:
            return self.page(
                request,
                "swagger.html",
                available=swagger_path() is not None,
                openapi_url=f"{self.prefix}/openapi.json",
            )

        from .pages import add_pages

        add_pages(self)

    def install(self, app: FastAPI) -> None:
        """Add the pages and the static files to ``app`` (outside its OpenAPI document)."""
        app.include_router(self.router)
        swagger_files = swagger_path()
        if swagger_files is not None:
            app.mount(f"{self.base}/swagger", StaticFiles(directory=swagger_files), name="swagger")
        app.mount(f"{self.base}/static", StaticFiles(directory=HERE / "static"), name="ui-static")


def same_origin(request: Request) -> bool:
    """The browser says the request came from this server's own page (or the user typed it).
    ``Sec-Fetch-Site``, where the browser sends it, decides: the browser sets it from the page and the
    target as it saw them, and no page can set it. ``Origin`` against ``Host`` decides only for a
    browser that sends no ``Sec-Fetch-Site``: behind a gateway that forwards to the app under its own
    host name (API Management, Front Door by default) the two never match, and every sign-in there
    was refused as cross-site (found in review)."""
    fetch_site = request.headers.getlist("sec-fetch-site")
    if fetch_site:
        return all(s.lower() in SAME_ORIGIN_FETCH for s in fetch_site)
    own = f"{request.url.scheme}://{request.headers.get('host', '')}".lower()
    return all(o.lower() == own for o in request.headers.getlist("origin"))
