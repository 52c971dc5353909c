"""A database URL the kit cannot read is refused in words that hold no part of it.

Found in review: ``QUEUEING_DATABASE_URL=postgresql//bob:hunter2@host/app`` (no ``://``) passed the
settings, and the SQL provider's refusal then quoted SQLAlchemy's, which before 2.0.41 holds the
whole URL, password and all; a port that is not a number (the tail of an unencoded password) came
out as ``int()``'s error, quoting it.
"""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from queueing_core.errors import ConfigurationError
from queueing_core.providers.sql import engine
from queueing_core.providers.sql.engine import normalize_url, redact
from queueing_core.settings import load_settings

PASSWORD = "hunter2"

MALFORMED = [
    f"postgresql//bob:{PASSWORD}@host/app",
    f"postgresql:/bob:{PASSWORD}@host/app",
    f"postgres:bob:{PASSWORD}@host/app",
    f"bob:{PASSWORD}@host/app",
    f"post gres://bob:{PASSWORD}@host/app",
    f"postgresql://bob:{PASSWORD}@[::1/app",
    f"postgresql://bob:x@y:{PASSWORD}@host/app",
]


@pytest.mark.parametrize("url", MALFORMED)
def test_settings_refuse_it_without_the_password(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QUEUEING_DATABASE_URL", url)
    with pytest.raises(ConfigurationError) as caught:
        load_settings()
    assert caught.value.setting == "QUEUEING_DATABASE_URL"
    assert PASSWORD not in str(caught.value)


@pytest.fixture
def sqlalchemy_quoting_the_url(monkeypatch: pytest.MonkeyPatch) -> None:
    """``make_url`` as SQLAlchemy before 2.0.41 has it: its refusal quotes the whole string."""
    real = engine.make_url

    def make_url(url: object) -> sa.engine.URL:
        try:
            return real(url)  # type: ignore[arg-type]
        except sa.exc.ArgumentError:
            raise sa.exc.ArgumentError(f"Could not parse rfc1738 URL from string '{url}'") from None

    monkeypatch.setattr(engine, "make_url", make_url)


@pytest.mark.parametrize("url", MALFORMED)
def test_the_provider_refuses_it_without_the_password(url: str, sqlalchemy_quoting_the_url: None) -> None:
    # (a URL given in code reaches the provider without the settings' check)
    with pytest.raises(ConfigurationError) as caught:
        normalize_url(url)
    assert caught.value.setting == "QUEUEING_DATABASE_URL"
    assert "not a database URL" in str(caught.value)
    assert PASSWORD not in str(caught.value)
    assert PASSWORD not in redact(url)


def test_urls_that_read_are_still_taken() -> None:
    for url in (
        "sqlite:///./q.db",
        "sqlite://",
        "postgresql+psycopg://bob:p%40ss@host:5432/app?sslmode=require",
    ):
        assert load_settings(database_url=url).database_url == url
        normalize_url(url)
