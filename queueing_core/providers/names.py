"""Physical queue names, shared by the providers that name queues on a broker."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import ConfigurationError
from ..naming import InvalidQueueName, QueueNaming, Transport, validate

if TYPE_CHECKING:
    from ..app import QueueingApp


class PhysicalNames:
    """``physical(queue)``: the provider's own naming if it has one, else its app's (prefix/suffix)."""

    transport: Transport
    naming: QueueNaming | None
    _app: QueueingApp | None

    def physical(self, queue: str) -> str:
        naming = self.naming or (self._app.naming if self._app else QueueNaming())
        return naming.physical(queue, self.transport)

    def logical_of(self, physical: str) -> str:
        """The app's queue named ``physical`` here, or ``physical`` itself when the app has none."""
        queues = self._app.by_queue() if self._app else {}
        return next((q for q in queues if self.physical(q) == physical), physical)


def companion_name(physical: str, suffix: str, transport: Transport) -> str:
    """A queue beside ``physical`` (poison, dead-letter): the longer name must still be valid."""
    name = f"{physical}{suffix}"
    try:
        validate(name, transport)
    except InvalidQueueName as exc:
        raise ConfigurationError(
            "queue name", f"{exc} (the queue name leaves no room for '{suffix}')"
        ) from None
    return name
