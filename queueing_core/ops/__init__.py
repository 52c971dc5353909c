"""Operations: the ops service contract and its HTTP API."""

from .service import OpsActions, OpsService

__all__ = ["OpsActions", "OpsService"]
