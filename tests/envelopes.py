"""One way for tests to make an envelope by hand (fresh ids, made now unless told)."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from queueing_core.clock import utcnow
from queueing_core.envelope import Envelope


def an_envelope(
    type: str = "Job",
    queue: str = "jobs",
    *,
    body: dict[str, Any] | None = None,
    created_at: datetime | None = None,
    **fields: Any,
) -> Envelope:
    return Envelope(
        type=type,
        queue=queue,
        message_id=uuid.uuid4(),
        tracking_id=uuid.uuid4(),
        created_at=created_at or utcnow(),
        body={} if body is None else body,
        **fields,
    )
