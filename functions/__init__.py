"""The Azure Functions adapter: an app's registry turned into queue triggers, timers and the ops API.

``build_app()`` reads the ``QUEUEING_*`` app settings and the app (``QUEUEING_APP``) and registers:

- one queue trigger per registered type on the configured transport (``queue_trigger`` on
  ``QueueingStorage``, or ``service_bus_queue_trigger`` on ``QueueingServiceBus``);
- SQL: a processor timer (claims and processes within a time budget) and a lease sweeper;
- a retention timer (SQL archive/delete, or pruning of the Tables history);
- the app's schedules, when it has any: one timer fires every schedule's due ticks (see
  ``docs/schedules.md`` for why one timer and not one per schedule);
- Storage Queues with ``QUEUEING_STORAGE_DELAYED_STORE``: the delayed dispatcher timer (forwards
  messages delayed beyond 7 days from the SQL delayed store when they are due);
- one HTTP function serving the ops API under ``/api/_system/queueing`` (auth level FUNCTION, and
  the API key as well).

Importing this module opens no connection and loads no transport SDK; a missing or invalid setting
fails indexing with one line that names it, and so does shared state in a SQLite file (a file of its
own on every instance). The exception is the API key, which only the HTTP function uses: a key the kit
refuses, or a Key Vault reference the platform left unresolved, is logged and makes the ops API refuse
every request with the reason, while the queue triggers and timers load and run.
"""

import hashlib
import logging
import re
from collections import Counter
from collections.abc import Sequence
from typing import Any

import azure.functions as func

from queueing_core.app import QueueingApp, Subscription
from queueing_core.bootstrap import instrumented
from queueing_core.connections import ServiceBusConnection, StorageConnection
from queueing_core.context import host_trace
from queueing_core.errors import ConfigurationError
from queueing_core.infra import check_names
from queueing_core.loader import load_app
from queueing_core.naming import Transport
from queueing_core.settings import QueueingSettings, load_settings

from .host import PROCESSOR_STOP_GRACE, FunctionsHost, function_timeout_bound

log = logging.getLogger("queueing.functions")

STORAGE_CONNECTION = "QueueingStorage"
SERVICEBUS_CONNECTION = "QueueingServiceBus"


#: the longest Function name the host accepts
MAX_FUNCTION_NAME = 128


def function_name(prefix: str, queue: str) -> str:
    """Function names: letters, digits and underscores, starting with a letter, at most 128."""
    return f"{prefix}_{re.sub(r'[^A-Za-z0-9_]', '_', queue)}"[:MAX_FUNCTION_NAME]


def function_names(prefix: str, queues: Sequence[str]) -> dict[str, str]:
    """Each queue's Function name (see :func:`function_name`). Two queues whose names differ only
    where a Function name cannot follow (``orders.v1`` and ``orders-v1``), or only past its 128
    characters, would share one, and the host then loads no function at all; those names (each but
    one that is the queue's own name unchanged) end in ``_`` and 8 hex digits of the queue name's
    SHA-256 instead. A queue that clashes with no other keeps its plain name, so adding a queue never
    renames the function of one already deployed unless the two would clash."""
    plain = {q: function_name(prefix, q) for q in queues}
    # (the host tells Function names apart regardless of case)
    sharing = Counter(name.lower() for name in plain.values())
    names: dict[str, str] = {}
    for q, name in plain.items():
        if sharing[name.lower()] > 1 and name != f"{prefix}_{q}":
            digest = hashlib.sha256(q.encode()).hexdigest()[:8]
            name = f"{name[: MAX_FUNCTION_NAME - len(digest) - 1]}_{digest}"
        names[q] = name
    taken: dict[str, str] = {}
    for q, name in names.items():
        other = taken.setdefault(name.lower(), q)
        if other != q:  # (a queue whose own name is another's plain name with its digest: not by chance)
            raise ConfigurationError(
                "queue names",
                f"queues {other!r} and {q!r} would both be served by the Function {name!r}",
                "rename one of the queues",
            )
    return names


#: how a Key Vault reference in an app setting begins (``@Microsoft.KeyVault(SecretUri=...)``)
KEY_VAULT_REFERENCE = "@Microsoft.KeyVault("
#: the ops API's answer while QUEUEING_API_KEY is a reference the platform could not resolve (the
#: reference itself is not repeated: it names the vault and the secret)
UNRESOLVED_KEY = (
    "QUEUEING_API_KEY is an unresolved Key Vault reference (the platform could not read the secret): "
    "this API refuses every request until it resolves"
)


def unresolved_api_key(settings: QueueingSettings) -> bool:
    """Whether QUEUEING_API_KEY is a Key Vault reference the platform left unresolved: it then passes
    the reference text itself as the setting's value."""
    key = settings.api_key.get_secret_value() if settings.api_key else None
    return key is not None and key.startswith(KEY_VAULT_REFERENCE)


#: the setting :func:`load_settings` names when it refuses the API key
API_KEY_SETTING = "QUEUEING_API_KEY"


def settings_for_functions() -> tuple[QueueingSettings, str | None]:
    """The app settings, and why the ops API must refuse every request (None: no reason). A key the
    kit refuses (blank, whitespace at an end, a control character: a secret pasted with its newline is
    enough) is left out instead of failing indexing, which loaded no function at all: every queue
    trigger and timer stopped for a key only the HTTP function uses (found in review). Any other bad
    setting still fails indexing, naming it."""
    try:
        return load_settings(), None
    except ConfigurationError as exc:
        if exc.setting != API_KEY_SETTING:
            raise
        # the problem, without the advice after it (written for `queueing serve`); never the key itself
        problem = exc.problem.split(";", 1)[0]
    settings = load_settings(api_key=None)
    refusal = (
        f"{API_KEY_SETTING} {problem}: this API refuses every request until the setting holds a usable key"
    )
    log.error("%s (the queue triggers and timers run)", refusal)
    return settings, refusal


def usable_api_key(settings: QueueingSettings) -> str | None:
    """The ops API key, unless the platform left a Key Vault reference unresolved: it then passes the
    reference text itself, which anyone who can guess the vault's name could send. Without a key the
    ops API refuses every request."""
    if unresolved_api_key(settings):
        log.error(
            "QUEUEING_API_KEY is an unresolved Key Vault reference: the platform could not read the secret "
            "(the app's identity needs Key Vault Secrets User on the vault, and the site's "
            "keyVaultReferenceIdentity must name it); the ops API refuses every request until it resolves"
        )
        return None
    return settings.api_key.get_secret_value() if settings.api_key else None


class LazyAsgi:
    """The ops API, built on the first request: FastAPI is not imported at cold start. ``refusal``:
    why every request is refused (the API key the settings held was unusable), said in each answer."""

    def __init__(self, host: FunctionsHost, refusal: str | None = None) -> None:
        self.host = host
        self.refusal = refusal
        self._app: Any = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if self._app is None:
            from queueing_core.ops.api import create_app
            from queueing_core.ops.service import OpsService

            async def ops() -> OpsService:
                return OpsService(await self.host.runtime())

            self._app = create_app(
                ops,
                api_key=usable_api_key(self.host.settings),
                max_body_bytes=self.host.settings.api_max_body_bytes,
            )
        reason = self.refusal or (UNRESOLVED_KEY if unresolved_api_key(self.host.settings) else None)
        if scope["type"] == "http" and reason is not None:
            # refused here, whatever the auth level: the API's own refusal would say no key is set
            from queueing_core.ops.guard import WWW_AUTHENTICATE
            from queueing_core.ops.problems import problem

            refusal = problem(401, "unauthorized", reason, instance=scope["path"], headers=WWW_AUTHENTICATE)
            await refusal(scope, receive, send)
            return
        await self._app(scope, receive, send)


def _check_connections(transport: str, env: dict[str, str]) -> None:
    """A trigger without its connection setting would fail later in the host; say so at indexing. The
    same reading as the kit's at its open: an identity-based Storage connection without the Tables'
    URI (which the host's queue trigger does not need) failed every invocation there instead."""
    if transport == Transport.SERVICE_BUS:
        ServiceBusConnection.from_environment(SERVICEBUS_CONNECTION, env)
    if transport in (Transport.SERVICE_BUS, Transport.STORAGE_QUEUE):
        StorageConnection.from_environment(STORAGE_CONNECTION, env)  # queues and/or the Tables


#: the longest a worker's stop takes past its grace for running handlers (``queueing_core.worker``:
#: ``CLAIM_GRACE`` for claims still out and cancelled handlers, then ``CLOSE_FLOOR`` each for the final
#: settlement flush and the close); not imported: this module loads no more than it needs at cold start
STOP_BEYOND_GRACE = 20.0
#: what a processor run needs besides its budget before the host's functionTimeout ends the invocation
#: mid-settlement: the worker's stop (the grace handlers still running get, then the claims, the final
#: settlement flush and the close) and 10 s for opening the runtime on a cold start, before the budget
BUDGET_MARGIN = PROCESSOR_STOP_GRACE + STOP_BEYOND_GRACE + 10.0


_NO_HOST_JSON = object()


class _HostJson:
    """The host's settings as it reads them: an app setting overrides host.json
    (``AzureFunctionsJobHost__<path joined by __>``, any case). The file is read once, at the first
    setting asked for."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self._file: object = None
        self._read = False

    def setting(self, path: tuple[str, ...]) -> object:
        """None when neither sets it, ``_NO_HOST_JSON`` when there is no host.json (a test, a tool: not
        an app the host runs)."""
        wanted = "__".join(("azurefunctionsjobhost", *path)).lower()
        override = next((v for k, v in self.env.items() if k.lower().replace(":", "__") == wanted), None)
        if override is not None:
            return override
        value = self._load()
        if value is _NO_HOST_JSON:
            return value
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        return value

    def _load(self) -> object:
        import json
        import os

        if not self._read:
            self._read = True
            root = self.env.get("AzureWebJobsScriptRoot") or os.getcwd()
            try:
                with open(os.path.join(root, "host.json"), encoding="utf-8") as f:
                    self._file = json.load(f)
            except (OSError, ValueError):
                self._file = _NO_HOST_JSON
        return self._file


def _function_timeout(host: _HostJson) -> tuple[float, str] | None:
    """The host's ``functionTimeout`` (host.json, or its app setting) in seconds and as written; None
    where no host runs this app (no host.json: a test, a tool), for -1 (unbounded), and for a form the
    host reads and this does not."""
    import re

    timeout = host.setting(("functionTimeout",))
    if timeout is _NO_HOST_JSON:
        return None
    if timeout is None:  # the host's default: 5 minutes on the Consumption plan, else 30
        timeout = "00:05:00" if host.env.get("WEBSITE_SKU", "").lower() == "dynamic" else "00:30:00"
    found = re.fullmatch(r"(?:(\d+)\.)?(\d{1,2}):(\d{2}):(\d{2})(?:\.\d+)?", str(timeout).strip())
    if found is None:
        return None
    days, hours, minutes, seconds = (int(x or 0) for x in found.groups())
    return float(((days * 24 + hours) * 60 + minutes) * 60 + seconds), str(timeout)


def _check_budget(cfg: QueueingSettings, transport: Transport, timeout: tuple[float, str] | None) -> None:
    """A processor budget the host's ``functionTimeout`` (host.json) cuts short would stop runs
    mid-settlement on every busy timer: their leases lapse and the messages run again. Said at indexing."""
    delayed = transport is Transport.STORAGE_QUEUE and cfg.storage_delayed_store
    if not (transport is Transport.SQL or delayed) or timeout is None:
        return
    limit, written = timeout
    most = limit - BUDGET_MARGIN
    bound = function_timeout_bound(limit)
    if transport is Transport.SQL and bound is not None:
        # a run claimed at the start of the budget may go on to its end and the stop grace: within the
        # bound every run of the process is cut at (else it was cut as a failed attempt, where the
        # processor's drain expects to hand it back uncounted; found in review)
        most = min(most, bound.limit.total_seconds() - PROCESSOR_STOP_GRACE)
    if cfg.functions_processor_budget > most:
        raise ConfigurationError(
            "QUEUEING_FUNCTIONS_PROCESSOR_BUDGET",
            f"{cfg.functions_processor_budget:g} s leaves a run no time to stop and settle before "
            f"the host's functionTimeout ({written}) ends it: its messages would run again",
            f"at most {max(1.0, most):g}, or a longer functionTimeout",
        )


#: the Storage Queues trigger's default maxDequeueCount
DEFAULT_DEQUEUE_COUNT = 5


def _check_dequeue_count(qapp: QueueingApp, transport: Transport, host: _HostJson) -> None:
    """The Storage trigger's ``maxDequeueCount`` must exceed every queue's ``max_attempts``: a message
    whose runs all died unsettled (the process, a timeout) then reaches the kit once more, which
    dead-letters it with its reason and records it. At ``max_attempts`` the host moved it to
    ``-poison`` itself, unrecorded. Said at indexing."""
    if transport is not Transport.STORAGE_QUEUE:
        return
    found = host.setting(("extensions", "queues", "maxDequeueCount"))
    if found is _NO_HOST_JSON:
        return
    try:
        limit = DEFAULT_DEQUEUE_COUNT if found is None else int(str(found))
    except ValueError:
        return  # a form the host reads and this does not: nothing said
    most = max((s.options.max_attempts for s in qapp.subscriptions()), default=0)
    if most >= limit:
        raise ConfigurationError(
            "extensions.queues.maxDequeueCount (host.json)",
            f"{limit} is not above the largest max_attempts ({most}): a message whose runs all died "
            "unsettled would go to the poison queue unrecorded, with no reason",
            f"at least {most + 1}",
        )


def _check_shared_state(cfg: QueueingSettings, transport: Transport) -> None:
    """State every instance must share may not live in a SQLite file: on Azure Functions each instance
    has a file of its own, so messages, pauses and delays would scatter between instances."""
    if transport is Transport.SQL:
        what = "the SQL transport's queues"
    elif transport is Transport.STORAGE_QUEUE and cfg.storage_delayed_store:
        what = "the delayed-message store (QUEUEING_STORAGE_DELAYED_STORE=true)"
    else:
        return
    if not cfg.database_url.lower().startswith("sqlite"):
        return
    given = "database_url" in cfg.model_fields_set
    state = "is SQLite" if given else "is not set (the default is a SQLite file)"
    problem = f"{state}: {what} would be a separate file on every Functions instance"
    if cfg.functions_local_sqlite:  # one host on a developer's machine: a file is shared enough
        log.warning(
            "QUEUEING_DATABASE_URL %s; allowed by QUEUEING_FUNCTIONS_LOCAL_SQLITE for one local host", problem
        )
        return
    raise ConfigurationError(
        "QUEUEING_DATABASE_URL",
        problem,
        "a PostgreSQL URL; QUEUEING_FUNCTIONS_LOCAL_SQLITE=true allows SQLite for a single local host",
    )


def build_app(
    settings: QueueingSettings | None = None,
    queueing_app: QueueingApp | None = None,
    *,
    host: FunctionsHost | None = None,
    env: dict[str, str] | None = None,
) -> func.AsgiFunctionApp:
    """The Functions app for ``queueing_app`` (default: ``QUEUEING_APP``) on the configured transport."""
    import os

    key_refusal = None
    if settings is None:
        settings, key_refusal = settings_for_functions()
    cfg = settings
    qapp = queueing_app or load_app(cfg.app, setting="QUEUEING_APP")
    transport = Transport(cfg.provider)
    if transport is Transport.INPROCESS:
        raise ConfigurationError(
            "QUEUEING_PROVIDER", "'inprocess' cannot serve Azure Functions", "servicebus, storage_queue, sql"
        )
    if transport in (Transport.RABBITMQ, Transport.SQS):
        raise ConfigurationError(
            "QUEUEING_PROVIDER",
            f"{transport.value!r} has no Functions trigger here",
            "servicebus, storage_queue, sql",
        )
    env = dict(os.environ) if env is None else env
    _check_connections(transport, env)
    # OpenTelemetry asked for but not installed (Azure installs requirements.txt only) failed every
    # invocation at the runtime's open; instrumenting is idempotent, so the runtime's call is a no-op
    instrumented(qapp, cfg)
    if cfg.queue_prefix or cfg.queue_suffix:
        from queueing_core.naming import QueueNaming

        qapp.naming = QueueNaming(cfg.queue_prefix, cfg.queue_suffix)
    _check_shared_state(cfg, transport)
    host_json = _HostJson(env)
    timeout = _function_timeout(host_json)
    _check_budget(cfg, transport, timeout)
    _check_dequeue_count(qapp, transport, host_json)
    if transport in (Transport.STORAGE_QUEUE, Transport.SERVICE_BUS):
        # (a name the service refuses, the host's own -poison queue's included, failed every invocation
        # of every function at the runtime's open instead; found in review)
        check_names(qapp, (transport,))
    # a handler running into the host's functionTimeout ends every invocation of its process: cut first
    the_host = host or FunctionsHost(
        qapp, cfg, run_bound=function_timeout_bound(timeout[0] if timeout is not None else None)
    )
    app = func.AsgiFunctionApp(
        app=LazyAsgi(the_host, key_refusal),
        http_auth_level=_http_auth_level(cfg, key_given=key_refusal is not None),
    )
    triggers = {
        Transport.STORAGE_QUEUE: ("queue", _storage_trigger),
        Transport.SERVICE_BUS: ("servicebus", _servicebus_trigger),
    }
    if transport in triggers:
        prefix, trigger = triggers[transport]
        subs = qapp.subscriptions()
        names = function_names(prefix, [sub.queue for sub in subs])
        for sub in subs:
            trigger(app, the_host, sub, sub.physical_queue(qapp.naming, transport), names[sub.queue])
    _timers(app, the_host, cfg, transport)
    return app


def _http_auth_level(cfg: QueueingSettings, *, key_given: bool = False) -> func.AuthLevel:
    """The platform's check in front of the ops API and the dashboard. Anonymous leaves the kit's API
    key as the only one, so it is refused without a key (the API would then refuse every request).
    ``key_given``: a key was set but left out as unusable (the ops API refuses every request, saying
    why), which, like an unresolved Key Vault reference, stops only the HTTP function."""
    if cfg.functions_http_auth_level == "anonymous":
        if cfg.api_key is None and not key_given:
            raise ConfigurationError(
                "QUEUEING_FUNCTIONS_HTTP_AUTH_LEVEL",
                "'anonymous' leaves the API key as the only check, and QUEUEING_API_KEY is not set",
                "set QUEUEING_API_KEY, or keep 'function'",
            )
        # An unresolved Key Vault reference is logged, and the ops API refuses every request (LazyAsgi)
        # until it resolves; failing here instead loaded no function at all, so every queue trigger and
        # timer stopped for want of a key only the HTTP function uses (found in review)
        usable_api_key(cfg)
        return func.AuthLevel.ANONYMOUS
    return func.AuthLevel.FUNCTION


def _continuing(context: Any) -> None:
    """Hand the invocation's trace (the host's ``traceparent``) to tracing, when there is one."""
    trace = getattr(context, "trace_context", None)
    parent = getattr(trace, "trace_parent", None) or getattr(trace, "Traceparent", None)
    if parent:
        state = getattr(trace, "trace_state", None) or getattr(trace, "Tracestate", None) or ""
        host_trace.set((str(parent), str(state)))


def _storage_trigger(
    app: func.FunctionApp, host: FunctionsHost, sub: Subscription, queue: str, name: str
) -> None:
    # ``context`` is annotated with the class itself, not ``func.Context | None``: the Python worker
    # refuses, at indexing, a ``context`` whose type hint is not a class named Context (a union failed
    # the whole app's indexing: 0 functions loaded). The None default is for callers without one (tests)
    async def on_message(msg: func.QueueMessage, context: func.Context = None) -> None:  # type: ignore[assignment]
        _continuing(context)  # each invocation runs in its own task: the value stays with it
        await host.on_storage_message(sub, msg)

    on_message.__name__ = name
    app.function_name(name)(
        app.queue_trigger(arg_name="msg", queue_name=queue, connection=STORAGE_CONNECTION)(on_message)
    )


def _servicebus_trigger(
    app: func.FunctionApp, host: FunctionsHost, sub: Subscription, queue: str, name: str
) -> None:
    # the SDK-type binding: the worker reads these annotations to hand over the message and its actions
    import azurefunctions.extensions.bindings.servicebus as servicebus

    from .servicebus_delivery import capture_delivery_counts

    capture_delivery_counts()  # the delivery count the extension's decoder drops (see that module)

    async def on_message(msg: Any, message_actions: Any, context: Any = None) -> None:
        _continuing(context)
        await host.on_servicebus_message(sub, msg, message_actions)

    on_message.__annotations__ = {
        "msg": servicebus.ServiceBusReceivedMessage,
        "message_actions": servicebus.ServiceBusMessageActions,
        "context": func.Context,
        "return": None,
    }
    on_message.__name__ = name
    trigger = app.service_bus_queue_trigger(
        arg_name="msg", queue_name=queue, connection=SERVICEBUS_CONNECTION, auto_complete_messages=False
    )
    app.function_name(name)(trigger(on_message))


def _timers(app: func.FunctionApp, host: FunctionsHost, cfg: QueueingSettings, transport: Transport) -> None:
    def timer(name: str, schedule: str, work: Any) -> None:
        async def tick(timer: func.TimerRequest) -> None:
            if timer.past_due:
                log.info("%s is running late (past due)", name)
            done = await work()
            if done:
                log.info(
                    "%s: %s", name, ", ".join(f"{k}={v}" for k, v in done.items() if v) or "nothing to do"
                )

        tick.__name__ = name
        app.function_name(name)(
            app.timer_trigger(schedule=schedule, arg_name="timer", run_on_startup=False, use_monitor=True)(
                tick
            )
        )

    if transport is Transport.SQL:

        async def process() -> None:
            await host.process_sql(cfg.functions_processor_budget)

        timer("queueing_sql_processor", cfg.functions_processor_schedule, process)
        timer("queueing_lease_sweeper", cfg.functions_sweeper_schedule, host.sweep_leases)
    timer("queueing_retention", cfg.functions_retention_schedule, host.retention)
    if transport is Transport.STORAGE_QUEUE and cfg.storage_delayed_store:

        async def dispatch() -> dict[str, int]:
            return await host.dispatch_delayed(cfg.functions_processor_budget)

        timer("queueing_delayed_dispatcher", cfg.functions_delayed_schedule, dispatch)
    if len(host.app.schedules):
        timer("queueing_schedules", cfg.functions_schedules_schedule, host.run_schedules)
