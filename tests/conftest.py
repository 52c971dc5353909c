import asyncio
import re
import shutil
import subprocess

pytest_plugins = ["tests.azurite"]

#: the names tests give their queues (a fresh ``t<8 hex>-`` prefix each): durable on the shared broker
TEST_QUEUE = re.compile(r"t[0-9a-f]{8}-")


def _leftover_rabbitmq_queues() -> list[str]:
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
    return [n for n in out.split() if TEST_QUEUE.match(n)]


async def _delete_queues(names: list[str]) -> None:
    import aio_pika

    from tests.services import RABBITMQ_URL

    connection = await aio_pika.connect(RABBITMQ_URL)
    async with connection:
        channel = await connection.channel()
        for name in names:
            await channel.queue_delete(name)


def pytest_sessionfinish(session, exitstatus):
    """Delete the test queues left on RabbitMQ: left to pile up (1,600 after a day of runs), they
    make the broker's start-up recovery outrun its file handles and the restart test hang."""
    from tests.services import reachable

    if not reachable("127.0.0.1", 5672):
        return
    names = _leftover_rabbitmq_queues()
    if names:
        asyncio.run(_delete_queues(names))
