"""Storage errors say what failed without the request's URL query string, which holds a SAS token.

Found in review: an answer the HTTP client cannot parse made it raise an error whose text quotes the
request's URL, query string and all (``...&sig=<the signature>``); the Storage Queues and Azure
Tables boundaries put that text into the kit's error, which the CLI printed and the worker logged.
An AccountKey that is not base64 failed the first request with ``failed: None None``.

No Azure service is needed: a local socket answers with a status line no HTTP client accepts.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from azure.data.tables.aio import TableClient
from azure.storage.queue.aio import QueueClient, QueueServiceClient

from queueing_core.connections import StorageConnection
from queueing_core.errors import ConfigurationError, ProviderError, ProviderUnavailable
from queueing_core.logs import without_url_queries
from queueing_core.providers import storage_queue, tables
from queueing_core.providers.storage_queue import StorageQueueProvider

SIGNATURE = "TOPSECRETSIG"
SAS = f"sv=2022-11-02&ss=qt&srt=sco&sp=rwdlacup&se=2030-01-01T00:00:00Z&sig={SIGNATURE}%3D"


@pytest.fixture
async def garbage_port() -> AsyncIterator[int]:
    """A local server whose every answer has a status line no HTTP client parses."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(65536)
        writer.write(b"HTTP/1.1 abc Garbage\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    async with server:
        yield server.sockets[0].getsockname()[1]


def test_a_query_string_in_a_quoted_url_is_hidden() -> None:
    text = f"400, message='Bad status line', url='http://127.0.0.1:1/acct/q?{SAS}'"
    assert without_url_queries(text) == "400, message='Bad status line', url='http://127.0.0.1:1/acct/q?…'"
    assert without_url_queries("is its directory there? (a try?)") == "is its directory there? (a try?)"


async def test_storage_queue_unreachable_names_no_signature(garbage_port: int) -> None:
    url = f"http://127.0.0.1:{garbage_port}/devstoreaccount1/capture-payment?{SAS}"
    async with QueueClient.from_queue_url(url, retry_total=0) as client:
        with pytest.raises(ProviderUnavailable) as caught, storage_queue._boundary("creating queue q"):
            await client.create_queue()
    text = str(caught.value)
    assert SIGNATURE not in text
    assert f"127.0.0.1:{garbage_port}/devstoreaccount1/capture-payment?…" in text
    assert "\n" not in text
    assert caught.value.__cause__ is None


async def test_tables_unreachable_names_no_signature(garbage_port: int) -> None:
    url = f"http://127.0.0.1:{garbage_port}/devstoreaccount1/history?{SAS}"
    async with TableClient.from_table_url(url, retry_total=0) as client:
        with pytest.raises(ProviderUnavailable) as caught, tables._boundary("read history"):
            await client.get_entity("p", "r")
    text = str(caught.value)
    assert SIGNATURE not in text
    assert "?…" in text
    assert "\n" not in text
    # (nor in a traceback of it: the SDK's error, whose text is the URL's, is not its cause)
    assert caught.value.__cause__ is None


async def test_an_account_key_that_is_not_base64_is_said_at_start_up() -> None:
    connection = StorageConnection(
        "DefaultEndpointsProtocol=http;AccountName=acct;AccountKey=TOPSECRET;"
        "QueueEndpoint=http://127.0.0.1:1/acct;TableEndpoint=http://127.0.0.1:1/acct"
    )
    with pytest.raises(ConfigurationError) as caught:
        StorageQueueProvider(connection)
    assert caught.value.setting == "QueueingStorage"
    assert "AccountKey is not base64" in str(caught.value)
    assert "TOPSECRET" not in str(caught.value)


async def test_an_account_key_is_read_as_the_sdk_reads_it() -> None:
    # the SDK decodes the key's UTF-8 bytes, skipping what is not base64 (a no-break space pasted
    # with it, say) and signs with it: start-up takes such a key. Decoded as text, it was a traceback
    azurite = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
    for key in (azurite + "\u00a0", azurite[:40] + "\u200b" + azurite[40:]):
        connection = StorageConnection(
            f"DefaultEndpointsProtocol=http;AccountName=acct;AccountKey={key};"
            "QueueEndpoint=http://127.0.0.1:1/acct;TableEndpoint=http://127.0.0.1:1/acct"
        )
        StorageQueueProvider(connection)
    # one that is not base64 however read: said in one line naming the setting
    connection = StorageConnection(
        "DefaultEndpointsProtocol=http;AccountName=acct;AccountKey=TOPSECRET\u00e9;"
        "QueueEndpoint=http://127.0.0.1:1/acct;TableEndpoint=http://127.0.0.1:1/acct"
    )
    with pytest.raises(ConfigurationError) as caught:
        StorageQueueProvider(connection)
    assert caught.value.setting == "QueueingStorage"
    assert "TOPSECRET" not in str(caught.value)


async def test_a_request_never_sent_says_why_not_none_none() -> None:
    # the SDK signs the request before sending it: an AccountKey it cannot decode fails there, with
    # no status code or reason to quote
    conn = (
        "DefaultEndpointsProtocol=http;AccountName=acct;AccountKey=TOPSECRET;"
        "QueueEndpoint=http://127.0.0.1:1/acct"
    )
    async with QueueServiceClient.from_connection_string(conn, retry_total=0) as service:
        with pytest.raises(ProviderError) as caught, storage_queue._boundary("creating queue q"):
            await service.get_queue_client("q").create_queue()
    text = str(caught.value)
    assert "None None" not in text
    assert "base64" in text
    assert "TOPSECRET" not in text
