"""Custom checkov checks for the Bicep in infra/ (checkov has no Service Bus checks).

checkov hands a Bicep resource's ``config`` to ``scan_resource_conf``. For a resource declared
with a ``for`` loop or an ``if`` condition that config is a wrapper
(``{"loop_type": ..., "condition": ..., "config": {...}}``), so unwrap it first. Values that are
expressions (``q.maxDeliveryCount`` from a parameter array) arrive as parsed expression dicts,
not literals.
"""

from __future__ import annotations

from typing import Any

from checkov.bicep.checks.resource.base_resource_check import BaseResourceCheck
from checkov.common.models.enums import CheckCategories, CheckResult

QUEUE = "Microsoft.ServiceBus/namespaces/queues"
MAX_DELIVERY_COUNT = (1, 2000)


def resource_properties(conf: dict[str, Any]) -> dict[str, Any] | None:
    """The ``properties`` block of a resource, looking through loop/condition wrappers."""
    while isinstance(conf, dict) and "properties" not in conf and isinstance(conf.get("config"), dict):
        conf = conf["config"]
    props = conf.get("properties") if isinstance(conf, dict) else None
    return props if isinstance(props, dict) else None


def is_expression(value: Any) -> bool:
    """A value computed at deployment time (a parameter, a loop item, a function call)."""
    return isinstance(value, dict) or (isinstance(value, str) and not value.lstrip("-").isdigit())


class ServiceBusQueueDeadLettersOnExpiration(BaseResourceCheck):
    def __init__(self) -> None:
        super().__init__(
            name="Service Bus queues dead-letter expired messages (deadLetteringOnMessageExpiration: true)",
            id="CKV_QK_1",
            categories=[CheckCategories.GENERAL_SECURITY],
            supported_resources=[QUEUE],
        )

    def scan_resource_conf(self, conf: dict[str, Any]) -> CheckResult:
        props = resource_properties(conf)
        if props is None:
            return CheckResult.FAILED
        return (
            CheckResult.PASSED
            if props.get("deadLetteringOnMessageExpiration") is True
            else CheckResult.FAILED
        )


class ServiceBusQueueMaxDeliveryCountInRange(BaseResourceCheck):
    def __init__(self) -> None:
        super().__init__(
            name="Service Bus queues set maxDeliveryCount within 1..2000",
            id="CKV_QK_2",
            categories=[CheckCategories.GENERAL_SECURITY],
            supported_resources=[QUEUE],
        )

    def scan_resource_conf(self, conf: dict[str, Any]) -> CheckResult:
        props = resource_properties(conf)
        if props is None or "maxDeliveryCount" not in props:
            return CheckResult.FAILED
        value = props["maxDeliveryCount"]
        if isinstance(value, bool):
            return CheckResult.FAILED
        if isinstance(value, int) or (isinstance(value, str) and value.lstrip("-").isdigit()):
            low, high = MAX_DELIVERY_COUNT
            return CheckResult.PASSED if low <= int(value) <= high else CheckResult.FAILED
        # Set from a parameter: the value is only known at deployment time.
        return CheckResult.UNKNOWN if is_expression(value) else CheckResult.FAILED


check_dead_letter = ServiceBusQueueDeadLettersOnExpiration()
check_max_delivery = ServiceBusQueueMaxDeliveryCountInRange()
