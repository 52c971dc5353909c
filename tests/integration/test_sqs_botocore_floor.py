"""The SQS provider's requests against botocore's SQS service model, and the floor pyproject declares.

botocore checks every request against its own copy of the service model before sending it, so a
parameter the installed botocore does not know is refused client-side (ParamValidationError) on every
call. The ``sqs`` extra once allowed ``boto3>=1.34``, whose botocore 1.34.0 has no
``MessageSystemAttributeNames`` on ReceiveMessage: on such an install no receive ever went out (found
in review). botocore 1.34.101 is the first with it (checked on the wheels: 1.34.100 lacks it).

What these tests prove, and what not: the tests run offline, with the botocore that is installed, so
they cannot load the floor's own model. They check that

- every request the provider builds (captured from a run on moto) validates against the *installed*
  model (botocore's ``ParamValidator``), and
- every top-level parameter ``sqs.py`` passes to a client method (read from its source, so every
  code path counts) is one botocore 1.34.101's model has (the table below was taken from that
  wheel), and the floors pyproject declares for boto3 and botocore are not below that version.

So adding a parameter newer than the floor fails here until the table is checked against a newer
wheel and the floor raised with it; lowering the floor fails here. Nested fields (the entries of a
batch) are checked against the installed model only.
"""

from __future__ import annotations

import ast
import re
import tomllib
from datetime import timedelta
from pathlib import Path
from typing import Any

import botocore.session
from botocore.validate import ParamValidator

from queueing_core import (
    MessageStatus,
    NonRetryableError,
    QueueingApp,
    QueueMessage,
    QueueNaming,
    RetryPolicy,
    queue,
)
from queueing_core.providers import sqs as sqs_module
from queueing_core.providers.sql.history import SideStores
from queueing_core.providers.sqs import SqsProvider
from queueing_core.runtime import Runtime
from tests.contract.harness import all_have, running, wait_until
from tests.contract.harness_sqs import sqs_client
from tests.services import fresh_prefix

ROOT = Path(__file__).resolve().parents[2]
#: the floor the table below was checked against
FLOOR = "1.34.101"
#: the top-level input members of the operations the provider calls, in botocore 1.34.101's SQS model
#: (botocore/data/sqs/2012-11-05/service-2.json.gz of botocore-1.34.101-py3-none-any.whl)
AT_FLOOR: dict[str, set[str]] = {
    "ChangeMessageVisibilityBatch": {"Entries", "QueueUrl"},
    "CreateQueue": {"Attributes", "QueueName", "tags"},
    "DeleteMessage": {"QueueUrl", "ReceiptHandle"},
    "DeleteMessageBatch": {"Entries", "QueueUrl"},
    "GetQueueAttributes": {"AttributeNames", "QueueUrl"},
    "GetQueueUrl": {"QueueName", "QueueOwnerAWSAccountId"},
    "PurgeQueue": {"QueueUrl"},
    "ReceiveMessage": {
        "AttributeNames",
        "MaxNumberOfMessages",
        "MessageAttributeNames",
        "MessageSystemAttributeNames",
        "QueueUrl",
        "ReceiveRequestAttemptId",
        "VisibilityTimeout",
        "WaitTimeSeconds",
    },
    "SendMessageBatch": {"Entries", "QueueUrl"},
    "SetQueueAttributes": {"Attributes", "QueueUrl"},
}


@queue(
    "Floor.Work",
    lease_duration=timedelta(seconds=10),
    retry=RetryPolicy(base=timedelta(milliseconds=50), jitter=0),
)
class FloorWork(QueueMessage):
    n: int


def _api_names() -> dict[str, str]:
    """boto3's method names to the API's operation names (``receive_message`` -> ``ReceiveMessage``)."""
    client = botocore.session.get_session().create_client(
        "sqs", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x"
    )
    return dict(client.meta.method_to_api_mapping)


def _calls_in_source() -> list[tuple[str, set[str], int]]:
    """Each ``<...>.client.<method>`` that sqs.py passes to a call with keyword arguments: the
    operation, the keywords, the line."""
    names = _api_names()
    tree = ast.parse(Path(sqs_module.__file__).read_text())
    found: list[tuple[str, set[str], int]] = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        for arg in node.args:
            if (
                isinstance(arg, ast.Attribute)
                and isinstance(arg.value, ast.Attribute)
                and arg.value.attr == "client"
                and arg.attr in names
            ):
                found.append((names[arg.attr], {k.arg for k in node.keywords if k.arg}, node.lineno))
    return found


def test_every_parameter_sqs_py_passes_is_in_the_floors_model() -> None:
    calls = _calls_in_source()
    ops = {op for op, _, _ in calls}
    # the scan sees the calls (a refactor that hid them from it would make this test vacuous)
    assert {"ReceiveMessage", "SendMessageBatch", "DeleteMessageBatch", "CreateQueue"} <= ops, ops
    model = botocore.session.get_session().get_service_model("sqs")
    problems = []
    for op, params, line in calls:
        installed = set(model.operation_model(op).input_shape.members)
        if op not in AT_FLOOR:
            problems.append(f"sqs.py:{line} calls {op}: check it against botocore {FLOOR}'s model")
            continue
        for p in sorted(params - AT_FLOOR[op]):
            problems.append(f"sqs.py:{line} passes {op}.{p}, not in botocore {FLOOR}'s model")
        for p in sorted(params - installed):
            problems.append(f"sqs.py:{line} passes {op}.{p}, not in the installed botocore's model")
    assert not problems, problems


def _declared_floor(package: str) -> str | None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for req in extras["sqs"]:
        m = re.fullmatch(rf"{package}>=([0-9.]+)", req.replace(" ", ""))
        if m:
            return m.group(1)
    return None


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def test_the_declared_floor_is_not_below_the_one_the_table_was_taken_from() -> None:
    for package in ("boto3", "botocore"):
        declared = _declared_floor(package)
        assert declared is not None, f"the sqs extra declares no {package}>= floor"
        # lower, and an install it allows refuses the provider's receive; higher is fine, but then
        # the table above may be brought to the new floor's model
        assert _version(declared) >= _version(FLOOR), f"{package}>={declared} is below {FLOOR}"
    assert _version(botocore.__version__) >= _version(FLOOR)


async def test_the_requests_the_provider_sends_validate_against_the_installed_model(tmp_path) -> None:
    """A run on moto: open (create, then find and update), send, receive, settle (complete, retry,
    dead letter), renew, depth, dead letters read and handed back, purge; each request as botocore is
    about to serialize it, checked again with botocore's own validator against the installed model."""
    client = sqs_client()
    sent: list[tuple[str, dict[str, Any]]] = []

    def capture(params: dict[str, Any], model: Any, **_: Any) -> None:
        sent.append((model.name, dict(params)))

    client.meta.events.register("provide-client-params.sqs.*", capture)
    prefix = fresh_prefix()
    app = QueueingApp("floor", naming=QueueNaming(prefix=prefix))
    tried: set[int] = set()

    async def handle(msg: FloorWork, ctx: Any) -> None:
        if msg.n == 2 and msg.n not in tried:
            tried.add(msg.n)
            raise RuntimeError("once more")
        if msg.n == 3:
            raise NonRetryableError("declined")

    app.handler(FloorWork)(handle)
    prov = SqsProvider(client, stores=SideStores(f"sqlite:///{tmp_path}/side.db"), receive_wait=0)
    rt = Runtime(app, prov)
    try:
        # a queue an older version made with other settings: found and brought to these on open
        older = app.naming.physical("Floor.Work", prov.transport)
        client.create_queue(QueueName=older, Attributes={"VisibilityTimeout": "300"})
        await rt.open()
        receipts = await app.enqueue_many([FloorWork(n=1), FloorWork(n=2), FloorWork(n=3)])
        ids = [r.message_id for r in receipts]
        async with running(rt):
            await wait_until(lambda: all_have(rt, ids[:2], MessageStatus.SUCCEEDED.value), what="runs")
            await wait_until(lambda: all_have(rt, ids[2:], MessageStatus.DEAD_LETTERED.value), what="letter")
        await app.enqueue(FloorWork(n=4))
        sub = app.subscription(FloorWork.type_name())
        held = await prov.receive(sub, 10)
        assert held
        assert not await prov.renew(held)
        await prov.depth(sub.queue)
        async with prov._dead_letter_pages(sub.queue) as pages:
            letters = await pages.next_page()
            await pages.hand_back(letters)
        await prov._purge_whole(sub.queue)
        found = SqsProvider(client, stores=SideStores(f"sqlite:///{tmp_path}/side.db"), auto_create=False)
        try:
            await found.open(app)  # without auto-create the queue is only looked up
        finally:
            await found.close()
    finally:
        await rt.close()
        for url in client.list_queues(QueueNamePrefix=prefix).get("QueueUrls", []):
            client.delete_queue(QueueUrl=url)
    model = botocore.session.get_session().get_service_model("sqs")
    validator = ParamValidator()
    wanted = {
        "CreateQueue",
        "GetQueueUrl",
        "SetQueueAttributes",
        "GetQueueAttributes",
        "SendMessageBatch",
        "ReceiveMessage",
        "DeleteMessageBatch",
        "ChangeMessageVisibilityBatch",
        "PurgeQueue",
    }
    assert wanted <= {op for op, _ in sent}, sorted({op for op, _ in sent})
    problems = []
    for op, params in sent:
        report = validator.validate(params, model.operation_model(op).input_shape)
        if report.has_errors():
            problems.append(f"{op}: {report.generate_report()}")
    assert not problems, problems
    receive = next(params for op, params in sent if op == "ReceiveMessage")
    assert receive["MessageSystemAttributeNames"] == ["ApproximateReceiveCount", "SentTimestamp"]
