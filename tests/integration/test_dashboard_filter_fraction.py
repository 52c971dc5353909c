"""Dashboard: a time filter with a fraction of a second is carried on whole.

The filters a list page carries on (the bulk actions' hidden fields, the next-page link) were written
with strftime('%Y-%m-%dT%H:%M:%S'), dropping the fraction: a list filtered `created_from=...:00.500`
showed one message, and its "Purge all…" then confirmed and deleted two; its next page listed
messages the first page's filter left out.
"""

from __future__ import annotations

import html
import re
from datetime import UTC, datetime, timedelta

from queueing_core import QueueingApp, QueueMessage, queue
from queueing_core.ops.ui.pages import PAGE_SIZE
from queueing_core.providers.sql import SqlProvider
from queueing_core.runtime import Runtime
from tests.contract.harness import ops_client

ROW = 'href="/api/_system/queueing/ui/messages/'


@queue("filter-fraction")
class Ping(QueueMessage):
    n: int


def _hidden(text: str, form_id: str) -> dict[str, str]:
    form = text.split(f'id="{form_id}"', 1)[1].split("</form>", 1)[0]
    return {
        k: html.unescape(v)
        for k, v in re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)">', form)
    }


async def test_bulk_forms_and_the_next_page_keep_the_fraction_of_a_second(tmp_path):
    app = QueueingApp("filter-fraction")
    app.message(Ping)
    rt = Runtime(app, SqlProvider(f"sqlite:///{tmp_path}/q.db", listen=False))
    await rt.open()
    try:
        base = datetime.now(UTC).replace(microsecond=0) - timedelta(seconds=10)
        await app.enqueue(Ping(n=0, created_at=base + timedelta(milliseconds=200)))  # before the filter
        after = [Ping(n=n, created_at=base + timedelta(milliseconds=700)) for n in range(1, PAGE_SIZE + 2)]
        await app.enqueue_many(after)
        start = (base + timedelta(milliseconds=500, microseconds=250)).strftime("%Y-%m-%dT%H:%M:%S.%f")
        end = (base + timedelta(seconds=1, milliseconds=100)).strftime("%Y-%m-%dT%H:%M:%S.%f")
        params = {"queue": "filter-fraction", "created_from": start, "created_to": end}
        async with ops_client(rt) as client:
            listed = (await client.get("/ui/messages", params=params)).text
            assert listed.count(ROW) == PAGE_SIZE

            # the bulk action confirms (and would act on) the messages the filter selects
            hidden = _hidden(listed, "bulk-h")
            confirm = await client.post("/ui/bulk", data={**hidden, "action": "purge", "step": "confirm"})
            count = re.search(r"Delete <strong>(\d+)</strong>", confirm.text)
            assert count is not None, confirm.text[:300]
            assert count.group(1) == str(PAGE_SIZE + 1), hidden
            assert datetime.fromisoformat(hidden["created_from"]) == datetime.fromisoformat(start + "+00:00")

            # the next page holds the one message the first page had no room for, not the earlier one
            link = re.search(r'href="/api/_system/queueing(/ui/messages\?[^"]*)" rel="next"', listed)
            assert link is not None
            second = (await client.get(html.unescape(link.group(1)))).text
            assert second.count(ROW) == 1

            # the inputs show the fraction (to the millisecond) with a step that lets the form be sent
            assert re.search(
                r'name="created_from" type="datetime-local" step="0.001" value="[^"]*:\d\d\.500"', listed
            )
            assert re.search(
                r'name="created_to" type="datetime-local" step="0.001" value="[^"]*:\d\d\.100"', listed
            )
            whole = (
                await client.get("/ui/messages", params={"created_from": base.strftime("%Y-%m-%dT%H:%M:%S")})
            ).text
            assert re.search(r'name="created_from" type="datetime-local" step="1" value="[^"]*:\d\d"', whole)
    finally:
        await rt.close()
