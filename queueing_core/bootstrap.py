"""Build a runtime from settings: the one place that maps ``QUEUEING_PROVIDER`` to a provider.

Each provider module is imported only when chosen, so an app configured for SQL never loads the
Azure SDKs (and the Functions app stays light at cold start).
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any

from .errors import ConfigurationError
from .runtime import Runtime
from .settings import QueueingSettings, journal_dir, load_settings

if TYPE_CHECKING:
    from .app import QueueingApp
    from .providers.sql import SqlProvider
    from .transport import Provider


def make_provider(settings: QueueingSettings) -> Provider:
    name = settings.provider
    if name == "inprocess":
        from .providers.inprocess import InProcessProvider

        return InProcessProvider()
    if name == "sql":
        return sql_provider(settings)
    if name == "storage_queue":
        from .connections import StorageConnection
        from .providers.storage_queue import StorageQueueProvider

        delayed_stores = None
        if settings.storage_delayed_store:
            from .providers.sql.history import SideStores

            delayed_stores = SideStores.from_settings(settings)
        return StorageQueueProvider(
            StorageConnection.from_environment(),
            control_table=settings.control_table,
            tracker_table=settings.tracker_table,
            tracker_retention=timedelta(days=settings.tracker_retention_days),
            delayed_stores=delayed_stores,
            delayed_retries=settings.delayed_store_retries,
        )
    if name == "servicebus":
        from .connections import ServiceBusConnection, StorageConnection
        from .providers.servicebus import ServiceBusProvider
        from .providers.tables import tables_from_connection

        connection = ServiceBusConnection.from_environment()  # a missing setting fails before Tables
        storage = StorageConnection.from_environment()
        control, tracker = tables_from_connection(
            storage.connection_string,
            table_service_uri=storage.table_service_uri,
            client_id=storage.client_id,
            control_table=settings.control_table,
            tracker_table=settings.tracker_table,
            retention=timedelta(days=settings.tracker_retention_days),
        )
        return ServiceBusProvider.from_connection(
            connection,
            control=control,
            tracker=tracker,
            ttl_grace=settings.ttl_grace,
            auto_create=settings.servicebus_create_queues,
        )
    if name == "rabbitmq":
        from .providers.rabbitmq import RabbitMQProvider

        return RabbitMQProvider.from_settings(settings)
    if name == "sqs":
        from .providers.sqs import SqsProvider

        return SqsProvider.from_settings(settings)
    raise ConfigurationError(
        "QUEUEING_PROVIDER",
        f"{name!r} is not a provider",
        "inprocess, sql, storage_queue, servicebus, rabbitmq, sqs",
    )


def sql_provider(settings: QueueingSettings, **overrides: Any) -> SqlProvider:
    """The SQL provider on ``QUEUEING_DATABASE_URL`` as the settings say, sign-in included; the one
    place it is built from settings (``queueing migrate`` passes ``auto_migrate`` and ``listen``)."""
    from .providers.sql import RetentionPolicy, SqlProvider

    retention = RetentionPolicy(
        archive_after=settings.archive_after,
        archive_statuses=frozenset(settings.archive_statuses),
        delete_archived_after=settings.delete_archived_after,
    )
    options: dict[str, Any] = {
        "schema": settings.database_schema,
        "worker_id": settings.worker_id,
        "auto_migrate": settings.auto_migrate,
        "retention": retention,
        "connect_retries": settings.connect_retries,
        "maintenance_interval": settings.maintenance_interval,
        "database_auth": settings.database_auth,
        "client_id": settings.database_client_id,
        "durable_claims": settings.durable_claims,
        "settle_with_claims": settings.settle_with_claims,
        "prepared_statements": settings.database_prepared_statements,
        "sqlite_synchronous": settings.sqlite_synchronous,
    }
    return SqlProvider(settings.database_url, **{**options, **overrides})


def bootstrap(app: QueueingApp, settings: QueueingSettings | None = None) -> Runtime:
    """A runtime for ``app`` on the configured provider. Nothing connects until it is opened."""
    cfg = settings or load_settings()
    use_queue_naming(app, cfg)
    return Runtime(instrumented(app, cfg), make_provider(cfg), history_journal=journal_dir(cfg))


def use_queue_naming(app: QueueingApp, settings: QueueingSettings) -> None:
    """Give ``app`` the queue prefix and suffix of the settings (its queues' physical names)."""
    if settings.queue_prefix or settings.queue_suffix:
        from .naming import QueueNaming

        app.naming = QueueNaming(settings.queue_prefix, settings.queue_suffix)


def instrumented(app: QueueingApp, settings: QueueingSettings) -> QueueingApp:
    """``app`` with OpenTelemetry when the settings ask for it (only then is it imported)."""
    if settings.opentelemetry:
        try:
            from .otel import instrument
        except ImportError as exc:
            raise ConfigurationError(
                "QUEUEING_OPENTELEMETRY", f"OpenTelemetry is not installed ({exc.name})", "the otel extra"
            ) from None
        instrument(app)
    return app
