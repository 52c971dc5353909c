"""Everything configurable, from environment variables / app settings with the ``QUEUEING_`` prefix."""

from __future__ import annotations

from datetime import timedelta
from typing import Literal, get_args

from pydantic import Field, SecretStr, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from .errors import ConfigurationError

ProviderName = Literal["inprocess", "sql", "storage_queue", "servicebus", "rabbitmq", "sqs"]


class QueueingSettings(BaseSettings):
    # an empty app setting means "not set" (Functions portals and sample files keep empty values)
    model_config = SettingsConfigDict(
        env_prefix="QUEUEING_", extra="ignore", frozen=True, env_ignore_empty=True
    )

    provider: ProviderName = "sql"
    app: str = Field(default="examples.orders:app", description="MODULE:ATTR of the QueueingApp to load")
    database_url: str = "sqlite:///./queueing.db"
    database_schema: str | None = Field(default=None, pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")
    #: PostgreSQL sign-in: ``auto`` uses a Microsoft Entra token when the URL has no password and the
    #: host is an Azure Database for PostgreSQL server; ``entra`` always, ``password`` never
    database_auth: Literal["auto", "entra", "password"] = "auto"
    #: client id of the user-assigned managed identity that signs in to PostgreSQL (Entra)
    database_client_id: str | None = None
    auto_migrate: bool = True
    connect_retries: int = Field(default=8, ge=0, le=1000)
    maintenance_interval: float = Field(default=5.0, gt=0)
    archive_after: timedelta | None = timedelta(days=7)
    archive_statuses: list[str] = ["Succeeded", "DeadLettered", "Expired", "Cancelled"]
    delete_archived_after: timedelta | None = timedelta(days=30)
    queue_prefix: str = ""
    queue_suffix: str = ""
    worker_id: str | None = None
    shutdown_timeout: float = Field(default=30.0, ge=0)
    poll_min: float = Field(default=0.05, gt=0)
    poll_max: float = Field(default=2.0, gt=0)
    prefetch: int = Field(default=1, ge=1, le=1000)
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    log_format: Literal["text", "json"] = "text"
    # the cloud transports keep pause/circuit state and history in Azure Tables
    control_table: str = Field(default="queueingcontrol", pattern=r"^[A-Za-z][A-Za-z0-9]{2,62}$")
    tracker_table: str = Field(default="queueinghistory", pattern=r"^[A-Za-z][A-Za-z0-9]{2,62}$")
    tracker_retention_days: float = Field(default=14, gt=0, le=3650)
    #: storage TTL = the message's expiry + this, so the kit records "Expired" before the service drops it
    ttl_grace: timedelta = timedelta(hours=1)
    # RabbitMQ and SQS (their delays beyond what the broker holds go to the delayed-message store, a
    # table in QUEUEING_DATABASE_URL's database)
    rabbitmq_url: SecretStr = SecretStr("amqp://guest:guest@127.0.0.1:5672/")
    sqs_endpoint_url: str | None = None
    sqs_region: str = "us-east-1"
    delayed_store_retries: int = Field(default=3, ge=0, le=100)
    #: Storage Queues: keep delays beyond 7 days in the SQL delayed store (QUEUEING_DATABASE_URL)
    #: instead of re-hiding the message every 7 days
    storage_delayed_store: bool = False
    #: Service Bus: create missing queues at start (needs the Manage right: Azure Service Bus Data Owner).
    #: On for local development; the Bicep provisions the queues and turns it off.
    servicebus_create_queues: bool = True
    api_key: SecretStr | None = None
    #: how long a paused or held message waits before it is looked at again (Functions: each look is
    #: an execution, so a longer wait is cheaper there)
    pause_recheck_seconds: float = Field(default=5.0, gt=0, le=3600)
    # Azure Functions: NCRONTAB schedules (six fields) and the SQL processor's time budget per run
    functions_processor_schedule: str = Field(default="*/15 * * * * *", pattern=r"^(\S+\s+){5}\S+$")
    functions_processor_budget: float = Field(default=50.0, gt=0, le=3600)
    functions_sweeper_schedule: str = Field(default="*/30 * * * * *", pattern=r"^(\S+\s+){5}\S+$")
    functions_retention_schedule: str = Field(default="0 5 * * * *", pattern=r"^(\S+\s+){5}\S+$")
    functions_delayed_schedule: str = Field(default="*/30 * * * * *", pattern=r"^(\S+\s+){5}\S+$")
    #: Azure Functions: allow shared state (SQL queues, the delayed store) in a SQLite file. Only for a
    #: single local host (``func start``): on Azure every instance has a file of its own.
    functions_local_sqlite: bool = False
    api_max_body_bytes: int = Field(default=256 * 1024, ge=1024, le=64 * 1024 * 1024)

    @field_validator("api_key")
    @classmethod
    def _usable_key(cls, key: SecretStr | None) -> SecretStr | None:
        # A key no request can match would start a server that refuses everything, silently.
        value = None if key is None else key.get_secret_value()
        if value is not None and not value.strip():
            raise ValueError("is blank; set a real key, or leave it unset (then serve on loopback only)")
        if value is not None and value != value.strip():
            raise ValueError("starts or ends with whitespace, which an HTTP header cannot carry")
        if value is not None and not value.isprintable():
            raise ValueError("holds control characters, which an HTTP header cannot carry")
        return key


def describe_error(exc: ValidationError, model: type[BaseSettings] = QueueingSettings) -> ConfigurationError:
    """One line naming the first bad setting (as its environment variable) and what it accepts."""
    err = exc.errors()[0]
    field = str(err["loc"][0]) if err["loc"] else "?"
    prefix = str(model.model_config.get("env_prefix", ""))
    setting = f"{prefix}{field}".upper()
    ctx = err.get("ctx") or {}
    if "expected" in ctx:  # a choice: say what was given and what is accepted, once
        return ConfigurationError(setting, f"{err.get('input')!r} is not accepted", str(ctx["expected"]))
    msg = err["msg"].removeprefix("Value error, ")
    if _is_secret(model, field):  # never print a secret, even a malformed one
        return ConfigurationError(setting, msg)
    return ConfigurationError(setting, f"{msg} (got {err.get('input')!r})")


def _is_secret(model: type[BaseSettings], field: str) -> bool:
    info = model.model_fields.get(field)
    annotation = info.annotation if info is not None else None
    return annotation is not None and SecretStr in (annotation, *get_args(annotation))


def load_settings(**overrides: object) -> QueueingSettings:
    try:
        return QueueingSettings(**overrides)  # type: ignore[arg-type]
    except ValidationError as exc:
        raise describe_error(exc) from None
