"""Settings refused where they are read, with one line naming them (found in review).

``QUEUEING_WORKER_ID`` longer than the SQL lease column was accepted, and every claim on PostgreSQL
then failed ("value too long for type character varying(128)"): a host that looked started processed
nothing. ``QUEUEING_ARCHIVE_STATUSES`` took any text, so a misspelt status silently stopped archiving.
A URL setting refused by its validator must not show its password in the refusal or a traceback.
"""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from queueing_core.errors import ConfigurationError
from queueing_core.settings import QueueingSettings, load_settings


def test_the_worker_id_limit_is_the_lease_columns():
    from queueing_core.providers.sql.schema import Tables
    from queueing_core.settings import WORKER_ID_MAX

    for table in (Tables.build(None).messages, Tables.build(None).history):
        assert table.c.locked_by.type.length == WORKER_ID_MAX == 128


@pytest.mark.parametrize(
    ("worker_id", "problem"),
    [
        ("w" * 129, "at most 128"),
        ("   ", "blank"),
        ("pod-1\nINFO forged line", "control characters"),
        ("pod-1\x00", "control characters"),
    ],
)
def test_an_unusable_worker_id_is_refused_naming_the_setting(worker_id, problem):
    with pytest.raises(ConfigurationError) as caught:
        load_settings(worker_id=worker_id)
    assert caught.value.setting == "QUEUEING_WORKER_ID"
    assert problem in str(caught.value)


def test_a_worker_id_that_fits_is_kept():
    assert load_settings(worker_id="w" * 128).worker_id == "w" * 128
    assert load_settings(worker_id="node-7/pod:ab12").worker_id == "node-7/pod:ab12"


def test_archive_statuses_read_both_forms_and_refuse_unknown_ones(monkeypatch):
    monkeypatch.setenv("QUEUEING_ARCHIVE_STATUSES", "Succeeded,Abandoned")
    assert load_settings().archive_statuses == ["Succeeded", "Abandoned"]
    monkeypatch.setenv("QUEUEING_ARCHIVE_STATUSES", '["Expired", "Cancelled"]')
    assert load_settings().archive_statuses == ["Expired", "Cancelled"]
    monkeypatch.delenv("QUEUEING_ARCHIVE_STATUSES")
    with pytest.raises(ConfigurationError, match=r"'Succeded' is not a status retention archives"):
        load_settings(archive_statuses=["Succeded"])
    with pytest.raises(ConfigurationError, match="QUEUEING_ARCHIVE_STATUSES"):
        load_settings(archive_statuses=["Pending"])  # never settled: archiving it would hide work


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("rabbitmq_url", "amqp://guest:S3cr3t/Tail#x@127.0.0.1:5672/"),
        ("database_url", "postgresql://app:S3cr3t:P@rt@127.0.0.1/db"),
        ("database_url", "postgresql://app:S3cr3t@127.0.0.1:S3cr3t/db"),
    ],
)
def test_a_refused_url_never_shows_its_password(field, value):
    with pytest.raises(ConfigurationError) as caught:
        load_settings(**{field: value})
    assert "S3cr3t" not in str(caught.value)
    assert caught.value.__cause__ is None
    assert caught.value.__suppress_context__
    # built directly (as code may), the validation error's text leaves the value out as well
    with pytest.raises(ValidationError) as direct:
        QueueingSettings(**{field: value})
    assert "S3cr3t" not in str(direct.value)


def test_a_percent_encoded_password_is_taken():
    url = "amqp://guest:S3cr3t%2FTail%23x@127.0.0.1:5672/"
    assert load_settings(rabbitmq_url=url).rabbitmq_url.get_secret_value() == url
    pg = "postgresql://app:S3cr3t%3AP%40rt@127.0.0.1/db"
    assert load_settings(database_url=pg).database_url == pg


def test_a_status_of_ones_own_may_be_archived_but_not_a_misspelt_one(monkeypatch):
    # (a settled message an operator set to "Reviewed" keeps its settled time: retention archived it
    # before the statuses were checked, and still does; a review of the check found it refused)
    monkeypatch.setenv("QUEUEING_ARCHIVE_STATUSES", "Succeeded,DeadLettered,Expired,Cancelled,Reviewed")
    assert "Reviewed" in load_settings().archive_statuses
    with pytest.raises(ConfigurationError, match="'DeadLetered'"):
        load_settings(archive_statuses=["DeadLetered"])
    with pytest.raises(ConfigurationError, match="'succeeded'"):
        load_settings(archive_statuses=["succeeded"])


@pytest.mark.parametrize(
    "url",
    [
        "amqp://guest:guest@127.0.0.1:5672/?name=worker@host1",  # aiormq's connection name
        "amqp://guest:guest@127.0.0.1:5672/team@eu",  # a vhost with an '@'
        "amqp://guest:guest@/",  # no host: the client takes localhost
    ],
)
def test_an_at_sign_after_the_user_part_is_the_urls_own(monkeypatch, url):
    monkeypatch.setenv("QUEUEING_RABBITMQ_URL", url)
    assert load_settings().rabbitmq_url.get_secret_value() == url


@pytest.mark.parametrize("text", ["garbage", "AccountName=x;AccountKey="])
def test_a_malformed_storage_connection_string_is_a_configuration_error(text):
    # (a ValueError from the SDK went out as a traceback; the Tables client's same mistake was named)
    from queueing_core.connections import StorageConnection
    from queueing_core.providers.storage_queue import StorageQueueProvider

    with pytest.raises(ConfigurationError, match="QueueingStorage: invalid connection string") as raised:
        StorageQueueProvider(StorageConnection(text))
    assert text not in str(raised.value)  # the string itself (a secret, when it is a real one) is not told
