"""What an Azure Storage account enforces that Azurite does not: ``allowSharedKeyAccess`` and Azure RBAC
on the data plane. One gate per service (queue, table), in front of an Azurite that runs over HTTPS
with OAuth on (``azurite_oauth``).

- A request signed with the account key (``SharedKey``, ``SharedKeyLite``) or a SAS is refused with the
  service's 403 ``KeyBasedAuthenticationNotPermitted`` when the account allows no shared key access.
- A request with a bearer token is refused with 403 ``AuthorizationPermissionMismatch`` unless the
  token's identity (its ``oid``) holds, on the account, a built-in data role for that service that
  allows the request (a reader role: reads and peeks only).
- Everything else goes on to Azurite, which checks the token's issuer, audience and lifetime and does
  the work; its answer comes back unchanged.
"""

from __future__ import annotations

import datetime
import ssl
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from tests.identity_endpoint import claims_of

#: built-in data roles: role definition id -> (service, may write)
DATA_ROLES: Mapping[str, tuple[str, bool]] = {
    "974c5e8b-45b9-4653-ba55-5f855dd0fb88": ("queue", True),  # Storage Queue Data Contributor
    "19e7f393-937e-4f77-808e-94535e297925": ("queue", False),  # Storage Queue Data Reader
    "0a9a7e1f-b9d0-4cc4-a60d-0319b160aaa3": ("table", True),  # Storage Table Data Contributor
    "76199698-9eea-4c19-bc75-cec21354c6b6": ("table", False),  # Storage Table Data Reader
    "b7e6dc6d-f1e8-4753-8033-0f276bb0955b": ("blob", True),  # Storage Blob Data Owner
    "ba92f5b4-2d11-453d-a403-e96b0029c9fe": ("blob", True),  # Storage Blob Data Contributor
    "2a2b9908-6ea1-4ae2-8e65-a410df84e7d1": ("blob", False),  # Storage Blob Data Reader
}
KEY_NOT_PERMITTED = (
    "KeyBasedAuthenticationNotPermitted",
    "Key based authentication is not permitted on this storage account.",
)
NO_PERMISSION = (
    "AuthorizationPermissionMismatch",
    "This request is not authorized to perform this operation using this permission.",
)


def _writes(request: web.Request) -> bool:
    if request.method not in ("GET", "HEAD"):
        return True
    # receiving queue messages is a GET that hides them: only a peek is a read
    return request.path.endswith("/messages") and request.query.get("peekonly") != "true"


@dataclass
class StorageGate:
    service: str  # "queue" or "table"
    upstream: str  # Azurite's endpoint for the service, e.g. https://127.0.0.1:port/devstoreaccount1
    upstream_ssl: ssl.SSLContext
    server_ssl: ssl.SSLContext
    allow_shared_key: bool
    role_assignments: Mapping[str, list[str]]  # principal id -> role definition ids on the account
    refused: list[tuple[str, str]] = field(default_factory=list)  # (error code, principal or scheme)
    passed: int = 0
    endpoint: str = ""
    _runner: web.AppRunner | None = None
    _session: aiohttp.ClientSession | None = None

    def _error(self, status: int, code: str, message: str) -> web.Response:
        detail = (
            f"{message}\nRequestId:{uuid.uuid4()}\nTime:{datetime.datetime.now(datetime.UTC).isoformat()}"
        )
        headers = {"x-ms-error-code": code}
        if self.service == "table":
            return web.json_response(
                {"odata.error": {"code": code, "message": {"lang": "en-US", "value": detail}}},
                status=status,
                headers=headers,
            )
        body = (
            '<?xml version="1.0" encoding="utf-8"?>'
            f"<Error><Code>{code}</Code><Message>{detail}</Message></Error>"
        )
        return web.Response(status=status, body=body, content_type="application/xml", headers=headers)

    def _allowed(self, principal: str, writes: bool) -> bool:
        for role in self.role_assignments.get(principal, []):
            service, may_write = DATA_ROLES.get(role, ("", False))
            if service == self.service and (may_write or not writes):
                return True
        return False

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        auth = request.headers.get("Authorization", "")
        shared = auth.startswith(("SharedKey ", "SharedKeyLite ")) or "sig" in request.query
        if shared and not self.allow_shared_key:
            self.refused.append((KEY_NOT_PERMITTED[0], auth.split(" ", 1)[0] or "SAS"))
            return self._error(403, *KEY_NOT_PERMITTED)
        if auth.startswith("Bearer "):
            principal = str(claims_of(auth.removeprefix("Bearer ")).get("oid", ""))
            if not self._allowed(principal, _writes(request)):
                self.refused.append((NO_PERMISSION[0], principal))
                return self._error(403, *NO_PERMISSION)
        self.passed += 1
        assert self._session is not None
        origin = self.upstream.split("/", 3)
        url = f"{origin[0]}//{origin[2]}{request.path_qs}"
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
        async with self._session.request(
            request.method, url, headers=headers, data=await request.read(), ssl=self.upstream_ssl
        ) as upstream:
            body = await upstream.read()
            skip = {"content-length", "transfer-encoding", "content-encoding", "connection"}
            out = {k: v for k, v in upstream.headers.items() if k.lower() not in skip}
            return web.Response(status=upstream.status, body=body, headers=out)

    async def start(self) -> str:
        self._session = aiohttp.ClientSession(auto_decompress=False)
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0, ssl_context=self.server_ssl)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        account = self.upstream.rstrip("/").rsplit("/", 1)[1]
        self.endpoint = f"https://127.0.0.1:{port}/{account}"
        return self.endpoint

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()
