"""Microsoft Entra sign-in to PostgreSQL, against a real PostgreSQL that checks passwords (scram).

Azure Database for PostgreSQL with password authentication off accepts a current access token as the
password of the role mapped to the identity. Here a role's password is set to each token the identity
issues, so a connection signs in only with the token current on the server, and a wrong or stale one
is refused by the server itself.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass

import psycopg
import pytest
import sqlalchemy as sa
from azure.core.credentials import AccessToken
from psycopg import sql

from queueing_core import QueueingApp, QueueMessage, queue
from queueing_core.errors import ProviderError
from queueing_core.providers.sql import SqlProvider
from queueing_core.providers.sql.entra import SCOPE, uses_entra
from queueing_core.runtime import Runtime
from tests.identity_endpoint import OTHER_CREDENTIAL_VARIABLES, Identity, IdentityEndpoint, Issued


@queue("entra-jobs")
class EntraJob(QueueMessage):
    n: int = 0


def _role(scram_postgres, name: str, password: str) -> str:
    """A login role owning a schema of its own (nothing else), signed in to with ``password``."""
    scram_postgres.run(
        sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(sql.Identifier(name), sql.Literal(password))
    )
    schema = f"s_{uuid.uuid4().hex[:8]}"
    scram_postgres.run(
        sql.SQL("CREATE SCHEMA {} AUTHORIZATION {}").format(sql.Identifier(schema), sql.Identifier(name))
    )
    return schema


def _set_password(scram_postgres, name: str, password: str) -> None:
    scram_postgres.run(
        sql.SQL("ALTER ROLE {} PASSWORD {}").format(sql.Identifier(name), sql.Literal(password))
    )


def _drop(scram_postgres, name: str, schema: str) -> None:
    # idle connections a test let go of with dispose(close=False) may still be open
    scram_postgres.run("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", name)
    scram_postgres.run(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
    scram_postgres.run(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(name)))


@dataclass
class RotatingCredential:
    """A credential stand-in whose token the test rotates; it records what it was asked."""

    token: str
    scopes_asked: list[tuple[str, ...]]

    async def get_token(self, *scopes: str, **kwargs: object) -> AccessToken:
        self.scopes_asked.append(scopes)
        return AccessToken(self.token, int(time.time()) + 3600)

    async def close(self) -> None:
        pass


def test_entra_is_used_for_azure_hosts_without_a_password_or_when_asked():
    from sqlalchemy.engine import make_url

    azure = make_url("postgresql+psycopg://func-app@psql-x.postgres.database.azure.com:5432/queueing")
    assert uses_entra(azure)
    assert not uses_entra(azure.set(password="pw"))
    assert not uses_entra(make_url("postgresql://postgres@127.0.0.1/test"))
    assert uses_entra(make_url("postgresql://app@127.0.0.1/test"), "entra")
    assert not uses_entra(azure, "password")
    assert not uses_entra(make_url("sqlite:///x.db"), "entra")


async def test_every_new_connection_signs_in_with_the_current_token(scram_postgres):
    name = f"entra_{uuid.uuid4().hex[:8]}"
    first = f"token-a-{uuid.uuid4().hex}"
    schema = _role(scram_postgres, name, first)
    credential = RotatingCredential(first, [])
    url = scram_postgres.url(name)  # no password in the URL
    # relaxed claims: their own pool, so both pools are seen signing in with a rotated token
    provider = SqlProvider(
        url, schema=schema, database_auth="entra", credential=credential, durable_claims=False
    )
    app = QueueingApp("entra")
    done: list[int] = []

    @app.handler()
    async def handle(msg: EntraJob) -> None:
        done.append(msg.n)

    rt = Runtime(app, provider)
    try:
        await rt.open()  # migrates, and starts LISTEN: all on the first token
        assert set(credential.scopes_asked) == {(SCOPE,)}
        assert provider._listener is not None
        assert provider._listener.connected.is_set()
        async with provider.engine.connect() as held, provider.claims.connect() as held_claims:
            await held.execute(sa.text("SELECT 1"))
            await held_claims.execute(sa.text("SELECT 1"))

            # the token rotates: the server now accepts only the new one
            second = f"token-b-{uuid.uuid4().hex}"
            credential.token = second
            _set_password(scram_postgres, name, second)
            with pytest.raises(psycopg.OperationalError, match="password authentication failed"):
                await psycopg.AsyncConnection.connect(scram_postgres.url(name, first))

            # connections already open keep working ...
            assert (await held.execute(sa.text("SELECT 2"))).scalar() == 2
            assert (await held_claims.execute(sa.text("SELECT 3"))).scalar() == 3
            # ... and new ones, in both engines' pools, sign in with the new token
            asked = len(credential.scopes_asked)
            await provider.engine.dispose(close=False)  # forget idle connections: the next one is new
            await provider.claims.dispose(close=False)
            await app.enqueue(EntraJob(n=1))
            [delivery] = await provider.receive(app.subscription("EntraJob"), 1)
            settlement = await rt.process(delivery)
            await provider.settle([settlement])
            assert done == [1]
            assert len(credential.scopes_asked) > asked

        # the LISTEN connection, cut by the server, comes back with the new token too
        provider._listener.connected.clear()
        scram_postgres.run(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE usename = %s AND query LIKE 'LISTEN%%'",
            name,
        )
        await asyncio.wait_for(provider._listener.connected.wait(), 30)
        woke = asyncio.Event()
        provider._listener.on_notify = lambda _queue: woke.set()
        await app.enqueue(EntraJob(n=2))
        await asyncio.wait_for(woke.wait(), 30)
    finally:
        await rt.close()
        _drop(scram_postgres, name, schema)


async def test_a_wrong_token_is_refused_by_the_server_and_open_says_so(scram_postgres):
    name = f"entra_{uuid.uuid4().hex[:8]}"
    schema = _role(scram_postgres, name, "the-real-token")
    provider = SqlProvider(
        scram_postgres.url(name), schema=schema, database_auth="entra",
        credential=RotatingCredential("a-stale-token", []), connect_retries=0,
    )  # fmt: skip
    try:
        with pytest.raises(ProviderError, match="password authentication failed"):
            await provider.open()
    finally:
        await provider.close()
        _drop(scram_postgres, name, schema)


@pytest.fixture
async def identity_endpoint(monkeypatch):
    for variable in OTHER_CREDENTIAL_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    uami = Identity("id-queueing-test", str(uuid.uuid4()), str(uuid.uuid4()))
    endpoint = IdentityEndpoint([uami])  # a user-assigned identity only, as the Bicep gives the app
    await endpoint.start()
    for key, value in endpoint.environment().items():
        monkeypatch.setenv(key, value)
    yield endpoint, uami
    await endpoint.stop()


def _token_is_the_password(scram_postgres, endpoint: IdentityEndpoint, name: str) -> str:
    """A role named after the identity whose password becomes each token the endpoint issues (what
    the Entra-enabled server accepts); returns the schema it owns."""
    schema = _role(scram_postgres, name, "not-a-token-yet")

    async def token_is_the_password(issued: Issued) -> None:
        await asyncio.to_thread(_set_password, scram_postgres, name, issued.token)

    endpoint.on_issue.append(token_is_the_password)
    return schema


async def test_default_azure_credential_signs_in_as_the_user_assigned_identity(
    scram_postgres, identity_endpoint
):
    endpoint, uami = identity_endpoint
    name = uami.name
    schema = _token_is_the_password(scram_postgres, endpoint, name)
    provider = SqlProvider(
        scram_postgres.url(name), schema=schema, database_auth="entra", client_id=uami.client_id
    )
    try:
        await provider.open()
        async with provider.engine.connect() as conn:
            assert (await conn.execute(sa.text("SELECT current_user"))).scalar() == name
        assert [i.resource for i in endpoint.issued] == ["https://ossrdbms-aad.database.windows.net"]
        assert endpoint.issued[0].identity == uami
    finally:
        await provider.close()

    # without the client id the credential asks for a system-assigned identity the app does not have
    anonymous = SqlProvider(scram_postgres.url(name), schema=schema, database_auth="entra", connect_retries=0)
    try:
        with pytest.raises(ProviderError, match="no Microsoft Entra token for PostgreSQL") as caught:
            await anonymous.open()
        assert "\n" not in str(caught.value)
        assert endpoint.refused
    finally:
        await anonymous.close()
        _drop(scram_postgres, name, schema)


async def test_a_token_is_renewed_before_it_expires(scram_postgres, identity_endpoint, monkeypatch):
    """azure-identity asks for a new token once the current one is within five minutes of expiry, at
    most once every 30 s; the test shortens only that 30-second spacing."""
    import azure.identity._internal.utils as identity_utils

    monkeypatch.setattr(identity_utils, "DEFAULT_TOKEN_REFRESH_RETRY_DELAY", 0)
    endpoint, uami = identity_endpoint
    endpoint.lifetime = 303  # inside the five-minute window three seconds after it is issued
    name = uami.name
    schema = _token_is_the_password(scram_postgres, endpoint, name)
    provider = SqlProvider(
        scram_postgres.url(name), schema=schema, database_auth="entra", client_id=uami.client_id, listen=False
    )
    try:
        await provider.open()
        async with provider.engine.connect() as first:
            assert len(endpoint.issued) == 1
            await asyncio.sleep(4)
            renewed_at = time.time()
            await provider.engine.dispose(close=False)
            async with provider.engine.connect() as second:  # a new connection: a new token, early
                assert (await second.execute(sa.text("SELECT 1"))).scalar() == 1
            assert (await first.execute(sa.text("SELECT 2"))).scalar() == 2
        assert len(endpoint.issued) == 2
        # the old token had ~5 minutes left (a margin for a slow machine: renewed long before its expiry)
        assert endpoint.issued[0].expires_on > renewed_at + 240
        assert endpoint.issued[1].token != endpoint.issued[0].token
    finally:
        await provider.close()
        _drop(scram_postgres, name, schema)
