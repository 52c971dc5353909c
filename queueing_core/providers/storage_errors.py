"""Azure Storage's refusals for want of a right, turned into one line that names what grants it.

A storage account answers 403 ``AuthorizationPermissionMismatch`` when the identity has no data role
that allows the request, and 403 ``KeyBasedAuthenticationNotPermitted`` when it is signed with the
account key while the account allows no shared key access (the Bicep turns it off).
"""

from __future__ import annotations

from typing import Any

from ..errors import MissingPermission

#: the least role that lets the kit use each service
DATA_ROLE = {"queue": "Storage Queue Data Contributor", "table": "Storage Table Data Contributor"}


def refusal(exc: Any, service: str, action: str) -> MissingPermission | None:
    """The kit's error for an azure-core ``HttpResponseError`` that is such a refusal, else None."""
    if getattr(exc, "status_code", None) != 403:
        return None
    code = getattr(exc, "error_code", None)
    response = getattr(exc, "response", None)
    if code is None and response is not None:
        code = response.headers.get("x-ms-error-code")
    if code == "AuthorizationPermissionMismatch":
        role = DATA_ROLE[service]
        return MissingPermission(
            f"Azure Storage refused {action} (403 {code}): the identity has no data role for "
            f"{service}s; grant it '{role}' on the account",
            right=f"{service} data",
            role=role,
        )
    if code == "KeyBasedAuthenticationNotPermitted":
        return MissingPermission(
            f"Azure Storage refused {action} (403 {code}): the account allows no shared key; connect with "
            "its managed identity (QueueingStorage__queueServiceUri, __tableServiceUri, __clientId) instead "
            "of a connection string",
            right="shared key",
            role=DATA_ROLE[service],
        )
    return None
