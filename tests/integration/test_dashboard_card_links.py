"""Dashboard: the links on a queue's card list what the card counted.

A card's counts are unarchived messages ("1 DeadLettered", "Dead letters (1)"). Its links used to be
`messages?queue=..&status=DeadLettered` without `archived=false`: the list behind "1" showed the
archived dead letter too, and its "Retry all…" / "Purge all…" counted and acted on both.
"""

from __future__ import annotations

import html
import re

from queueing_core import MessageStatus, NonRetryableError, QueueingApp, QueueMessage, queue
from queueing_core.ops.service import OpsService
from queueing_core.providers.sql import SqlProvider
from queueing_core.runtime import Runtime
from tests.contract.harness import all_have, ops_client, running, wait_until

UI = "/api/_system/queueing/ui"
ROW = 'href="/api/_system/queueing/ui/messages/'


@queue("card-links", max_attempts=1)
class Doomed(QueueMessage):
    n: int


def _href(text: str, pattern: str) -> str:
    """The first link whose tag matches ``pattern``, as the browser would request it."""
    found = re.search(rf'<a (?:class="button" )?href="({re.escape(UI)}/messages\?[^"]*)"[^>]*{pattern}', text)
    assert found is not None, pattern
    return html.unescape(found.group(1)).removeprefix("/api/_system/queueing")


async def test_the_list_behind_a_count_is_what_was_counted(tmp_path):
    app = QueueingApp("card-links")

    @app.handler()
    async def fail(msg: Doomed) -> None:
        raise NonRetryableError("no")

    rt = Runtime(app, SqlProvider(f"sqlite:///{tmp_path}/q.db", listen=False))
    await rt.open()
    try:
        ids = [(await app.enqueue(Doomed(n=n))).message_id for n in (1, 2, 3)]
        async with running(rt):
            await wait_until(lambda: all_have(rt, ids, MessageStatus.DEAD_LETTERED), what="dead letters")
        await OpsService(rt).archive(ids[0])
        async with ops_client(rt) as client:
            overview = (await client.get("/ui/")).text
            shown = int(re.search(r'<span class="n">(\d+)</span> DeadLettered', overview).group(1))
            assert shown == 2
            assert "Dead letters (2)" in overview
            for link in (
                _href(overview, r'data-status="DeadLettered"'),  # the count
                _href(overview, r">Dead letters \(2\)"),  # the button
                _href(overview, r">card-links</a></h2>"),  # the card's title
            ):
                listed = await client.get(link)
                assert listed.status_code == 200
                assert listed.text.count(ROW) == shown, link
                assert "archived=false" in link, link

            # the bulk action offered on that list counts (and would act on) those two only
            link = _href(overview, r'data-status="DeadLettered"')
            listed = (await client.get(link)).text
            form = listed.split('id="bulk-h"', 1)[1].split("</form>", 1)[0]
            hidden = dict(re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)">', form))
            assert hidden.get("archived") == "false", hidden
            confirm = await client.post("/ui/bulk", data={**hidden, "action": "purge", "step": "confirm"})
            assert re.search(r"Delete <strong>(\d+)</strong>", confirm.text).group(1) == str(shown)
    finally:
        await rt.close()
