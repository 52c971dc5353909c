"""A stand-in for the managed identity endpoint Azure Functions gives an app (``IDENTITY_ENDPOINT`` and
``IDENTITY_HEADER``, the App Service protocol), so the kit's real ``DefaultAzureCredential`` runs
unchanged: it finds the endpoint in the environment, asks it for a token for a resource, with the
user-assigned identity's ``client_id`` when the kit was given one.

It knows the identities the Bicep gives the app: a request naming an unknown client id, or naming none
when the app has no system-assigned identity, is refused as the real endpoint refuses it (HTTP 400).
Tokens are JWT-shaped (``oid`` = the identity's principal id, ``aud`` = the resource, ``exp``), unsigned:
the stand-ins that check them (the storage gate, Azurite) read the claims, as Azurite does, and no
signature. Every token issued is recorded, and ``on_issue`` callbacks see each one (a test sets a
PostgreSQL role's password to it, which is what the Entra-enabled server accepts).
"""

from __future__ import annotations

import base64
import json
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

TENANT = "72f988bf-86f1-41af-91ab-2d7cd011db47"
HEADER_SECRET = "identity-header-secret"


@dataclass(frozen=True)
class Identity:
    name: str
    client_id: str
    principal_id: str
    user_assigned: bool = True


@dataclass(frozen=True)
class Issued:
    resource: str
    identity: Identity
    token: str
    expires_on: int


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def make_token(identity: Identity, resource: str, lifetime: int) -> tuple[str, int]:
    now = int(time.time())
    claims = {
        "aud": resource,
        "iss": f"https://sts.windows.net/{TENANT}/",
        "iat": now,
        "nbf": now - 5,
        "exp": now + lifetime,
        "oid": identity.principal_id,
        "appid": identity.client_id,
        "tid": TENANT,
        "sub": identity.principal_id,
        "uti": uuid.uuid4().hex,  # every token differs, as real ones do
    }
    header = {"alg": "none", "typ": "JWT"}
    token = f"{_b64(json.dumps(header).encode())}.{_b64(json.dumps(claims).encode())}.{_b64(b'unsigned')}"
    return token, now + lifetime


def claims_of(token: str) -> dict[str, Any]:
    payload = token.split(".")[1]
    return dict(json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4))))


@dataclass
class IdentityEndpoint:
    identities: list[Identity]
    lifetime: int = 3600
    issued: list[Issued] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    on_issue: list[Callable[[Issued], Awaitable[None]]] = field(default_factory=list)
    url: str = ""
    _runner: web.AppRunner | None = None

    def _identity(self, client_id: str | None) -> Identity | None:
        if client_id:
            return next((i for i in self.identities if i.user_assigned and i.client_id == client_id), None)
        return next((i for i in self.identities if not i.user_assigned), None)

    async def _token(self, request: web.Request) -> web.Response:
        if request.headers.get("X-IDENTITY-HEADER") != HEADER_SECRET:
            return web.json_response({"error": "invalid_request"}, status=401)
        resource = request.query.get("resource", "")
        client_id = request.query.get("client_id")
        identity = self._identity(client_id)
        if identity is None:
            why = (
                f"No User Assigned or Delegated Managed Identity found for specified ClientId {client_id}"
                if client_id
                else "No system-assigned managed identity is enabled for this app"
            )
            self.refused.append(why)
            return web.json_response({"statusCode": 400, "message": why}, status=400)
        token, expires_on = make_token(identity, resource, self.lifetime)
        issued = Issued(resource, identity, token, expires_on)
        for callback in self.on_issue:
            await callback(issued)
        self.issued.append(issued)
        return web.json_response(
            {
                "access_token": token,
                "expires_on": str(expires_on),
                "resource": resource,
                "token_type": "Bearer",
                "client_id": identity.client_id,
            }
        )

    async def start(self) -> str:
        app = web.Application()
        app.router.add_get("/msi/token", self._token)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}/msi/token"
        return self.url

    def environment(self) -> dict[str, str]:
        """What the Functions host sets for the worker (and nothing that would pick another credential)."""
        return {"IDENTITY_ENDPOINT": self.url, "IDENTITY_HEADER": HEADER_SECRET}

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


#: variables that would make DefaultAzureCredential try something else first; cleared in tests
OTHER_CREDENTIAL_VARIABLES = (
    "AZURE_CLIENT_ID",
    "AZURE_CLIENT_SECRET",
    "AZURE_TENANT_ID",
    "AZURE_CLIENT_CERTIFICATE_PATH",
    "AZURE_USERNAME",
    "AZURE_FEDERATED_TOKEN_FILE",
    "MSI_ENDPOINT",
    "MSI_SECRET",
    "IDENTITY_SERVER_THUMBPRINT",
    "IMDS_ENDPOINT",
)
