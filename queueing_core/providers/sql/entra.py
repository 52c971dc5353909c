"""Microsoft Entra sign-in for Azure Database for PostgreSQL: an access token is the password.

A server with password authentication off (the Bicep deploys it so) accepts a token for the scope
below as the password of the role mapped to the identity. The kit asks the credential for a token for
every new connection (both engines' pools and each LISTEN connection): the credential keeps the token
while it is fresh and fetches a new one before it expires (azure-identity refreshes five minutes
ahead), so a long-running worker never opens a connection with an expired token, and connections
already open stay open (the server checks the token only when one signs in).
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from sqlalchemy.engine import URL

from ...errors import ConfigurationError, ProviderError

log = logging.getLogger("queueing.sql")

#: the resource Azure Database for PostgreSQL accepts tokens for
SCOPE = "https://ossrdbms-aad.database.windows.net/.default"
#: the host names of Azure Database for PostgreSQL servers (flexible and single server, public cloud)
AZURE_HOST_SUFFIX = ".postgres.database.azure.com"

DatabaseAuth = Literal["auto", "entra", "password"]


def uses_entra(url: URL, mode: DatabaseAuth = "auto") -> bool:
    """Whether connections to ``url`` sign in with an Entra token (``QUEUEING_DATABASE_AUTH``)."""
    if url.get_backend_name() != "postgresql" or mode == "password":
        return False
    if mode == "entra":
        if url.password is not None:
            raise ConfigurationError(
                "QUEUEING_DATABASE_URL",
                "has a password, but QUEUEING_DATABASE_AUTH=entra signs in with a token",
                "a URL without a password",
            )
        return True
    return url.password is None and (url.host or "").lower().endswith(AZURE_HOST_SUFFIX)


class EntraPassword:
    """An async callable giving the password for the next connection: a current access token.

    ``credential`` is any async Azure token credential; without one it is ``DefaultAzureCredential``
    (the managed identity in Azure: the user-assigned one whose ``client_id`` is given, from
    ``QUEUEING_DATABASE_CLIENT_ID``), created on first use and closed by :meth:`close`.
    """

    def __init__(self, credential: Any = None, *, client_id: str | None = None) -> None:
        self._credential = credential
        self._owned = credential is None
        self._client_id = client_id

    async def __call__(self) -> str:
        if self._credential is None:
            from ...connections import identity_credential

            self._credential = identity_credential(self._client_id)
        try:
            token = await self._credential.get_token(SCOPE)
        except Exception as exc:  # azure-identity's errors run to many lines: one is enough to act on
            text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            who = f"the managed identity {self._client_id}" if self._client_id else "DefaultAzureCredential"
            raise ProviderError(f"no Microsoft Entra token for PostgreSQL from {who}: {text}") from None
        return str(token.token)

    async def close(self) -> None:
        if self._owned and self._credential is not None:
            await self._credential.close()
            self._credential = None
