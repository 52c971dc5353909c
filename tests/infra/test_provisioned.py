"""One source of truth for what the app may do: per transport, the runtime starts with exactly the
identity, role assignments and app settings a deployment of infra/main.bicep gives the Function App
(main.bicepparam's values), against stand-ins that enforce them, and processes one message.

- Identity: the real ``DefaultAzureCredential``, against a managed identity endpoint that knows only the
  identities the site has (tests/identity_endpoint.py).
- Service Bus: the in-memory Service Bus with the namespace's role assignments; without Manage it
  answers management calls with the SDK's 401 (tests/unit/test_servicebus_rights.py holds that against
  the real client), without Send or Listen it refuses the link.
- Storage: the real SDKs over HTTPS to Azurite (OAuth on) behind a gate enforcing the account's
  ``allowSharedKeyAccess`` and the data roles (tests/storage_gate.py).
- PostgreSQL: a private scram-checking server; the app's role created by infra/postgres/app-role.sql as
  the administrator runs it; the role's password is each token the identity endpoint issues.

Each test also shows its teeth: the same run with one right or setting taken away fails there.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import os
import re
import shutil
import subprocess
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import azure.functions.queue as azq
import azure.servicebus.aio
import azure.servicebus.aio.management
import pytest
from psycopg import sql

from functions import build_app
from functions.host import FunctionsHost
from queueing_core.errors import MissingPermission, ProviderError
from queueing_core.fakes.servicebus import (
    FakeServiceBusAdministrationClient,
    FakeServiceBusClient,
    FakeServiceBusNamespace,
)
from queueing_core.loader import load_app
from queueing_core.settings import load_settings
from tests.functions.conftest import functions_of, user
from tests.functions.servicebus_host import host_delivers
from tests.identity_endpoint import OTHER_CREDENTIAL_VARIABLES, IdentityEndpoint, Issued
from tests.infra.bicep_tools import ROOT
from tests.infra.deployment import POSTGRES_SERVER_CHILD, DeploymentRefused
from tests.infra.provisioned import API_KEY, Provisioned
from tests.storage_gate import StorageGate
from tests.tls import sdk_trusts

SERVICE_BUS_SENDER = "69a216fc-b8fb-44d8-bc22-1f3c2cd27a39"
KEY_VAULT_SECRETS_USER = "4633458b-17de-408a-b874-0445c86b69e6"
STORAGE_TABLE_CONTRIBUTOR = "0a9a7e1f-b9d0-4cc4-a60d-0319b160aaa3"
STORAGE = "Microsoft.Storage/storageAccounts"
NAMESPACE = "Microsoft.ServiceBus/namespaces"
APP_ROLE_SQL = ROOT / "infra" / "postgres" / "app-role.sql"


def _iso_seconds(duration: str) -> float:
    m = re.fullmatch(r"P(?:(\d+)D)?T?(?:(\d+)H)?(?:(\d+)M)?(?:(\d+)S)?", duration)
    assert m, duration
    d, h, mi, s = (int(x or 0) for x in m.groups())
    return d * 86400 + h * 3600 + mi * 60 + s


# -- the worker's world: only its app settings and its identities -----------------------------------------


@contextlib.asynccontextmanager
async def worker_environment(
    monkeypatch: pytest.MonkeyPatch, prov: Provisioned, **endpoints: str
) -> AsyncIterator[IdentityEndpoint]:
    for key in list(os.environ):
        if key.startswith(("QUEUEING_", "Queueing", "AzureWebJobs", "APPLICATIONINSIGHTS")):
            monkeypatch.delenv(key)
    for key in OTHER_CREDENTIAL_VARIABLES:
        monkeypatch.delenv(key, raising=False)
    identity_endpoint = IdentityEndpoint(prov.endpoint_identities())
    await identity_endpoint.start()
    try:
        for key, value in {**prov.settings, **identity_endpoint.environment()}.items():
            for azure_url, local_url in endpoints.items():
                value = value.replace(azure_url, local_url)
            monkeypatch.setenv(key, value)
        yield identity_endpoint
    finally:
        await identity_endpoint.stop()


def the_host() -> tuple[FunctionsHost, dict[str, Any]]:
    """What function_app.py builds from the environment, keeping a handle on its host."""
    cfg = load_settings()
    qapp = load_app(cfg.app, setting="QUEUEING_APP")
    host = FunctionsHost(qapp, cfg)
    return host, functions_of(build_app(cfg, qapp, host=host))


def an_order() -> Any:
    from queueing_core.examples.orders import OrderLine, OrderPlaced

    return OrderPlaced(
        order_id="ord-provisioned",
        customer_email="ada@example.com",
        lines=[OrderLine(sku="BOOK-42", quantity=1, unit_price_cents=2599)],
        payment_token="tok_visa",
    )


# -- Service Bus ----------------------------------------------------------------------------------------


@dataclass
class StorageWorld:
    queue: StorageGate
    table: StorageGate


@contextlib.asynccontextmanager
async def storage_account(prov: Provisioned, azurite_oauth: Any, certs: Any) -> AsyncIterator[StorageWorld]:
    """The account as the deployment leaves it: its flag, its role assignments, its queues and tables."""
    from azure.data.tables.aio import TableServiceClient
    from azure.storage.queue.aio import QueueServiceClient

    allow = prov.flag("storage", STORAGE, "allowSharedKeyAccess")
    roles = prov.roles_on(STORAGE)
    gates = StorageWorld(
        *(
            StorageGate(service, upstream, certs.client_context(), certs.server_context(), allow, roles)
            for service, upstream in (
                ("queue", azurite_oauth.queue_endpoint),
                ("table", azurite_oauth.table_endpoint),
            )
        )
    )
    for gate in (gates.queue, gates.table):
        await gate.start()
    # the deployment creates the queues (each with its -poison queue) and the tables: as the account
    # owner, straight to Azurite, not through the app's gate
    storage = prov.deployment.scope_of("storage")
    with sdk_trusts(certs):
        async with QueueServiceClient.from_connection_string(azurite_oauth.connection_string) as qs:
            for name in storage.lookup("queues"):
                for queue_name in (name, f"{name}-poison"):
                    with contextlib.suppress(Exception):
                        await qs.create_queue(queue_name)
        async with TableServiceClient.from_connection_string(azurite_oauth.connection_string) as ts:
            for table in (storage.lookup("controlTableName"), storage.lookup("trackerTableName")):
                await ts.create_table_if_not_exists(table)
    try:
        yield gates
    finally:
        for gate in (gates.queue, gates.table):
            await gate.stop()


def _storage_endpoints(prov: Provisioned, gates: StorageWorld) -> dict[str, str]:
    return {
        prov.settings["QueueingStorage__queueServiceUri"]: gates.queue.endpoint,
        prov.settings["QueueingStorage__tableServiceUri"]: gates.table.endpoint,
    }


def _namespace(prov: Provisioned) -> FakeServiceBusNamespace:
    """The namespace as the deployment leaves it: its queues and its role assignments."""
    fqns = prov.settings["QueueingServiceBus__fullyQualifiedNamespace"]
    ns = FakeServiceBusNamespace(fully_qualified_namespace=fqns, role_assignments=prov.roles_on(NAMESPACE))
    from datetime import timedelta

    for q in prov.deployment.scope_of("serviceBus").lookup("queues"):
        ns._queues[q["name"].lower()] = _provisioned_queue(ns, q, timedelta)
    return ns


def _provisioned_queue(ns: FakeServiceBusNamespace, q: dict[str, Any], timedelta: Any) -> Any:
    from queueing_core.fakes import servicebus as fake

    settings = fake._Settings().updated(
        {
            "max_delivery_count": q["maxDeliveryCount"],
            "lock_duration": timedelta(seconds=_iso_seconds(q["lockDuration"])),
            "default_message_time_to_live": timedelta(seconds=_iso_seconds(q["defaultMessageTimeToLive"])),
            "dead_lettering_on_message_expiration": True,
            "requires_duplicate_detection": q["requiresDuplicateDetection"],
        }
    )
    return fake._Queue(q["name"], settings, ns.now())


def _sdk_clients_on(monkeypatch: pytest.MonkeyPatch, ns: FakeServiceBusNamespace) -> None:
    """``ServiceBusClient(fqns, credential)`` and its administration client reach the in-memory namespace."""

    def client(fully_qualified_namespace: str, credential: Any, **kwargs: Any) -> FakeServiceBusClient:
        assert fully_qualified_namespace == ns.fully_qualified_namespace
        return FakeServiceBusClient(ns, credential=credential)

    def admin(
        fully_qualified_namespace: str, credential: Any, **kwargs: Any
    ) -> FakeServiceBusAdministrationClient:
        assert fully_qualified_namespace == ns.fully_qualified_namespace
        return FakeServiceBusAdministrationClient(ns, credential=credential)

    monkeypatch.setattr(azure.servicebus.aio, "ServiceBusClient", client)
    monkeypatch.setattr(azure.servicebus.aio.management, "ServiceBusAdministrationClient", admin)


@dataclass
class CloudWorker:
    host: FunctionsHost
    fns: dict[str, Any]
    gates: StorageWorld
    identities: IdentityEndpoint


@contextlib.asynccontextmanager
async def cloud_worker(prov: Provisioned, monkeypatch, azurite_oauth, certs) -> AsyncIterator[CloudWorker]:
    """The storage account and the worker's environment as deployed, the Functions app built in it."""
    async with (
        storage_account(prov, azurite_oauth, certs) as gates,
        worker_environment(monkeypatch, prov, **_storage_endpoints(prov, gates)) as identities,
    ):
        with sdk_trusts(certs):
            host, fns = the_host()
            try:
                yield CloudWorker(host, fns, gates, identities)
            finally:
                await host.close()


async def run_servicebus(prov: Provisioned, monkeypatch, azurite_oauth, certs) -> dict[str, Any]:
    ns = _namespace(prov)
    _sdk_clients_on(monkeypatch, ns)
    from queueing_core.connections import identity_credential
    from queueing_core.ops.service import OpsService

    async with cloud_worker(prov, monkeypatch, azurite_oauth, certs) as w:
        rt = await w.host.runtime()  # opens with exactly the provisioned rights
        sent = await w.host.app.enqueue(an_order())
        # the Functions host receives as the same identity (the trigger's connection)
        credential = identity_credential(os.environ["QueueingServiceBus__clientId"])  # noqa: SIM112
        listener = FakeServiceBusClient(ns, credential=credential)
        async with listener.get_queue_receiver(rt.provider.physical("order-placed")) as receiver:
            actions = await host_delivers(receiver, user(w.fns["servicebus_order_placed"]))
        await credential.close()
        record = await rt.tracker.get(sent.message_id)
        api_key = w.host.settings.api_key
        return {
            "actions": [a for a, _, _ in actions.done],
            "status": record.status if record else None,
            "gates": w.gates,
            "identities": w.identities,
            "summary": await OpsService(rt).summary(),
            "api_key": api_key.get_secret_value() if api_key else None,
        }


async def test_servicebus_runs_with_exactly_the_provisioned_rights(
    monkeypatch, azurite_oauth, test_certificates, caplog
):
    prov = Provisioned.deploy(queueingProvider="servicebus")
    # what the deployment gives: no Manage on the namespace, no shared keys, one user-assigned identity
    assert prov.flag("serviceBus", NAMESPACE, "disableLocalAuth") is True
    assert prov.flag("storage", STORAGE, "allowSharedKeyAccess") is False
    assert prov.settings["QUEUEING_SERVICEBUS_CREATE_QUEUES"] == "false"
    with caplog.at_level(logging.WARNING):
        done = await run_servicebus(prov, monkeypatch, azurite_oauth, test_certificates)
    assert done["actions"] == ["complete"]
    assert done["status"] == "Succeeded"
    assert done["gates"].queue.refused == []
    assert done["gates"].table.refused == []
    assert done["gates"].table.passed > 0  # the history went to the table, as the identity
    assert {i.identity.client_id for i in done["identities"].issued} == {prov.identity.client_id}
    assert done["api_key"] == API_KEY  # the Key Vault reference, resolved for the identity
    # GET stats without Manage: counted by peeking, and said so
    assert any("peeking" in n for n in done["summary"].notes)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


SERVICEBUS_DRIFTS: dict[str, tuple[Callable[[Provisioned], None], type[BaseException], str]] = {
    # the bootstrap loses the client id: DefaultAzureCredential asks for a system-assigned identity
    "no QueueingServiceBus__clientId": (
        lambda p: p.settings.pop("QueueingServiceBus__clientId"),
        ProviderError,
        "signing in to Service Bus failed",
    ),
    # the Tables client ignores QueueingStorage__clientId (the old bug): the same, on the history
    "no QueueingStorage__clientId": (
        lambda p: p.settings.pop("QueueingStorage__clientId"),
        ProviderError,
        "Azure Tables",
    ),
    # the Bicep stops granting Data Sender: the app's first enqueue is refused, naming the role
    "no Data Sender role": (
        lambda p: p.remove_role(NAMESPACE, SERVICE_BUS_SENDER),
        MissingPermission,
        "Azure Service Bus Data Sender",
    ),
}


async def test_creating_queues_without_manage_is_one_line_naming_the_role_not_a_crash_loop(
    monkeypatch, azurite_oauth, test_certificates, caplog
):
    prov = Provisioned.deploy(queueingProvider="servicebus")
    prov.settings["QUEUEING_SERVICEBUS_CREATE_QUEUES"] = "true"  # the default a local setup uses
    with caplog.at_level(logging.ERROR, logger="queueing.servicebus"):
        done = await run_servicebus(prov, monkeypatch, azurite_oauth, test_certificates)
    assert done["status"] == "Succeeded"  # the runtime opened anyway and processed the message
    # the kit's own error lines (asyncio's report of a task an earlier test left behind, collected by
    # the garbage collector during this one, is no line of this test's)
    [line] = [
        r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR and r.name.startswith("queueing")
    ]
    assert "Azure Service Bus Data Owner" in line
    assert "QUEUEING_SERVICEBUS_CREATE_QUEUES=false" in line


# -- Storage Queues -------------------------------------------------------------------------------------


async def run_storage(prov: Provisioned, monkeypatch, azurite_oauth, certs) -> dict[str, Any]:
    from azure.storage.queue.aio import QueueClient

    from queueing_core.connections import identity_credential

    async with cloud_worker(prov, monkeypatch, azurite_oauth, certs) as w:
        rt = await w.host.runtime()
        sent = await w.host.app.enqueue(an_order())
        # the Functions host's queue listener, as the same identity (the trigger's connection)
        credential = identity_credential(os.environ["QueueingStorage__clientId"])  # noqa: SIM112
        physical = rt.provider.physical("order-placed")
        async with QueueClient(w.gates.queue.endpoint, physical, credential=credential) as client:
            [m] = [m async for m in client.receive_messages(max_messages=1, visibility_timeout=30)]
            await user(w.fns["queue_order_placed"])(
                azq.QueueMessage(
                    id=m.id,
                    body=base64.b64decode(m.content),
                    dequeue_count=m.dequeue_count,
                    pop_receipt=m.pop_receipt,
                    insertion_time=m.inserted_on,
                )
            )
            await client.delete_message(m.id, m.pop_receipt)  # the host, on a normal return
        await credential.close()
        record = await rt.tracker.get(sent.message_id)
        return {"status": record.status if record else None, "gates": w.gates, "identities": w.identities}


async def test_storage_queues_run_with_exactly_the_provisioned_rights(
    monkeypatch, azurite_oauth, test_certificates
):
    prov = Provisioned.deploy(queueingProvider="storage_queue")
    assert prov.flag("storage", STORAGE, "allowSharedKeyAccess") is False
    done = await run_storage(prov, monkeypatch, azurite_oauth, test_certificates)
    assert done["status"] == "Succeeded"
    assert done["gates"].queue.refused == []
    assert done["gates"].table.refused == []
    assert done["gates"].queue.passed > 0
    assert done["gates"].table.passed > 0
    assert {i.identity.client_id for i in done["identities"].issued} == {prov.identity.client_id}


STORAGE_DRIFTS: dict[str, tuple[Callable[[Provisioned], None], type[BaseException], str]] = {
    # the Bicep stops granting Table Data Contributor: the history write is refused by the account
    "no Table Data Contributor role": (
        lambda p: p.remove_role(STORAGE, STORAGE_TABLE_CONTRIBUTOR),
        MissingPermission,
        "grant it 'Storage Table Data Contributor'",
    ),
    # the app setting falls back to a connection string (shared key): the account refuses it
    "a connection string instead of the identity": (
        lambda p: p.settings.update(
            QueueingStorage=(
                "DefaultEndpointsProtocol=https;AccountName=devstoreaccount1;"
                "AccountKey=Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw==;"
                f"QueueEndpoint={p.settings['QueueingStorage__queueServiceUri']};"
                f"TableEndpoint={p.settings['QueueingStorage__tableServiceUri']};"
            )
        ),
        MissingPermission,
        "KeyBasedAuthenticationNotPermitted",
    ),
}


def test_the_api_key_reaches_the_app_only_through_the_identitys_key_vault_role():
    from functions import usable_api_key
    from queueing_core.settings import QueueingSettings
    from tests.infra.provisioned import resolve_key_vault_references

    prov = Provisioned.deploy()
    assert prov.deployment.app_settings["QUEUEING_API_KEY"].startswith(
        "@Microsoft.KeyVault(SecretUri=https://"
    )
    assert prov.settings["QUEUEING_API_KEY"] == API_KEY  # resolved: the identity holds Secrets User
    unresolved = resolve_key_vault_references(
        prov.deployment, prov.deployment.app_settings, without=frozenset({KEY_VAULT_SECRETS_USER})
    )["QUEUEING_API_KEY"]
    assert unresolved == prov.deployment.app_settings["QUEUEING_API_KEY"]
    assert usable_api_key(QueueingSettings(api_key=unresolved)) is None  # the reference text opens nothing
    assert usable_api_key(QueueingSettings(api_key=API_KEY)) == API_KEY


CLOUD_DRIFTS = {
    **{("servicebus", name): drift for name, drift in SERVICEBUS_DRIFTS.items()},
    **{("storage_queue", name): drift for name, drift in STORAGE_DRIFTS.items()},
}


@pytest.mark.parametrize(("transport", "drift"), list(CLOUD_DRIFTS), ids=lambda v: str(v))
async def test_cloud_transports_fail_when_the_bicep_or_the_bootstrap_drifts(
    transport, drift, monkeypatch, azurite_oauth, test_certificates
):
    change, error, says = CLOUD_DRIFTS[(transport, drift)]
    prov = Provisioned.deploy(queueingProvider=transport)
    change(prov)
    run = run_servicebus if transport == "servicebus" else run_storage
    with pytest.raises(error, match=re.escape(says)):
        await run(prov, monkeypatch, azurite_oauth, test_certificates)


# -- SQL (PostgreSQL) -----------------------------------------------------------------------------------

#: Azure's pgaadauth_create_principal creates a login role and maps it to the Entra principal of that
#: name; this stand-in does the first half (the mapping is Azure's, and cannot exist here). Whether it
#: runs with its caller's rights or its owner's is Azure's affair: the file must work either way.
PGAADAUTH_STAND_IN = """
CREATE OR REPLACE FUNCTION pgaadauth_create_principal(roleName text, isAdmin boolean, isMfa boolean)
RETURNS text LANGUAGE plpgsql {security} AS $$
BEGIN
  EXECUTE format('CREATE ROLE %I LOGIN', roleName);
  RETURN format('Created role for "%s"', roleName);
END $$
"""

#: the server's administrators as the file may meet them: the local superuser, and the Microsoft Entra
#: administrator as Azure makes one: no superuser ("only Microsoft is part of the super user role"),
#: CREATEROLE and CREATEDB, a member of azure_pg_admin
#: (learn.microsoft.com/azure/postgresql/flexible-server/how-to-create-users). CREATE SCHEMA ...
#: AUTHORIZATION <app role> failed as the latter, who is no member of the role it created.
ADMINS = {
    "superuser": ("postgres", "SECURITY INVOKER"),
    "entra-admin": ("dba@contoso.example", "SECURITY INVOKER"),
    "entra-admin-definer-rights": ("dba@contoso.example", "SECURITY DEFINER"),
}
ENTRA_ADMIN_PASSWORD = "entra-admin-token-stand-in"


def run_app_role_sql(scram_postgres, prov: Provisioned, admin: str = "entra-admin") -> None:
    """infra/postgres/app-role.sql, by psql, as ``admin`` runs it (one of :data:`ADMINS`)."""
    psql = shutil.which("psql")
    if psql is None:
        pytest.skip("psql is not installed")
    user = ADMINS[admin][0]
    password = scram_postgres.superuser_password if user == "postgres" else ENTRA_ADMIN_PASSWORD
    conninfo = f"host={scram_postgres.host} port={scram_postgres.port} dbname=postgres user={user}"
    done = subprocess.run(
        [
            psql, conninfo,
            "-v", f"app_role={prov.deployment.output('postgresAppRole')}",
            "-v", f"database={prov.deployment.scope_of('postgres').lookup('databaseName')}",
            "-v", f"schema={prov.deployment.output('postgresSchema')}",
            "-f", str(APP_ROLE_SQL),
        ],
        env={**os.environ, "PGPASSWORD": password},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr


#: stands in for azuresu, the platform's superuser, which owns a database ARM creates while the server
#: has no Entra administrator (no login: only Microsoft signs in as it)
PLATFORM_SUPERUSER = "azuresu"


def database_owner(prov: Provisioned, admin: str) -> str:
    """Who owns the kit's database, from the order the deployment creates things in: the Entra
    administrator when ARM creates the database after it, azuresu when before (or at the same time:
    then it is a race), as Azure/bicep-registry-modules#3596 and hashicorp/terraform-provider-azurerm#27895
    report. The local superuser stands in for the administrator in the ``superuser`` case."""
    children = [r for r in prov.deployment.all_resources() if r.type.startswith(POSTGRES_SERVER_CHILD)]
    [database] = [r for r in children if r.type == POSTGRES_SERVER_CHILD + "databases"]
    administrators = {r for r in children if r.type == POSTGRES_SERVER_CHILD + "administrators"}
    if administrators and administrators <= prov.deployment.created_before(database):
        return ADMINS[admin][0]
    return PLATFORM_SUPERUSER


@contextlib.contextmanager
def postgres_server(scram_postgres, prov: Provisioned, admin: str = "entra-admin"):
    """The server as the deployment leaves it: Entra only (here: passwords checked), its Entra
    administrator ``admin``, and the kit's database, owned as the order the deployment declares makes
    it (:func:`database_owner`)."""
    database = prov.deployment.scope_of("postgres").lookup("databaseName")
    role = prov.deployment.output("postgresAppRole")
    user, security = ADMINS[admin]
    created_group = not scram_postgres.run("SELECT 1 FROM pg_roles WHERE rolname = 'azure_pg_admin'")
    if created_group:
        scram_postgres.run("CREATE ROLE azure_pg_admin NOLOGIN")
    if user != "postgres":
        scram_postgres.run(
            sql.SQL(
                "CREATE ROLE {} LOGIN NOSUPERUSER CREATEROLE CREATEDB INHERIT PASSWORD {}"
                " IN ROLE azure_pg_admin"
            ).format(sql.Identifier(user), sql.Literal(ENTRA_ADMIN_PASSWORD))
        )
    owner = database_owner(prov, admin)
    created_platform = owner == PLATFORM_SUPERUSER and not scram_postgres.run(
        "SELECT 1 FROM pg_roles WHERE rolname = %s", PLATFORM_SUPERUSER
    )
    if created_platform:
        scram_postgres.run(sql.SQL("CREATE ROLE {} SUPERUSER NOLOGIN").format(sql.Identifier(owner)))
    scram_postgres.run(
        sql.SQL("CREATE DATABASE {} OWNER {}").format(sql.Identifier(database), sql.Identifier(owner))
    )
    scram_postgres.run(PGAADAUTH_STAND_IN.format(security=security))
    try:
        yield database, role
    finally:
        scram_postgres.run("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", role)
        scram_postgres.run(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(database))
        )
        scram_postgres.run(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(role)))
        if user != "postgres":
            scram_postgres.run(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(user)))
        if created_platform:
            scram_postgres.run(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(PLATFORM_SUPERUSER)))
        if created_group:
            scram_postgres.run("DROP ROLE IF EXISTS azure_pg_admin")
        scram_postgres.run("DROP FUNCTION IF EXISTS pgaadauth_create_principal(text, boolean, boolean)")


def _local_database_url(prov: Provisioned, scram_postgres) -> dict[str, str]:
    """The server's host name to the local server's; the scram server here speaks no TLS, so
    ``sslmode=require`` goes (TLS to Azure is the one thing this test does not show)."""
    server = prov.deployment.output("postgresFullyQualifiedDomainName")
    return {f"@{server}:5432/": f"@{scram_postgres.host}:{scram_postgres.port}/", "?sslmode=require": ""}


async def run_sql(
    prov: Provisioned, monkeypatch, scram_postgres, *, create_role: bool = True
) -> dict[str, Any]:
    from azure.functions.timer import TimerRequest

    with postgres_server(scram_postgres, prov) as (_database, role):
        if create_role:
            run_app_role_sql(scram_postgres, prov)

        async def token_is_the_password(issued: Issued) -> None:
            # what the Entra-enabled server accepts: a current token of the identity mapped to the role
            if issued.resource != "https://ossrdbms-aad.database.windows.net" or issued.identity.name != role:
                return
            exists = "SELECT 1 FROM pg_roles WHERE rolname = %s"
            if await asyncio.to_thread(scram_postgres.run, exists, role):  # no role: the token is refused
                alter = sql.SQL("ALTER ROLE {} PASSWORD {}").format(
                    sql.Identifier(role), sql.Literal(issued.token)
                )
                await asyncio.to_thread(scram_postgres.run, alter)

        async with worker_environment(
            monkeypatch, prov, **_local_database_url(prov, scram_postgres)
        ) as identities:
            identities.on_issue.append(token_is_the_password)
            host, fns = the_host()
            try:
                rt = await host.runtime()  # signs in with a token, migrates in the role's own schema
                sent = await host.app.enqueue(an_order())
                await user(fns["queueing_sql_processor"])(TimerRequest(past_due=False))
                record = await rt.tracker.get(sent.message_id)
                counts = await rt.tracker.counts()
                return {
                    "status": record.status if record else None,
                    "identities": identities,
                    "counts": counts,
                }
            finally:
                await host.close()


@pytest.mark.parametrize("admin", list(ADMINS))
def test_the_app_role_sql_grants_least_privilege(scram_postgres, admin):
    prov = Provisioned.deploy(**SQL_DEPLOYMENT)
    with postgres_server(scram_postgres, prov, admin) as (database, role):
        run_app_role_sql(scram_postgres, prov, admin)
        run_app_role_sql(scram_postgres, prov, admin)  # again: nothing changes, nothing fails
        schema = prov.deployment.output("postgresSchema")
        [(superuser, createdb, createrole, bypassrls, login)] = scram_postgres.run(
            "SELECT rolsuper, rolcreatedb, rolcreaterole, rolbypassrls, rolcanlogin"
            " FROM pg_roles WHERE rolname = %s",
            role,
        )
        assert (superuser, createdb, createrole, bypassrls, login) == (False, False, False, False, True)
        # the administrator keeps the schema; the app may use it and create its objects there
        [(owner, usage, create)] = scram_postgres.run(
            "SELECT pg_get_userbyid(nspowner), has_schema_privilege(%s, nspname, 'USAGE'),"
            " has_schema_privilege(%s, nspname, 'CREATE') FROM pg_namespace WHERE nspname = %s",
            role, role, schema, database=database,
        )  # fmt: skip
        assert (owner, usage, create) == (ADMINS[admin][0], True, True)
        [(create_db, create_public, usage_other)] = scram_postgres.run(
            "SELECT has_database_privilege(%s, current_database(), 'CREATE'),"
            " has_schema_privilege(%s, 'public', 'CREATE'),"
            " has_schema_privilege(%s, 'pg_catalog', 'CREATE')",
            role, role, role, database=database,
        )  # fmt: skip
        assert (create_db, create_public, usage_other) == (False, False, False)
        # the app is not the server's Entra administrator: that is the deployer's parameter
        server = prov.deployment.scope_of("postgres")
        assert server.lookup("adminPrincipalName") == SQL_DEPLOYMENT["postgresAdminName"]
        assert server.lookup("adminPrincipalId") != prov.identity.principal_id
        # the administrator owns the database: ARM created it after the administrator
        [(owner,)] = scram_postgres.run(
            "SELECT pg_get_userbyid(datdba) FROM pg_database WHERE datname = %s", database
        )
        assert owner == ADMINS[admin][0]


SQL_DEPLOYMENT = {
    "queueingProvider": "sql",
    "deployPostgres": True,
    "postgresAdminObjectId": "5f1e0e8e-0000-4000-8000-00000000ad01",
    "postgresAdminName": "dba@contoso.example",
}


async def test_sql_runs_with_exactly_the_provisioned_role_and_sign_in(monkeypatch, scram_postgres):
    prov = Provisioned.deploy(**SQL_DEPLOYMENT)
    assert prov.deployment.resource_properties("postgres", "Microsoft.DBforPostgreSQL/flexibleServers")[
        "authConfig"
    ] == {
        "activeDirectoryAuth": "Enabled",
        "passwordAuth": "Disabled",
        "tenantId": prov.deployment.main.eval({"function": {"type": "tenant"}})["tenantId"],
    }
    done = await run_sql(prov, monkeypatch, scram_postgres)
    assert done["status"] == "Succeeded"
    # the handler's follow-ups went through the same role and were processed in the same tick
    assert {status for (_queue, status) in done["counts"]} == {"Succeeded"}
    issued = {(i.resource, i.identity.client_id) for i in done["identities"].issued}
    assert issued == {("https://ossrdbms-aad.database.windows.net", prov.identity.client_id)}


SQL_DRIFTS: dict[str, tuple[Callable[[Provisioned], None], dict[str, Any], type[BaseException], str]] = {
    # the bootstrap loses the client id: no token for a system-assigned identity the app does not have
    "no QUEUEING_DATABASE_CLIENT_ID": (
        lambda p: p.settings.pop("QUEUEING_DATABASE_CLIENT_ID"),
        {},
        ProviderError,
        "no Microsoft Entra token for PostgreSQL",
    ),
    # the administrator never runs app-role.sql: the server knows no such role
    "no app role": (lambda p: None, {"create_role": False}, ProviderError, "password authentication failed"),
}


@pytest.mark.parametrize("drift", list(SQL_DRIFTS))
async def test_sql_fails_when_the_bicep_or_the_bootstrap_drifts(drift, monkeypatch, scram_postgres):
    change, options, error, says = SQL_DRIFTS[drift]
    prov = Provisioned.deploy(**SQL_DEPLOYMENT)
    prov.settings["QUEUEING_CONNECT_RETRIES"] = "0"
    change(prov)
    with pytest.raises(error, match=re.escape(says)):
        await run_sql(prov, monkeypatch, scram_postgres, **options)


def test_sql_without_a_database_is_refused_by_the_template():
    with pytest.raises(DeploymentRefused, match="queueingProvider=sql needs a database"):
        Provisioned.deploy(queueingProvider="sql")
    with pytest.raises(DeploymentRefused, match="needs postgresAdminObjectId and postgresAdminName"):
        Provisioned.deploy(queueingProvider="sql", deployPostgres=True)
