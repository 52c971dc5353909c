"""The SQL provider: SQLite (embedded default) and PostgreSQL (many hosts)."""

from .engine import create_engine, normalize_url, redact
from .outbox import SqlOutbox
from .provider import SqlProvider
from .retention import RetentionPolicy
from .schema import LATEST, Tables, migrate

__all__ = [
    "LATEST",
    "RetentionPolicy",
    "SqlOutbox",
    "SqlProvider",
    "Tables",
    "create_engine",
    "migrate",
    "normalize_url",
    "redact",
]
