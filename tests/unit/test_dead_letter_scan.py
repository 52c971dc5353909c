"""The dead-letter locator's order when an operator retries: find and hold, hand back what it passed,
send the copy, remove only what it found. Its failure paths, on pages that record every call (the
transports' own pages are run by tests/contract/test_ops_retry_races.py)."""

from __future__ import annotations

from typing import Any

import pytest

from queueing_core.providers.dead_letters import scan_dead_letters


class Pages:
    """A dead-letter queue of (key, message id) letters, one a page; ``fail_on_page`` makes that read
    raise (a link detached mid-scan)."""

    keys_outlive_holds = True

    def __init__(self, letters: list[tuple[int, str]], fail_on_page: int | None = None) -> None:
        self.letters, self.fail_on_page = list(letters), fail_on_page
        self.pos = self.reads = 0
        self.handed: list[Any] = []
        self.removed: list[Any] = []

    async def next_page(self) -> list[tuple[int, str]]:
        self.reads += 1
        if self.reads == self.fail_on_page:
            raise RuntimeError("link detached")
        page = self.letters[self.pos : self.pos + 1]
        self.pos += 1
        return page

    def message_id(self, item: tuple[int, str]) -> str:
        return item[1]

    def key(self, item: tuple[int, str]) -> int:
        return item[0]

    async def remove(self, item: tuple[int, str]) -> None:
        self.removed.append(item)

    async def total(self) -> int | None:
        return None

    async def hand_back(self, items: list[Any]) -> None:
        self.handed.extend(items)


class Sends:
    """The copy a retry sends before its letter is removed: counted, nothing sent."""

    def __init__(self) -> None:
        self.sent: list[int] = []

    async def __call__(self) -> None:
        self.sent.append(1)


async def test_a_letter_found_before_the_read_fails_is_handed_back_and_no_copy_is_sent():
    """It stayed hidden until its hold lapsed, out of sight of a retry repeated meanwhile (found in
    review)."""
    pages = Pages([(1, "a"), (2, "b"), (3, "c")], fail_on_page=3)
    send = Sends()

    with pytest.raises(RuntimeError):
        await scan_dead_letters(pages, {"a"}, before_removing=send)
    assert sorted(pages.handed) == [(1, "a"), (2, "b")]
    assert send.sent == []
    assert pages.removed == []


async def test_the_copy_is_sent_after_the_read_and_only_the_letters_found_go():
    pages = Pages([(1, "a"), (2, "b"), (3, "a")])
    order: list[str] = []

    async def send() -> None:
        order.append(f"send after {len(pages.handed)} handed back")
        pages.letters.append((4, "a"))  # the copy, dead-lettered again meanwhile: a letter of its own

    found = await scan_dead_letters(pages, {"a"}, before_removing=send)
    assert found == {"a"}
    assert order == ["send after 1 handed back"]  # (2, "b") went back before the send
    assert pages.removed == [(1, "a"), (3, "a")]  # not (4, "a")


async def test_a_failed_send_hands_the_letters_found_back_and_removes_none():
    pages = Pages([(1, "a"), (2, "b")])

    async def send() -> None:
        raise RuntimeError("the copy was not sent")

    with pytest.raises(RuntimeError):
        await scan_dead_letters(pages, {"a"}, before_removing=send)
    assert pages.removed == []
    assert sorted(pages.handed) == [(1, "a"), (2, "b")]


async def test_a_removal_that_fails_hands_back_the_rest_of_its_page():
    """A page of several letters (Service Bus reads up to a batch): the letters read after the one
    whose removal failed are handed back too, not left held until their locks lapse (found in
    review)."""

    class Pages3(Pages):
        async def next_page(self) -> list[tuple[int, str]]:
            page, self.letters = self.letters[:3], self.letters[3:]
            return page

        async def remove(self, item: tuple[int, str]) -> None:
            raise RuntimeError("the link dropped")

    pages = Pages3([(1, "a"), (2, "b"), (3, "c")])
    with pytest.raises(RuntimeError):
        await scan_dead_letters(pages, None)
    assert sorted(pages.handed) == [(1, "a"), (2, "b"), (3, "c")]


async def test_a_retry_whose_letter_lies_past_the_scans_limit_sends_nothing_and_says_why():
    """The scan reads at most ``limit`` letters: where it stopped without meeting the letter, the copy
    was sent all the same, and the letter stayed, out of every listing, to run the message again at a
    later retry (found in review). Nothing is sent now, and every letter read goes back."""
    from queueing_core.errors import InvalidOperation

    pages = Pages([(1, "a"), (2, "b"), (3, "c")])
    send = Sends()

    with pytest.raises(InvalidOperation, match="not among the first 2 letters"):
        await scan_dead_letters(pages, {"c"}, before_removing=send, limit=2)
    assert send.sent == []
    assert pages.removed == []
    assert sorted(pages.handed) == [(1, "a"), (2, "b"), (3, "c")]  # (the third read to know there was more)


async def test_a_letter_found_within_the_limit_is_retried_though_the_scan_stopped_there():
    pages = Pages([(1, "a"), (2, "b"), (3, "c")])
    send = Sends()

    assert await scan_dead_letters(pages, {"a"}, before_removing=send, limit=2) == {"a"}
    assert send.sent == [1]
    assert pages.removed == [(1, "a")]


async def test_a_queue_of_exactly_the_limit_is_read_to_its_end():
    """A queue of ``limit`` letters was read to its end but not known to be: a retry whose letter it no
    longer holds (the history the only copy left, a Storage poison letter past its lifetime) was
    refused as if the letter lay further on (found in review). One more read tells them apart."""
    pages = Pages([(1, "a"), (2, "b")])
    send = Sends()

    assert await scan_dead_letters(pages, {"c"}, before_removing=send, limit=2) == set()
    assert send.sent == [1]
    assert sorted(pages.handed) == [(1, "a"), (2, "b")]


class LapsingPages(Pages):
    """Pages of two letters whose holds lapse after ``lapse_after`` reads: the letters passed over
    come back first, ahead of those not read yet (Service Bus hands out a letter whose lock lapsed in
    its sequence order), as in a scan slower than its holds."""

    def __init__(self, letters: list[tuple[int, str]], lapse_after: int) -> None:
        super().__init__(letters)
        self.lapse_after = lapse_after
        self.back: list[tuple[int, str]] = []

    async def next_page(self) -> list[tuple[int, str]]:
        self.reads += 1
        if self.reads == self.lapse_after + 1:
            self.back = self.letters[: self.pos]  # every hold so far lapsed
        if self.back:
            page, self.back = self.back[:2], self.back[2:]
            return page
        page = self.letters[self.pos : self.pos + 2]
        self.pos += 2
        return page


LETTERS = [(1, "a"), (2, "b"), (3, "c"), (4, "d"), (5, "e"), (6, "f")]


async def test_a_retry_whose_scan_outlasts_its_holds_sends_nothing_and_says_why():
    """A page of letters met before (their holds lapsed) was taken for the end of the queue: a retry of
    a letter further on sent its copy, removed nothing and reported success, and the letter stayed
    where no listing shows it (found in review)."""
    from queueing_core.errors import InvalidOperation

    pages = LapsingPages(LETTERS, lapse_after=2)
    send = Sends()

    with pytest.raises(InvalidOperation, match="took longer than it may hold them"):
        await scan_dead_letters(pages, {"f"}, before_removing=send)
    assert send.sent == []
    assert pages.removed == []
    assert sorted(pages.handed) == LETTERS[:4]  # every letter read goes back


async def test_a_letter_located_before_the_holds_lapsed_is_still_retried():
    pages = LapsingPages(LETTERS, lapse_after=2)
    send = Sends()

    assert await scan_dead_letters(pages, {"c"}, before_removing=send) == {"c"}
    assert send.sent == [1]
    assert pages.removed == [(3, "c")]


async def test_a_page_with_new_letters_after_letters_met_again_reads_on():
    """A letter met again ahead of a new one on the same page: the scan reads on to the end of the
    queue and finds the letter after them."""

    class Scripted(Pages):
        def __init__(self, script: list[list[tuple[int, str]]]) -> None:
            super().__init__([])
            self.script = script

        async def next_page(self) -> list[tuple[int, str]]:
            return self.script.pop(0) if self.script else []

    pages = Scripted([[(1, "a"), (2, "b")], [(1, "a"), (3, "c")], [(4, "d")]])
    send = Sends()

    assert await scan_dead_letters(pages, {"d"}, before_removing=send) == {"d"}
    assert send.sent == [1]
    assert pages.removed == [(4, "d")]


async def test_a_scan_that_outlasts_its_holds_at_the_limit_does_not_take_the_queue_for_read():
    """At the limit the one more read that tells the end apart returned only letters met before: the
    queue was taken for exactly ``limit`` long and a retry of a letter further on sent its copy."""
    from queueing_core.errors import InvalidOperation

    pages = LapsingPages(LETTERS, lapse_after=2)
    send = Sends()

    with pytest.raises(InvalidOperation, match="nothing was sent"):
        await scan_dead_letters(pages, {"f"}, before_removing=send, limit=4)
    assert send.sent == []
    assert pages.removed == []
