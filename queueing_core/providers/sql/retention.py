"""Retention: archive terminal messages after a while, then delete old archives."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

from ...messages import MessageStatus


@dataclass(frozen=True)
class RetentionPolicy:
    #: archive terminal messages this long after they settled (None: never automatically)
    archive_after: timedelta | None = timedelta(days=7)
    archive_statuses: frozenset[str] = field(
        default_factory=lambda: frozenset(s.value for s in MessageStatus.terminal())
    )
    #: delete archived messages this long after archiving (None: keep them)
    delete_archived_after: timedelta | None = timedelta(days=30)
    #: rows touched per statement, so retention never holds long locks on a busy table
    batch: int = 5000
