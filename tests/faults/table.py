"""THE table of the fault suite: sequences x providers -> the steps (calls to stores and brokers) each
sequence makes there, in order. Every step of every row is made to fail twice, once with the SDK's or
driver's own exception and once with a crash that stops the process right there, and a baseline runs
each row without a fault and checks that its calls are still the steps listed here (a sequence that
changes its calls fails its baseline, which prints the new list to paste here).

A new sequence (``sequences.SEQUENCES``) or provider (``kits.KITS``) gets its cases by adding its row.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from .kits import KITS
from .sequences import SEQUENCES, Sequence

STEPS: dict[tuple[str, str], tuple[str, ...]] = {
    ("succeed", "inprocess"): ("memory.settle", "history.upsert"),
    ("succeed", "sqlite"): ("sqlite.round_trip",),
    ("succeed", "postgres"): ("pg.round_trip",),
    ("succeed", "storage_queue"): ("queue.delete_message", "history.upsert"),
    ("succeed", "servicebus"): ("sb.complete_message", "history.upsert"),
    ("succeed", "rabbitmq"): ("amqp.ack", "history.upsert"),
    ("succeed", "sqs"): ("leases.holding", "sqs.delete_message_batch", "history.upsert"),
    # a retry or a pause due again at once is recorded by the late write's rule (``upsert_newer``):
    # its next run, on another host, may record first
    ("retry_by_copy", "inprocess"): ("memory.settle", "history.upsert_newer"),
    ("retry_by_copy", "sqlite"): ("sqlite.round_trip",),
    ("retry_by_copy", "postgres"): ("pg.round_trip",),
    ("retry_by_copy", "storage_queue"): ("queue.update_message", "history.upsert_newer"),
    # (Service Bus: the lock renewed first, so a run whose lock already lapsed sends no copy)
    ("retry_by_copy", "servicebus"): (
        "sb.renew_message_lock",
        "sb.send_messages",
        "sb.complete_message",
        "history.upsert_newer",
    ),
    ("retry_by_copy", "rabbitmq"): ("delayed.store_many", "amqp.ack", "history.upsert_newer"),
    ("retry_by_copy", "sqs"): (
        "leases.holding",
        "sqs.send_message_batch",
        "sqs.delete_message_batch",
        "history.upsert_newer",
    ),
    ("pause_by_copy", "inprocess"): ("memory.settle", "history.upsert_newer"),
    ("pause_by_copy", "sqlite"): ("sqlite.round_trip",),
    ("pause_by_copy", "postgres"): ("pg.round_trip",),
    ("pause_by_copy", "storage_queue"): (
        "queue.update_message",
        "queue.send_message",
        "queue.delete_message",
        "history.upsert_newer",
    ),
    ("pause_by_copy", "servicebus"): (
        "sb.renew_message_lock",
        "sb.send_messages",
        "sb.complete_message",
        "history.upsert_newer",
    ),
    ("pause_by_copy", "rabbitmq"): ("delayed.store_many", "amqp.ack", "history.upsert_newer"),
    ("pause_by_copy", "sqs"): (
        "leases.holding",
        "sqs.send_message_batch",
        "sqs.delete_message_batch",
        "history.upsert_newer",
    ),
    ("dead_letter", "inprocess"): ("memory.settle", "history.upsert"),
    ("dead_letter", "sqlite"): ("sqlite.round_trip",),
    ("dead_letter", "postgres"): ("pg.round_trip",),
    ("dead_letter", "storage_queue"): (
        "queue.update_message",
        "queue.send_message",
        "queue.delete_message",
        "history.upsert",
    ),
    ("dead_letter", "servicebus"): ("sb.dead_letter_message", "history.upsert"),
    ("dead_letter", "rabbitmq"): ("amqp.publish", "amqp.ack", "history.upsert"),
    ("dead_letter", "sqs"): (
        "leases.holding",
        "sqs.send_message_batch",
        "sqs.delete_message_batch",
        "history.upsert",
    ),
    # one round trip: the settlement and the next claim in one pipeline (one transaction)
    ("retry_with_claim", "sqlite"): ("sqlite.round_trip",),
    ("retry_with_claim", "postgres"): ("pg.round_trip",),
    # the batch and the refused one alone fail before any statement: the prepared one alone is the step
    ("retry_beside_a_refused_one", "sqlite"): ("sqlite.round_trip",),
    ("retry_beside_a_refused_one", "postgres"): ("pg.round_trip",),
    ("dead_letter_with_claim", "sqlite"): ("sqlite.round_trip",),
    ("dead_letter_with_claim", "postgres"): ("pg.round_trip",),
    ("expiry", "inprocess"): ("memory.settle", "history.upsert"),
    ("expiry", "sqlite"): ("sqlite.round_trip",),
    ("expiry", "postgres"): ("pg.round_trip",),
    ("expiry", "storage_queue"): ("queue.delete_message", "history.upsert"),
    ("expiry", "servicebus"): ("sb.dead_letter_message", "history.upsert"),
    ("expiry", "rabbitmq"): ("amqp.publish", "amqp.ack", "history.upsert"),
    ("expiry", "sqs"): (
        "leases.holding",
        "sqs.send_message_batch",
        "sqs.delete_message_batch",
        "history.upsert",
    ),
    # the run reads the identity's document and marks the message started in it (compare-and-set)
    # before it expires it; then the expiry's own steps
    ("idempotent_expiry", "inprocess"): (
        "control.identity_doc",
        "control.put_identity_doc",
        "memory.settle",
        "history.upsert",
    ),
    ("idempotent_expiry", "storage_queue"): (
        "control.identity_doc",
        "control.put_identity_doc",
        "queue.delete_message",
        "history.upsert",
    ),
    ("idempotent_expiry", "servicebus"): (
        "control.identity_doc",
        "control.put_identity_doc",
        "sb.dead_letter_message",
        "history.upsert",
    ),
    ("idempotent_expiry", "rabbitmq"): (
        "control.identity_doc",
        "control.put_identity_doc",
        "amqp.publish",
        "amqp.ack",
        "history.upsert",
    ),
    ("idempotent_expiry", "sqs"): (
        "control.identity_doc",
        "control.put_identity_doc",
        "leases.holding",
        "sqs.send_message_batch",
        "sqs.delete_message_batch",
        "history.upsert",
    ),
    ("operator_retry", "inprocess"): ("history.change_if_unchanged", "memory._forget", "memory.send"),
    # the control state read first (three tables: a cancel request to withdraw?), then the retry
    ("operator_retry", "sqlite"): (
        "sql.execute",
        "sql.execute",
        "sql.execute",
        "sql.execute",
        "sql.execute",
        "sql.commit",
    ),
    ("operator_retry", "postgres"): (
        "sql.execute",
        "sql.execute",
        "sql.execute",
        "sql.execute",
        "sql.execute",
        "sql.execute",
        "sql.commit",
    ),
    # the dead letters are found (and held) first, then the history reopened, the copy sent and only
    # the letters found removed: a copy dead-lettered again meanwhile keeps its new letter
    ("operator_retry", "storage_queue"): (
        "queue.receive_messages",
        "queue.receive_messages",
        "history.change_if_unchanged",
        "queue.send_message",
        "queue.delete_message",
    ),
    # the fault app's lock (1 s) lapses while the scan waits for the end of the queue: the first
    # complete is refused and the letter is found again by its sequence number
    ("operator_retry", "servicebus"): (
        "sb.receive_messages",
        "sb.receive_messages",
        "history.change_if_unchanged",
        "sb.send_messages",
        "sb.complete_message",
        "sb.receive_messages",
        "sb.complete_message",
    ),
    # (a scan ends on two empty gets: a letter handed to its consumer just before may be written
    # after the first answer, never after the second; here the one letter is the consumer's)
    ("operator_retry", "rabbitmq"): (
        "amqp.get",
        "amqp.get",
        "amqp.get",
        "amqp.get",
        "history.change_if_unchanged",
        "amqp.publish",
        "amqp.ack",
    ),
    ("operator_retry", "sqs"): (
        "sqs.receive_message",
        "sqs.receive_message",
        "history.change_if_unchanged",
        "sqs.send_message_batch",
        "sqs.delete_message",
    ),
    ("purge", "inprocess"): ("memory._forget", "history.delete"),
    # a batch's ids selected, those rows deleted (the batches are short transactions), then the count
    # of the rows a worker holds, which the purge leaves
    ("purge", "sqlite"): ("sql.execute", "sql.execute", "sql.commit", "sql.execute"),
    ("purge", "postgres"): ("sql.execute", "sql.execute", "sql.commit", "sql.execute"),
    ("purge", "storage_queue"): (
        "queue.receive_messages",
        "queue.delete_message",
        "queue.receive_messages",
        "history.delete",
    ),
    ("purge", "servicebus"): (
        "sb.receive_messages",
        "sb.complete_message",
        "sb.receive_messages",
        "history.delete",
    ),
    ("purge", "rabbitmq"): ("amqp.get", "amqp.get", "amqp.ack", "amqp.get", "amqp.get", "history.delete"),
    ("purge", "sqs"): ("sqs.receive_message", "sqs.delete_message", "sqs.receive_message", "history.delete"),
    ("archive", "inprocess"): ("history.upsert",),
    ("archive", "sqlite"): ("sql.execute", "sql.execute", "sql.commit"),
    ("archive", "postgres"): ("sql.execute", "sql.execute", "sql.commit"),
    ("archive", "storage_queue"): ("history.upsert",),
    ("archive", "servicebus"): ("history.upsert",),
    ("archive", "rabbitmq"): ("history.upsert",),
    ("archive", "sqs"): ("history.upsert",),
    ("lease_release", "sqlite"): ("sql.execute", "sql.execute", "sql.commit"),
    ("lease_release", "postgres"): ("sql.execute", "sql.execute", "sql.execute", "sql.commit"),
    ("delayed_forward", "rabbitmq"): ("delayed.fetch_due", "amqp.publish", "delayed.remove"),
    ("delayed_forward", "sqs"): ("delayed.fetch_due", "sqs.send_message_batch", "delayed.remove"),
    ("delayed_forward", "storage_queue"): ("delayed.fetch_due", "queue.send_message", "delayed.remove"),
    # a damaged row (its text no envelope): the text to the dead-letter queue, its history, its removal
    ("damaged_forward", "rabbitmq"): (
        "delayed.fetch_due",
        "amqp.publish",
        "history.upsert",
        "delayed.remove",
    ),
    ("damaged_forward", "sqs"): (
        "delayed.fetch_due",
        "sqs.send_message_batch",
        "history.upsert",
        "delayed.remove",
    ),
    ("damaged_forward", "storage_queue"): (
        "delayed.fetch_due",
        "queue.send_message",
        "history.upsert",
        "delayed.remove",
    ),
    # a message received, run and settled (SQL: the claim, the control state read, the settlement;
    # RabbitMQ: the broker pushes it to the consumer, no call of the kit's receives it; SQS: the
    # receive, then its lease row taken)
    ("receive", "inprocess"): ("memory.settle", "history.upsert"),
    ("receive", "sqlite"): (
        "sqlite.round_trip",
        "sql.execute",
        "sql.execute",
        "sql.execute",
        "sqlite.round_trip",
    ),
    ("receive", "postgres"): ("pg.round_trip", "sql.execute", "sql.execute", "sql.execute", "pg.round_trip"),
    ("receive", "storage_queue"): ("queue.receive_messages", "queue.delete_message", "history.upsert"),
    ("receive", "servicebus"): ("sb.receive_messages", "sb.complete_message", "history.upsert"),
    ("receive", "rabbitmq"): ("amqp.ack", "history.upsert"),
    ("receive", "sqs"): (
        "sqs.receive_message",
        "leases.take",
        "leases.holding",
        "sqs.delete_message_batch",
        "history.upsert",
    ),
    # the message's waiting rows found, then made the operator's copy and held for the store's lease
    # with the history reopened, in one transaction (a retry that stops after this leaves them to come
    # back when it ends, as a known repeat), the copy sent, the rows taken; SQL: the control state
    # read, then the row made due again (one statement)
    ("bring_forward", "inprocess"): ("history.change_if_unchanged", "memory._forget", "memory.send"),
    ("bring_forward", "sqlite"): (
        "sql.execute",
        "sql.execute",
        "sql.execute",
        "sql.execute",
        "sql.execute",
        "sql.commit",
    ),
    ("bring_forward", "postgres"): (
        "sql.execute",
        "sql.execute",
        "sql.execute",
        "sql.execute",
        "sql.execute",
        "sql.execute",
        "sql.commit",
    ),
    ("bring_forward", "rabbitmq"): ("delayed.copies", "delayed.hold", "amqp.publish", "delayed.take_message"),
    ("bring_forward", "sqs"): (
        "delayed.copies",
        "delayed.hold",
        "sqs.send_message_batch",
        "delayed.take_message",
    ),
    # the waiting rows and their history deleted in one transaction (the side database holds both):
    # nothing is left for the purge's own deletion of the history
    ("purge_waiting", "inprocess"): ("memory._forget", "history.delete"),
    ("purge_waiting", "sqlite"): ("sql.execute", "sql.execute", "sql.commit", "sql.execute"),
    ("purge_waiting", "postgres"): ("sql.execute", "sql.execute", "sql.commit", "sql.execute"),
    ("purge_waiting", "rabbitmq"): ("delayed.purge",),
    ("purge_waiting", "sqs"): ("delayed.purge",),
    # the delayed store's part first (a forward due meanwhile lands before the clearing), then the queue
    # and its dead-letter queue, then the history of what was removed
    ("purge_queue", "inprocess"): ("memory._forget", "history.delete"),
    ("purge_queue", "sqlite"): ("sql.execute", "sql.execute", "sql.commit", "sql.execute"),
    ("purge_queue", "postgres"): ("sql.execute", "sql.execute", "sql.commit", "sql.execute"),
    ("purge_queue", "storage_queue"): (
        "delayed.purge",
        "queue.clear_messages",
        "queue.clear_messages",
        "history.delete",
    ),
    ("purge_queue", "servicebus"): (
        "sb.peek_messages",
        "sb.receive_messages",
        "sb.receive_messages",
        "sb.complete_message",
        "sb.receive_messages",
        "history.delete",
    ),
    ("purge_queue", "rabbitmq"): ("delayed.purge", "amqp.purge", "amqp.purge", "history.delete"),
    ("purge_queue", "sqs"): ("delayed.purge", "sqs.purge_queue", "sqs.purge_queue", "history.delete"),
    # the lease renewed (SQS: its lease row, then the visibility; Storage: the visibility, which gives a
    # new pop receipt), then the run's success settled
    ("renew", "sqlite"): (
        "sqlite.round_trip",
        "sql.execute",
        "sql.execute",
        "sql.execute",
        "sqlite.round_trip",
    ),
    ("renew", "postgres"): ("pg.round_trip", "sql.execute", "sql.execute", "sql.execute", "pg.round_trip"),
    ("renew", "storage_queue"): ("queue.update_message", "queue.delete_message", "history.upsert"),
    ("renew", "servicebus"): ("sb.renew_message_lock", "sb.complete_message", "history.upsert"),
    ("renew", "sqs"): (
        "leases.extend",
        "sqs.change_message_visibility_batch",
        "leases.holding",
        "sqs.delete_message_batch",
        "history.upsert",
    ),
    ("enqueue_history", "inprocess"): ("memory.send", "history.upsert"),
    ("enqueue_history", "sqlite"): ("sql.execute", "sql.commit"),
    ("enqueue_history", "postgres"): ("sql.execute",),
    ("enqueue_history", "storage_queue"): ("queue.send_message", "history.upsert"),
    ("enqueue_history", "servicebus"): ("sb.send_messages", "history.upsert"),
    ("enqueue_history", "rabbitmq"): ("amqp.publish", "history.upsert"),
    ("enqueue_history", "sqs"): ("sqs.send_message_batch", "history.upsert"),
    # the request first (SQL: its row, beside the read of the message and its row's end), then the row
    # ended (SQL) or the record of the request written over the record as read (the others)
    ("cancel", "inprocess"): ("control.set_cancel", "history.change_if_unchanged"),
    ("cancel", "sqlite"): ("sql.execute", "sql.execute", "sql.execute", "sql.commit", "sql.execute"),
    ("cancel", "postgres"): (
        "sql.execute",
        "sql.execute",
        "sql.execute",
        "sql.execute",
        "sql.commit",
        "sql.execute",
    ),
    ("cancel", "storage_queue"): ("control.set_cancel", "history.change_if_unchanged"),
    ("cancel", "servicebus"): ("control.set_cancel", "history.change_if_unchanged"),
    ("cancel", "rabbitmq"): ("control.set_cancel", "history.change_if_unchanged"),
    ("cancel", "sqs"): ("control.set_cancel", "history.change_if_unchanged"),
    # a success whose ack the broker refuses throughout: given back (nacked to its queue) after a moment
    ("give_back", "rabbitmq"): ("amqp.ack", "amqp.nack"),
    # a forward the transport refuses throughout: the row released, to be forwarded again later
    ("forward_refused", "rabbitmq"): ("delayed.fetch_due", "amqp.publish", "delayed.release"),
    ("forward_refused", "sqs"): ("delayed.fetch_due", "sqs.send_message_batch", "delayed.release"),
    ("forward_refused", "storage_queue"): ("delayed.fetch_due", "queue.send_message", "delayed.release"),
    # the same, the send denied (a right the identity lacks, a nacked publish): a failure counted on it
    ("forward_denied", "rabbitmq"): ("delayed.fetch_due", "amqp.publish", "delayed.increment_failure"),
    ("forward_denied", "sqs"): ("delayed.fetch_due", "sqs.send_message_batch", "delayed.increment_failure"),
    ("forward_denied", "storage_queue"): (
        "delayed.fetch_due",
        "queue.send_message",
        "delayed.increment_failure",
    ),
    # an operator's retry whose copy the transport refuses throughout: the history put back as it was
    # (unless a run wrote since), and the dead letter found handed back to its queue
    ("retry_refused", "rabbitmq"): (
        "amqp.get",
        "amqp.get",
        "amqp.get",
        "amqp.get",
        "history.change_if_unchanged",
        "amqp.publish",
        "history.change_if_unchanged",
        "amqp.nack",
    ),
    ("retry_refused", "servicebus"): (
        "sb.receive_messages",
        "sb.receive_messages",
        "history.change_if_unchanged",
        "sb.send_messages",
        "history.change_if_unchanged",
        "sb.abandon_message",
    ),
    ("retry_refused", "sqs"): (
        "sqs.receive_message",
        "sqs.receive_message",
        "history.change_if_unchanged",
        "sqs.send_message_batch",
        "history.change_if_unchanged",
        "sqs.change_message_visibility_batch",
    ),
    ("retry_refused", "storage_queue"): (
        "queue.receive_messages",
        "queue.receive_messages",
        "history.change_if_unchanged",
        "queue.send_message",
        "history.change_if_unchanged",
        "queue.update_message",
    ),
}
# a whole queue purged, a message waiting in it for its retry: the same calls as with a dead letter
# (RabbitMQ, SQS: its delayed row and its history go in the delayed store's one transaction; Storage:
# hidden in the queue, cleared with it)
STEPS |= {
    ("purge_queue_waiting", provider): steps
    for (sequence, provider), steps in list(STEPS.items())
    if sequence == "purge_queue" and provider != "servicebus"
}
# (Service Bus: the retry waits as a scheduled message, which a receive never sees: found by a peek and
# cancelled, then the drain finds the queue empty)
STEPS[("purge_queue_waiting", "servicebus")] = (
    "sb.peek_messages",
    "sb.cancel_scheduled_messages",
    "sb.peek_messages",
    "sb.receive_messages",
    "sb.receive_messages",
    "history.delete",
)
# (RabbitMQ, SQS: the waiting message's history went with its row, so the purge has no history of its
# own left to delete: counted once, as the delayed store's)
STEPS |= {
    ("purge_queue_waiting", provider): STEPS[("purge_queue", provider)][:-1]
    for provider in ("rabbitmq", "sqs")
}

MODES = ("error", "crash")
#: steps whose call is also made to lose its answer after it ran (``lost`` mode): every call that
#: changes something and whose caller waits for the service's answer, which a dropped connection can
#: lose after the change was made. The SQL transports' hot-path calls (one transaction, perhaps
#: committed) and SQLAlchemy's commits and statements (a statement on an autocommit connection stands
#: once run; one inside a transaction is rolled back by the error, as in the ``error`` mode); the
#: brokers' sends, deletes, dispositions, clearings and lease renewals; the history's, the control
#: store's, the lease store's and the delayed store's writes. Not RabbitMQ's ack, nack or reject: AMQP
#: gives them no answer (aio-pika writes the frame and marks the message processed only once that
#: returned), so their lost answer cannot be made here as it would happen; their failure is the
#: ``error`` mode's. Not the reads: a receive whose answer is lost leaves the message held until its
#: lease lapses, which changes no state.
ANSWER_LOST = {
    "sqlite.round_trip",
    "pg.round_trip",
    "sql.execute",
    "sql.commit",
    "queue.send_message",
    "queue.update_message",
    "queue.delete_message",
    "sb.send_messages",
    "sb.complete_message",
    "sb.dead_letter_message",
    "sb.cancel_scheduled_messages",
    "amqp.publish",
    "sqs.send_message_batch",
    "sqs.delete_message",
    "sqs.delete_message_batch",
    "history.upsert",
    "history.upsert_newer",
    "history.reopen",
    "history.delete",
    "history.change_if_unchanged",
    "control.set_cancel",
    "control.put_identity_doc",
    "delayed.store_many",
    "delayed.remove",
    "delayed.release",
    "delayed.increment_failure",
    "delayed.hold",
    "delayed.take_message",
    "delayed.purge",
    # the clearing of a whole queue, and a lease renewed (the lease store's and the transport's)
    "queue.clear_messages",
    "sqs.purge_queue",
    "amqp.purge",
    "sb.renew_message_lock",
    "leases.take",
    "leases.extend",
    "sqs.change_message_visibility_batch",
}

#: cases expected to break the invariant, by (sequence, step prefix, mode), with the defect named: a
#: case listed here is a strict xfail, so it turns red the day it is fixed and the row must go. None
#: today (a Service Bus disposition whose answer was lost, refused on its next try because the message
#: had left the queue, was one: its outcome is now recorded, see ``Delivery.unconfirmed``)
KNOWN_DEFECTS: dict[tuple[str, str, str], str] = {}

WORKER_SEQUENCES = {
    "succeed",
    "retry_by_copy",
    "pause_by_copy",
    "dead_letter",
    "expiry",
    "idempotent_expiry",
    "delayed_forward",
    "damaged_forward",
    "forward_refused",
    "forward_denied",
    "give_back",
    "retry_with_claim",
    "dead_letter_with_claim",
    "retry_beside_a_refused_one",
}


def expected_failure(sequence: str, step: str, mode: str) -> str | None:
    return next(
        (
            why
            for (seq, prefix, fails_in), why in KNOWN_DEFECTS.items()
            if seq == sequence and step.startswith(prefix) and mode == fails_in
        ),
        None,
    )


@dataclass(frozen=True)
class Case:
    sequence: str
    provider: str
    step: int  # -1: the baseline (no fault)
    step_name: str
    mode: str | None

    @property
    def id(self) -> str:
        if self.mode is None:
            return f"{self.sequence}-{self.provider}-baseline"
        return f"{self.sequence}-{self.provider}-{self.step}.{self.step_name}-{self.mode}"


def _modes(seq: Sequence, step: str) -> tuple[str, ...]:
    """A refused call fails at every call already: only a crash there is a case of its own (its
    error is the refusal itself, and it never runs, so no answer of its can be lost)."""
    if step in seq.refused:
        return ("crash",)
    return (*MODES, "lost") if step in ANSWER_LOST else MODES


def cases() -> list[object]:
    out: list[object] = []
    for seq in SEQUENCES:
        for provider, kit in KITS.items():
            if provider in seq.absent:
                continue
            out.append(
                pytest.param(Case(seq.name, provider, -1, "", None), id=f"{seq.name}-{provider}-baseline")
            )
            if kit.no_faults:
                continue
            for i, step in enumerate(STEPS.get((seq.name, provider), ())):
                for mode in _modes(seq, step):
                    case = Case(seq.name, provider, i, step, mode)
                    reason = expected_failure(seq.name, step, mode)
                    marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
                    out.append(pytest.param(case, id=case.id, marks=marks))
    return out


#: steps of a row that are not calls of their own, so no case injects there (shown in the report)
UNCALLED = {
    "sqlite": "the hot path's commit: a call in aiosqlite's thread or on the event loop's "
    "(``sqlite.round_trip``) is one transaction, begun, run and ended in that call, so its failure, its "
    "crash and its lost answer are that call's (a call on the event loop's thread that finds the write "
    "lock taken is rolled back and made again in aiosqlite's thread, within the same call)",
    "postgres": "the hot path's commit: a round trip on psycopg's connection (``pg.round_trip``) is one "
    "pipeline, one implicit transaction, so its failure, its crash and its lost answer are that call's",
}


def not_injectable() -> list[str]:
    rows: list[str] = []
    for seq in SEQUENCES:
        for provider, why in seq.absent.items():
            rows.append(f"{seq.name} on {provider}: no such sequence ({why})")
    for provider, kit in KITS.items():
        if kit.no_faults:
            rows.append(f"every step on {provider}: {kit.no_faults}")
    for provider, why in UNCALLED.items():
        rows.append(f"{provider}: {why}")
    return rows
