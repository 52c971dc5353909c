import asyncio
import shutil
import subprocess

# schemathesis's pytest plugin imports its HTML report writer at the session's end, through pytest's
# assertion rewriter, whose parse then failed on CPython 3.11.7 after a failing test ("AST constructor
# recursion depth mismatch") and hid the failures' report; imported now, it is parsed before any test
import schemathesis.reporting.html.writer  # noqa: F401

pytest_plugins = ["tests.azurite", "tests.hung_tasks", "tests.scram_postgres", "tests.tls"]


def _leftover_rabbitmq_queues(prefixes: set[str]) -> list[str]:
    if shutil.which("rabbitmqctl") is None:
        return []
    try:
        out = subprocess.run(
            ["rabbitmqctl", "list_queues", "-q", "--no-table-headers", "name"],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [n for n in out.split() if n[:10] in prefixes]


async def _delete_queues(names: list[str]) -> None:
    import aio_pika

    from tests.services import RABBITMQ_URL

    connection = await aio_pika.connect(RABBITMQ_URL)
    async with connection:
        channel = await connection.channel()
        for name in names:
            await channel.queue_delete(name)


def pytest_sessionfinish(session, exitstatus):
    """Delete the queues this session left on RabbitMQ: left to pile up (1,600 after a day of runs),
    they make the broker's start-up recovery outrun its file handles and the restart test hang. Only
    names under the prefixes this session handed out: other sessions may share the broker."""
    from tests.services import SESSION_PREFIXES, reachable

    if not SESSION_PREFIXES or not reachable("127.0.0.1", 5672):
        return
    names = _leftover_rabbitmq_queues(SESSION_PREFIXES)
    if names:
        asyncio.run(_delete_queues(names))
