"""Durations that cannot work are refused at start-up, naming the setting.

Found in review: ``QUEUEING_TTL_GRACE=-PT1H`` was taken (Service Bus then expired a message before
its expiry, before a worker could record it), as were negative ``QUEUEING_ARCHIVE_AFTER`` and
``QUEUEING_DELETE_ARCHIVED_AFTER``; ``inf`` was taken for the poll waits, the maintenance interval
and the shutdown timeout, each then a wait that never ends.
"""

from __future__ import annotations

from datetime import timedelta

import pytest

from queueing_core.errors import ConfigurationError
from queueing_core.settings import QueueingSettings, load_settings


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("QUEUEING_TTL_GRACE", "-PT1H"),
        ("QUEUEING_ARCHIVE_AFTER", "-P1D"),
        ("QUEUEING_DELETE_ARCHIVED_AFTER", "-P1D"),
        ("QUEUEING_POLL_MIN", "inf"),
        ("QUEUEING_POLL_MAX", "inf"),
        ("QUEUEING_MAINTENANCE_INTERVAL", "inf"),
        ("QUEUEING_SHUTDOWN_TIMEOUT", "inf"),
    ],
)
def test_refused_naming_the_setting(setting: str, value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(setting, value)
    with pytest.raises(ConfigurationError) as caught:
        load_settings()
    assert caught.value.setting == setting


def test_zero_and_never_are_still_taken() -> None:
    s = QueueingSettings(
        ttl_grace=timedelta(0), archive_after=timedelta(0), delete_archived_after=None, shutdown_timeout=0
    )
    assert s.ttl_grace == timedelta(0)
    assert s.archive_after == timedelta(0)
    assert s.delete_archived_after is None
    assert QueueingSettings(archive_after=None).archive_after is None
