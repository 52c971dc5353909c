"""Operations: the ops service contract (D1) and its HTTP API (D2)."""

from .service import OpsActions, OpsService

__all__ = ["OpsActions", "OpsService"]
