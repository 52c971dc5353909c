"""Where a control store keeps the state of an idempotent type's identities on the transports that
cannot find a waiting message themselves: one small JSON document per (type, identity), changed by
compare-and-set. What the document says, and why, is :mod:`queueing_core.idempotency`'s business."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class KeepsIdentities(Protocol):
    async def identity_doc(self, type_name: str, identity: str) -> tuple[dict[str, Any], object] | None:
        """The document and a token naming its version, or None when there is none."""
        ...

    async def put_identity_doc(
        self, type_name: str, identity: str, doc: dict[str, Any], token: object | None
    ) -> bool:
        """Store ``doc`` if the stored document is still the one ``token`` names (``None``: if there is
        none yet). False when another writer came first: read again and decide again."""
        ...
