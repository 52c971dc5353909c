"""Custom checkov check: storage accounts refuse anything older than TLS 1.2."""

from __future__ import annotations

from typing import Any

from checkov.bicep.checks.resource.base_resource_check import BaseResourceCheck
from checkov.common.models.enums import CheckCategories, CheckResult

try:  # loaded by checkov as a top-level module from --external-checks-dir
    from servicebus_queues import resource_properties
except ImportError:  # pragma: no cover - imported as a package elsewhere
    from .servicebus_queues import resource_properties


class StorageAccountMinimumTls12(BaseResourceCheck):
    def __init__(self) -> None:
        super().__init__(
            name="Storage accounts require TLS 1.2 (minimumTlsVersion: 'TLS1_2')",
            id="CKV_QK_3",
            categories=[CheckCategories.ENCRYPTION],
            supported_resources=["Microsoft.Storage/storageAccounts"],
        )

    def scan_resource_conf(self, conf: dict[str, Any]) -> CheckResult:
        props = resource_properties(conf)
        if props is None:
            return CheckResult.FAILED
        return CheckResult.PASSED if props.get("minimumTlsVersion") == "TLS1_2" else CheckResult.FAILED


check = StorageAccountMinimumTls12()
