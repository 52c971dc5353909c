"""Where the cloud transports are: read from app settings the way the Azure Functions host reads
them (``<Conn>`` for a connection string, ``<Conn>__...`` for an identity-based connection).

No SDK is imported here, so indexing a Functions app can check its settings at no cost.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from .errors import ConfigurationError

STORAGE = "QueueingStorage"
SERVICE_BUS = "QueueingServiceBus"


def identity_credential(client_id: str | None = None) -> Any:
    """The async Entra credential every identity-based connection uses: ``DefaultAzureCredential``,
    which in Azure is the managed identity (the user-assigned one whose client id is given, else the
    system-assigned one) and locally the developer's ``az login``."""
    from azure.identity.aio import DefaultAzureCredential  # slow to import; only identity connections need it

    return DefaultAzureCredential(managed_identity_client_id=client_id)


def no_table_uri(name: str) -> ConfigurationError:
    """The error of an identity-based Storage connection ``name`` without its Tables' endpoint."""
    return ConfigurationError(
        f"{name}__tableServiceUri", "not set", "https://<account>.table.core.windows.net"
    )


@dataclass(frozen=True)
class StorageConnection:
    """Where the account is: a connection string, or service URIs used with an Entra identity."""

    connection_string: str | None = None
    queue_service_uri: str | None = None
    table_service_uri: str | None = None
    client_id: str | None = None

    @classmethod
    def from_environment(cls, name: str = STORAGE, env: dict[str, str] | None = None) -> StorageConnection:
        """Read ``<name>`` (connection string) or ``<name>__queueServiceUri`` / ``__tableServiceUri`` /
        ``__serviceUri`` / ``__accountName`` (identity), the names the Functions host uses too."""
        e = os.environ if env is None else env
        conn = e.get(name)
        account = e.get(f"{name}__accountName")
        queue_uri = e.get(f"{name}__queueServiceUri") or e.get(f"{name}__serviceUri")
        table_uri = e.get(f"{name}__tableServiceUri")
        if account and not queue_uri:
            queue_uri = f"https://{account}.queue.core.windows.net"
        if account and not table_uri:
            table_uri = f"https://{account}.table.core.windows.net"
        if not conn and not queue_uri:
            raise ConfigurationError(
                name,
                "not set",
                f"{name}=<connection string> or {name}__queueServiceUri=https://<account>"
                ".queue.core.windows.net (+ __tableServiceUri) for a managed identity",
            )
        if not conn and not table_uri:
            # the kit's tables (history, control state) need their own endpoint with an identity; the
            # host's queue trigger does not, so only this says it before the first invocation
            raise no_table_uri(name)
        if conn == "UseDevelopmentStorage=true":
            conn = _AZURITE
        return cls(
            conn or None,
            queue_uri if not conn else None,
            table_uri if not conn else None,
            e.get(f"{name}__clientId"),
        )

    def credential(self) -> Any:
        return identity_credential(self.client_id)


_AZURITE = (
    "DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;"
    "AccountKey=Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw==;"
    "BlobEndpoint=http://127.0.0.1:10000/devstoreaccount1;QueueEndpoint=http://127.0.0.1:10001/devstoreaccount1;"
    "TableEndpoint=http://127.0.0.1:10002/devstoreaccount1;"
)


@dataclass(frozen=True)
class ServiceBusConnection:
    connection_string: str | None = None
    fully_qualified_namespace: str | None = None
    client_id: str | None = None
    #: the app setting it was read from, which an error about it names
    setting: str = SERVICE_BUS

    @classmethod
    def from_environment(
        cls, name: str = SERVICE_BUS, env: dict[str, str] | None = None
    ) -> ServiceBusConnection:
        """``<name>`` (a connection string, or the emulator's ``UseDevelopmentEmulator=true`` one) or
        ``<name>__fullyQualifiedNamespace`` for a managed identity, as the Functions host reads them."""
        e = os.environ if env is None else env
        conn = e.get(name)
        fqns = e.get(f"{name}__fullyQualifiedNamespace")
        if not conn and not fqns:
            raise ConfigurationError(
                name,
                "not set",
                f"{name}=<connection string> or {name}__fullyQualifiedNamespace=<ns>.servicebus.windows.net",
            )
        return cls(conn or None, None if conn else fqns, e.get(f"{name}__clientId"), name)

    def clients(self) -> tuple[Any, Any, Any]:
        """(ServiceBusClient, ServiceBusAdministrationClient, credential to close or None)."""
        from azure.servicebus.aio import ServiceBusClient
        from azure.servicebus.aio.management import ServiceBusAdministrationClient

        from . import retry_policy

        policy = retry_policy.service_bus()
        if self.connection_string:
            try:
                client = ServiceBusClient.from_connection_string(self.connection_string, **policy)
            except ValueError as exc:
                # a malformed string stopped start-up with the SDK's traceback; its words (``Connection
                # string is either blank or malformed.``) name no part of the string, and are kept
                raise ConfigurationError(
                    self.setting,
                    f"invalid connection string: {exc}",
                    "Endpoint=sb://<namespace>.servicebus.windows.net/;SharedAccessKeyName=<name>;"
                    "SharedAccessKey=<key>, the emulator's ending ;UseDevelopmentEmulator=true",
                ) from None
            try:
                admin = ServiceBusAdministrationClient.from_connection_string(
                    self.connection_string, **policy
                )
            except ValueError:  # the emulator's string: no administration endpoint
                admin = None
            return client, admin, None
        assert self.fully_qualified_namespace is not None
        credential = identity_credential(self.client_id)
        return (
            ServiceBusClient(self.fully_qualified_namespace, credential, **policy),
            ServiceBusAdministrationClient(self.fully_qualified_namespace, credential, **policy),
            credential,
        )
