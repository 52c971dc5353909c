"""The Function App as a deployment of infra/main.bicep leaves it, for the runtime to start in.

``Provisioned`` holds one deployment (tests/infra/deployment.py, with main.bicepparam's values, as the
README deploys it) and turns what it gives the app into the worker's world:

- the app settings become the environment, with the Key Vault reference resolved as the platform
  resolves it: only through ``keyVaultReferenceIdentity``, and only if that identity holds a role that
  reads secrets on the vault the reference names;
- the identities the site has become the managed identity endpoint's (tests/identity_endpoint.py), so
  ``DefaultAzureCredential`` finds exactly those and nothing else;
- role assignments become what each stand-in enforces: the in-memory Service Bus (role assignments on
  the namespace), the storage gate (on the account), the PostgreSQL role the administrator creates.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from tests.identity_endpoint import Identity
from tests.infra.bicep_tools import API_KEY_VARIABLE, build_params, read_bicepparam
from tests.infra.deployment import Deployment, DeploymentRefused, UserAssignedIdentity

#: roles that may read secret values on a vault
SECRET_READERS = {
    "4633458b-17de-408a-b874-0445c86b69e6",  # Key Vault Secrets User
    "b86a8fe4-44ce-4948-aee5-eccb2c155cd7",  # Key Vault Secrets Officer
    "00482a5a-887f-4fb3-b363-3b7fe8e74483",  # Key Vault Administrator
}
API_KEY = "provisioned-ops-key"
_KEY_VAULT_REFERENCE = re.compile(
    r"@Microsoft\.KeyVault\(SecretUri=https://([^.]+)\.vault\.azure\.net/secrets/([^/)]+)/?\)"
)


@dataclass
class Provisioned:
    deployment: Deployment
    #: the app settings, Key Vault references resolved (tests may change them to show a drift fails)
    settings: dict[str, str] = field(default_factory=dict)
    #: (scope type, role definition id) taken away, to show a test fails without them
    removed_roles: set[tuple[str, str]] = field(default_factory=set)

    def remove_role(self, resource_type: str, role_definition_id: str) -> None:
        self.removed_roles.add((resource_type, role_definition_id))

    @classmethod
    def deploy(cls, **overrides: Any) -> Provisioned:
        # as the README deploys: main.bicepparam, the key from the environment, the rest on the command line
        parameters = build_params(read_bicepparam(), {API_KEY_VARIABLE: API_KEY}, overrides)
        deployment = Deployment(parameters)
        return cls(deployment, resolve_key_vault_references(deployment, deployment.app_settings))

    @property
    def identity(self) -> UserAssignedIdentity:
        [identity], system_assigned = self.deployment.identities()
        assert not system_assigned, "the app runs as its user-assigned identity only"
        return identity

    def endpoint_identities(self) -> list[Identity]:
        assigned, system_assigned = self.deployment.identities()
        out = [Identity(i.name, i.client_id, i.principal_id) for i in assigned]
        if system_assigned:
            out.append(Identity("system", "system-client", "system-principal", user_assigned=False))
        return out

    def roles_on(self, resource_type: str) -> dict[str, list[str]]:
        """principal id -> role definition ids on the (one) resource of that type."""
        out: dict[str, list[str]] = {}
        for a in self.deployment.role_assignments():
            if (
                a.scope.type == resource_type
                and (resource_type, a.role_definition_id) not in self.removed_roles
            ):
                out.setdefault(a.principal_id, []).append(a.role_definition_id)
        return out

    def flag(self, module: str, resource_type: str, name: str) -> Any:
        return self.deployment.resource_properties(module, resource_type)[name]


def resolve_key_vault_references(
    deployment: Deployment, settings: dict[str, str], *, without: frozenset[str] = frozenset()
) -> dict[str, str]:
    """What the platform hands the worker: each ``@Microsoft.KeyVault(SecretUri=...)`` setting replaced
    by the secret's value, read as ``keyVaultReferenceIdentity``; a reference it may not read stays
    unresolved (the platform then passes the reference text itself, as Azure does)."""
    site = deployment.site_properties
    reader = site.get("keyVaultReferenceIdentity")
    principal = next((i.principal_id for i in deployment.identities()[0] if i.resource.id == reader), None)
    out = dict(settings)
    for name, value in settings.items():
        m = _KEY_VAULT_REFERENCE.fullmatch(value)
        if m is None:
            continue
        vault, secret = m.groups()
        granted = {
            a.role_definition_id
            for a in deployment.role_assignments()
            if a.principal_id == principal
            and a.scope.type == "Microsoft.KeyVault/vaults"
            and a.scope.name == vault
        }
        if (granted - without) & SECRET_READERS:
            out[name] = _secret_value(deployment, vault, secret)
    return out


def _secret_value(deployment: Deployment, vault: str, secret: str) -> str:
    scope = deployment.scope_of("keyVault")
    for symbol, res in scope.doc["resources"].items():
        if (
            res["type"] == "Microsoft.KeyVault/vaults/secrets"
            and scope.resource(symbol).name == f"{vault}/{secret}"
        ):
            from tests.infra.bicep_tools import body

            return str(scope.eval(body(res)["properties"]["value"]))
    raise DeploymentRefused(f"no secret {secret} in vault {vault}")
