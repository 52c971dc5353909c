"""Everything configurable, from environment variables / app settings with the ``QUEUEING_`` prefix."""

from __future__ import annotations

import difflib
import json
import re
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Any, Literal, get_args
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, ValidationError, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict, SettingsError

from .errors import ConfigurationError
from .messages import MessageStatus

#: the longest worker id: the SQL lease column ``locked_by`` is ``String(128)`` (providers/sql/schema.py)
WORKER_ID_MAX = 128
#: the statuses retention may archive: the ones a message settles in
ARCHIVABLE = tuple(
    s.value for s in MessageStatus if s in MessageStatus.terminal() or s is MessageStatus.ABANDONED
)
#: settings whose value may hold a password: a refusal never prints them
_HOLDS_PASSWORD = frozenset({"database_url"})

ProviderName = Literal["inprocess", "sql", "storage_queue", "servicebus", "rabbitmq", "sqs"]


class QueueingSettings(BaseSettings):
    # an empty app setting means "not set" (Functions portals and sample files keep empty values)
    # (no input in a ValidationError's text: a URL holding a password would be printed in a traceback)
    model_config = SettingsConfigDict(
        env_prefix="QUEUEING_", extra="ignore", frozen=True, env_ignore_empty=True, hide_input_in_errors=True
    )

    # Every field has a description: the configuration reference in the docs is generated from them.
    provider: ProviderName = Field(
        default="sql", description="The transport: where messages wait and how they are delivered."
    )
    app: str = Field(
        default="queueing_core.examples.orders:app",
        description="`MODULE:ATTR` of your `QueueingApp` (the default is the example app shipped with "
        "the kit).",
    )
    database_url: str = Field(
        default="sqlite:///./queueing.db",
        description="The SQL database: the queue itself for `sql`; history, pause/circuit state and "
        "the delayed-message store for `rabbitmq` and `sqs` (and Storage Queues with the delayed "
        "store). `sqlite:///path` or `postgresql://user@host/db`.",
    )
    database_schema: str | None = Field(
        default=None,
        pattern=r"^[a-z_][a-z0-9_]{0,62}$",
        description="A PostgreSQL schema for the kit's tables, to keep environments apart in one database "
        "(lower case: PostgreSQL folds the unquoted names the kit writes to lower case).",
    )
    database_auth: Literal["auto", "entra", "password"] = Field(
        default="auto",
        description="PostgreSQL sign-in: `auto` uses a Microsoft Entra token when the URL has no password "
        "and the host is an Azure Database for PostgreSQL server; `entra` always, `password` never.",
    )
    database_client_id: str | None = Field(
        default=None,
        description="Client id of the user-assigned managed identity that signs in to PostgreSQL (Entra).",
    )
    auto_migrate: bool = Field(
        default=True,
        description="Create or upgrade the SQL schema at start-up; when false, run `queueing migrate` "
        "once per release.",
    )
    connect_retries: int = Field(
        default=8, ge=0, le=1000, description="Attempts to reach the database at start-up, with backoff."
    )
    maintenance_interval: float = Field(
        default=5.0,
        gt=0,
        allow_inf_nan=False,  # (inf: the first sweep's wait never ended, and no sweep ran)
        description="Seconds between SQL sweeps (lapsed leases, overdue expiry, retention) in each host.",
    )
    durable_claims: bool = Field(
        default=True,
        description="PostgreSQL: claims and lease renewals wait for the write-ahead log to reach disk, "
        "like every other write. `false` commits them with `synchronous_commit=off` on a pool of their "
        "own: faster, and a database crash just after a claim only hands its messages out again "
        "(a second delivery, never a loss).",
    )
    sqlite_synchronous: Literal["normal", "full"] = Field(
        default="normal",
        description="SQLite: when a commit reaches the disk. `normal`: at the next checkpoint (a "
        "commit survives the process's crash; an OS crash or a power cut can roll the last ones back, "
        "enqueues included); `full`: at every commit, slower.",
    )
    settle_with_claims: bool = Field(
        default=False,
        description="SQL (PostgreSQL with durable claims, or SQLite): a worker settles the messages "
        "that finished and claims its next batch in one transaction (one commit instead of two). "
        "Fewer commits and WAL flushes per message, but the settlement then waits on the claim's "
        "path: it pays where the server's flush is the limit (slow disks, a synchronous standby, "
        "many workers), not where its CPU is.",
    )
    database_prepared_statements: bool = Field(
        default=True,
        description="PostgreSQL: claims, renewals and settlements run as server-side prepared statements. "
        "`false` for a pooler that cannot keep them (PgBouncer in transaction mode before 1.21, or "
        "without `max_prepared_statements`): then no statement is prepared on the kit's connections.",
    )
    archive_after: timedelta | None = Field(
        default=timedelta(days=7),
        description="SQL: archive messages this long after they settled in one of "
        "`QUEUEING_ARCHIVE_STATUSES` (`None` in code: never).",
    )
    archive_statuses: Annotated[list[str], NoDecode] = Field(
        default=["Succeeded", "DeadLettered", "Expired", "Cancelled"],
        description="SQL: the statuses that are archived after `QUEUEING_ARCHIVE_AFTER`, comma-separated "
        "(`Succeeded,DeadLettered`) or a JSON list; any of "
        + ", ".join(f"`{s}`" for s in ARCHIVABLE)
        + ", or a status of your own that settled messages are set to.",
    )
    delete_archived_after: timedelta | None = Field(
        default=timedelta(days=30),
        description="SQL: delete archived messages this long after archiving (`None` in code: keep them).",
    )
    queue_prefix: str = Field(
        default="", description="Added before every queue name (then each transport's naming rules apply)."
    )
    queue_suffix: str = Field(default="", description="Added after every queue name.")
    worker_id: str | None = Field(
        default=None,
        description="This host's id in logs and SQL leases (`locked_by`): at most 128 printable "
        "characters; by default `<hostname>:<pid>:<random>`.",
    )
    shutdown_timeout: float = Field(
        default=30.0,
        ge=0,
        allow_inf_nan=False,  # (inf: a stop waited for ever on a handler that never ended)
        description="Seconds a stopping worker lets claims in flight come back and running handlers "
        "finish before it cancels them and gives their messages back; the whole stop takes at most this "
        "plus 20 s (26 s for `queueing serve` with its ops API), even when the database stops answering.",
    )
    poll_min: float = Field(
        default=0.05,
        gt=0,
        allow_inf_nan=False,  # (inf: a worker's wait after a partial batch never ended)
        description="Seconds a worker waits before polling again after a partial batch.",
    )
    poll_max: float = Field(
        default=2.0,
        gt=0,
        allow_inf_nan=False,  # (inf: an idle worker's wait grew until only a wake-up ended it)
        description="The longest wait between polls of an idle queue (the wait doubles up to it; a "
        "wake-up cuts it short).",
    )
    prefetch: int = Field(
        default=1,
        ge=1,
        le=1000,
        description="Messages a worker holds per handler slot (`max_concurrency` x this are leased at once).",
    )
    receives_in_flight: Annotated[int, Field(ge=1, le=2)] | Literal["auto"] = Field(
        default="auto",
        description="Receives (claims) a worker keeps in flight per queue. `auto` (SQL on PostgreSQL): "
        "while a queue's claims come back full, it is the worker's only full queue and no other worker "
        "holds a lease in the database, the worker tries a second claim while the first is on its way and "
        "keeps it while it claims more messages a second (tried again every 30 s); otherwise one (always one "
        "for a single slot). `2`: a second "
        "claim whenever claims come back full (SQL only; other transports and ordered queues keep one). "
        "`1`: one claim at a time. On SQLite, whose one writer runs claims one after the other, `auto` is "
        "one claim.",
    )
    cancel_poll: float = Field(
        default=1.0,
        gt=0,
        le=3600,
        description="Seconds between a worker's looks at the shared cancellation requests while it runs "
        "handlers (on PostgreSQL a NOTIFY tells it at once as well).",
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        default="INFO", description="The log level of the kit's loggers."
    )
    log_format: Literal["text", "json"] = Field(
        default="text", description="`json` prints one JSON object per line (for log collectors)."
    )
    # the cloud transports keep pause/circuit state and history in Azure Tables
    control_table: str = Field(
        default="queueingcontrol",
        pattern=r"^[A-Za-z][A-Za-z0-9]{2,62}$",
        description="Storage Queues and Service Bus: the Azure Table holding pause and circuit state.",
    )
    tracker_table: str = Field(
        default="queueinghistory",
        pattern=r"^[A-Za-z][A-Za-z0-9]{2,62}$",
        description="Storage Queues and Service Bus: the Azure Table holding message history.",
    )
    tracker_retention_days: float = Field(
        default=14,
        gt=0,
        le=3650,
        description="Days of message history kept where history lives apart from the queue (Azure "
        "Tables, or SQL for RabbitMQ and SQS).",
    )
    ttl_grace: timedelta = Field(
        default=timedelta(hours=1),
        description="Service Bus: the broker's own time-to-live of a message is its expiry plus this, so "
        "a worker records `Expired` first (what the broker drops goes to the dead-letter queue). "
        "RabbitMQ: messages carry no time-to-live now; those an earlier version sent carry expiry plus "
        "this. Storage Queues keeps every message until a worker reads it.",
    )
    rabbitmq_url: SecretStr = Field(
        default=SecretStr("amqp://guest:guest@127.0.0.1:5672/"),
        description="RabbitMQ: the AMQP URL (it holds a password: never logged). A password holding "
        "`/`, `#`, `?` or `@` is percent-encoded (`%2F`, `%23`, `%3F`, `%40`).",
    )
    rabbitmq_max_message_bytes: int | None = Field(
        default=None,
        ge=1024,
        le=512 * 1024 * 1024,  # (the most a broker's max_message_size may be)
        description="RabbitMQ: the largest envelope the kit sends, in bytes. Unset: 16 MiB (RabbitMQ 4's "
        "default `max_message_size`) less 64 KiB kept for what a dead letter adds; for a broker "
        "configured for more, set it to that size less 64 KiB.",
    )
    rabbitmq_consumer_timeout: float = Field(
        default=1800.0,
        ge=0,
        le=366 * 24 * 3600,  # (a year and more is none: 0)
        allow_inf_nan=False,
        description="RabbitMQ: the broker's `consumer_timeout`, in seconds (30 minutes unless its "
        "configuration says otherwise; 0: it has none). A run is cut a minute before it (a failed "
        "attempt, as at a time limit): past it the broker closes the channel, and every message of the "
        "queue held on it runs again.",
    )
    sqs_endpoint_url: str | None = Field(
        default=None,
        description="SQS: a different endpoint (a local server); AWS's own when unset.",
    )
    sqs_region: str | None = Field(
        default=None,
        description="SQS: the AWS region. Unset: the one the standard AWS configuration names "
        "(`AWS_DEFAULT_REGION`, the profile's `region` in `~/.aws/config`, then `AWS_REGION`), and "
        "`us-east-1` where none does.",
    )
    sqs_create_queues: bool = Field(
        default=True,
        description="SQS: create missing queues (and their dead-letter queues) at start and bring "
        "existing ones to the kit's settings (needs `sqs:CreateQueue`, `sqs:SetQueueAttributes` and "
        "`sqs:GetQueueAttributes`). Off: the queues are only looked up (`sqs:GetQueueUrl`), and one "
        "missing stops start-up naming it.",
    )
    delayed_store_retries: int = Field(
        default=3,
        ge=0,
        le=100,
        description="Delayed-message store: failed forwards of one message before it is dead-lettered "
        "with `delayed-forward-failed`.",
    )
    storage_delayed_store: bool = Field(
        default=False,
        description="Storage Queues: keep delays beyond 7 days in the SQL delayed store "
        "(`QUEUEING_DATABASE_URL`) instead of re-hiding the message every 7 days.",
    )
    servicebus_create_queues: bool = Field(
        default=True,
        description="Service Bus: create missing queues at start (needs the Manage right: Azure Service "
        "Bus Data Owner). On for local development; the Bicep provisions the queues and turns it off.",
    )
    api_key: SecretStr | None = Field(
        default=None,
        description="The ops API key (`Authorization: Bearer <key>` or `X-API-Key`). Unset: "
        "`queueing serve` listens on loopback only and Functions refuse every request.",
    )
    functions_http_auth_level: Literal["function", "anonymous"] = Field(
        default="function",
        description="Azure Functions: the HTTP function's authorization level. `function` (the default): "
        "the platform wants its function key (`x-functions-key`) before the kit checks the API key, "
        "which a browser does not send, so the dashboard is reached through a gateway that adds it. "
        "`anonymous`: the kit's API key (or a dashboard session) is the only check, and a browser can "
        "open the dashboard; it needs `QUEUEING_API_KEY`.",
    )
    pause_recheck_seconds: float = Field(
        default=5.0,
        gt=0,
        le=3600,
        description="How long a paused or held message waits before it is looked at again (in "
        "Functions each look is an execution, so a longer wait is cheaper there).",
    )
    schedule_grace_seconds: float = Field(
        default=60.0,
        ge=1,
        le=86400,
        description="How late a schedule's tick may run and still count as on time. Older ticks that no "
        "host sent (every host was down, or the transport was) are missed: the schedule's `catch_up` "
        "runs the newest once, or none. In Functions the longest interval of "
        "`QUEUEING_FUNCTIONS_SCHEDULES_SCHEDULE` is added (a tick waits for the next timer run).",
    )
    opentelemetry: bool = Field(
        default=False,
        description="Trace each enqueue and handler run and record processing metrics with "
        "OpenTelemetry (install the `otel` extra and configure an SDK or exporter). Off: nothing of "
        "OpenTelemetry is imported.",
    )
    # Azure Functions: NCRONTAB schedules (six fields) and the SQL processor's time budget per run
    functions_processor_schedule: str = Field(
        default="*/15 * * * * *",
        pattern=r"^(\S+\s+){5}\S+$",
        description="Functions, SQL: when `queueing_sql_processor` runs (NCRONTAB, six fields).",
    )
    functions_processor_budget: float = Field(
        default=50.0,
        gt=0,
        le=3600,
        description="Functions, SQL: seconds one `queueing_sql_processor` run may process before it stops.",
    )
    functions_sweeper_schedule: str = Field(
        default="*/30 * * * * *",
        pattern=r"^(\S+\s+){5}\S+$",
        description="Functions, SQL: when `queueing_lease_sweeper` runs.",
    )
    functions_retention_schedule: str = Field(
        default="0 5 * * * *",
        pattern=r"^(\S+\s+){5}\S+$",
        description="Functions: when `queueing_retention` archives and deletes (SQL) or prunes the "
        "Tables history.",
    )
    functions_delayed_schedule: str = Field(
        default="*/30 * * * * *",
        pattern=r"^(\S+\s+){5}\S+$",
        description="Functions: when `queueing_delayed_dispatcher` forwards due delayed messages.",
    )
    functions_schedules_schedule: str = Field(
        default="0 * * * * *",
        pattern=r"^(\S+\s+){5}\S+$",
        description="Functions: when `queueing_schedules` fires the app's due schedule ticks (registered "
        "only when the app has schedules).",
    )
    functions_local_sqlite: bool = Field(
        default=False,
        description="Functions: allow shared state (SQL queues, the delayed store) in a SQLite file. Only "
        "for a single local host (`func start`): on Azure every instance has a file of its own.",
    )
    history_journal: str = Field(
        default="",
        description="Storage Queues, Service Bus, RabbitMQ, SQS: the directory where a host keeps message "
        "history its history store has not taken yet (kept on local disk before each settlement and "
        "written once the store answers, also by the next process after a restart). Empty: a "
        "`queueing-history` directory in the system's temporary directory; `off`: memory only.",
    )
    api_max_body_bytes: int = Field(
        default=256 * 1024,
        ge=1024,
        le=64 * 1024 * 1024,
        description="The ops API refuses larger request bodies with 413.",
    )

    @field_validator("database_url")
    @classmethod
    def _readable_database_url(cls, url: str) -> str:
        # a password holding '@' made the rest of it the host, and the error that followed printed
        # the password's tail as a host name; one holding '/' with no '@' left, as a port
        problem = database_url_problem(url)
        if problem is not None:
            raise ValueError(problem)
        return url

    @field_validator("ttl_grace", "archive_after", "delete_archived_after")
    @classmethod
    def _not_negative(cls, duration: timedelta | None) -> timedelta | None:
        # a negative one was taken: a negative grace had Service Bus expire a message before its
        # expiry, before a worker could record it; a negative age read as "at once". (A validator,
        # not ``ge=``: the configuration reference's table formats each bound as a number.)
        if duration is not None and duration < timedelta(0):
            raise ValueError("is negative; a duration of 0 or more")
        return duration

    @field_validator("archive_statuses", mode="before")
    @classmethod
    def _status_list(cls, value: Any) -> Any:
        # the natural way to type a list in an environment variable is a comma list; JSON works too
        if not isinstance(value, str):
            return value
        text = value.strip()
        if text.startswith("["):
            try:
                return json.loads(text)
            except ValueError:
                raise ValueError("is not a JSON list; give the statuses comma-separated") from None
        return [part.strip() for part in text.split(",") if part.strip()]

    @field_validator("archive_statuses")
    @classmethod
    def _archivable(cls, statuses: list[str]) -> list[str]:
        # a misspelt status silently stopped archiving the messages it meant; one of the kit's that a
        # message never settles in archives nothing. An operator's own status (a settled message set
        # to "Reviewed") keeps its settled time and is archived as before
        kit = {s.value for s in MessageStatus}
        refused = [
            s
            for s in statuses
            if (s in kit and s not in ARCHIVABLE)
            or (s not in kit and difflib.get_close_matches(s, [*kit], n=1, cutoff=0.8))
        ]
        if refused:
            raise ValueError(
                f"{', '.join(map(repr, refused))} is not a status retention archives "
                f"(any of {', '.join(ARCHIVABLE)}, or a status of your own; comma-separated)"
            )
        return statuses

    @field_validator("worker_id")
    @classmethod
    def _usable_worker_id(cls, worker_id: str | None) -> str | None:
        # it is every claim's lease owner: one the SQL column cannot hold failed every claim, and the
        # worker looked started while it processed nothing
        if worker_id is None:
            return None
        if not worker_id.strip():
            raise ValueError("is blank; set an id, or leave it unset for <hostname>:<pid>:<random>")
        if len(worker_id) > WORKER_ID_MAX:
            raise ValueError(
                f"is {len(worker_id)} characters; at most {WORKER_ID_MAX} (the SQL lease column's size)"
            )
        if not worker_id.isprintable():
            raise ValueError("holds control characters, which would break the log lines that name it")
        return worker_id

    @field_validator("rabbitmq_consumer_timeout")
    @classmethod
    def _usable_consumer_timeout(cls, seconds: float) -> float:
        # a run is cut a tenth of it before it, and must have time to start (the broker checks it
        # once a minute in any case)
        if 0 < seconds < 10:
            raise ValueError("0 (the broker has none) or at least 10 seconds")
        return seconds

    @field_validator("rabbitmq_url")
    @classmethod
    def _readable_rabbitmq_url(cls, url: SecretStr) -> SecretStr:
        # an unescaped '/', '#' or '?' in the password cut the URL there: the client then read the
        # password as the port and raised it in a traceback. Said here without the value
        problem = amqp_url_problem(url.get_secret_value())
        if problem is not None:
            raise ValueError(problem)
        return url

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


#: how SQLAlchemy reads a URL's scheme (``postgresql+psycopg``), which ends at the first '://'
_DB_SCHEME = re.compile(r"[\w+]+")
#: how SQLAlchemy reads a URL's user part (``[^:/]*`` then ``:[^@]*``: a password ends at its first '@')
_DB_USER = re.compile(r"[^:/]*(?::[^@]*)?@")


def database_url_problem(url: str) -> str | None:
    """What makes ``url`` no database URL, or in its host part shows a password that was not
    percent-encoded, in words that never hold any part of it; None: nothing. It reads the URL as
    SQLAlchemy does, without importing it (indexing a Functions app loads only what its configuration
    needs)."""
    scheme, sep, rest = url.partition("://")
    if not sep or not _DB_SCHEME.fullmatch(scheme):
        # SQLAlchemy reads no such URL, and its refusal (before 2.0.41) printed the whole text,
        # password and all: said here, from none of it
        return "is not a database URL: it starts <database>:// (sqlite:///path.db, postgresql://user@host/db)"
    if scheme.startswith("sqlite"):  # (a SQLite path may hold anything)
        return None
    user = _DB_USER.match(rest)
    host = re.split(r"[/?]", rest[user.end() :] if user else rest, maxsplit=1)[0]
    encode = "percent-encode the password ('@' as %40, '/' as %2F, ':' as %3A)"
    if "@" in host:
        return f"has more than one '@' before its host; {encode}"
    port = host.rpartition("]")[2] if host.startswith("[") else host
    port = port.partition(":")[2]
    if port and not port.isdigit():
        return f"its port is not a number; {encode}"
    return None


def amqp_url_problem(url: str) -> str | None:
    """What makes ``url`` no AMQP URL, in words that never hold any part of it; None: it reads."""
    encode = "percent-encode the user name and password ('/' as %2F, '#' as %23, '?' as %3F, '@' as %40)"
    parts = urlsplit(url)
    if parts.scheme not in ("amqp", "amqps"):
        return "is not an AMQP URL: it starts amqp:// or amqps://"
    # (only where no '@' ended the user part: one in a query, ``?name=worker@host``, is the URL's own)
    if "@" not in parts.netloc and "@" in parts.path + parts.query + parts.fragment:
        return (
            "has an '@' after where its host should be: a '/', '#' or '?' in the password ends it "
            f"early; {encode}"
        )
    try:
        parts.port  # noqa: B018 - the property raises for a port that is not a number
    except ValueError:
        return f"its port is not a number (a ':' in the host part); {encode}"
    return None


def journal_dir(settings: QueueingSettings) -> Path | None:
    """Where history not yet written is kept (``QUEUEING_HISTORY_JOURNAL``); None: memory only."""
    from .tracking.backlog import default_journal_dir

    value = settings.history_journal.strip()
    if value.lower() == "off":
        return None
    return Path(value) if value else default_journal_dir()


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
    if _is_secret(model, field) or field in _HOLDS_PASSWORD:  # never print a secret, even a malformed one
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
    except SettingsError as exc:  # a list setting the environment source could not read
        found = re.search(r'field "(\w+)"', str(exc))
        setting = f"QUEUEING_{found.group(1)}".upper() if found else "QUEUEING_*"
        accepted = "a JSON list, or values comma-separated"
        raise ConfigurationError(setting, "cannot be read", accepted) from None
