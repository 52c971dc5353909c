"""infra/main.bicepparam: well-formed, matches main.bicep, and its generated queue block holds
queue definitions both transports accept."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from queueing_core.naming import InvalidQueueName, Transport, validate
from tests.infra.bicep_tools import (
    API_KEY_VARIABLE,
    BEGIN_MARKER,
    END_MARKER,
    MAIN,
    PARAMS,
    BicepSyntaxError,
    ParamsRefused,
    build_params,
    decorators,
    function,
    parsed,
    read_bicepparam,
    required_parameters,
)

ISO_DURATION = re.compile(r"^P(?!$)(\d+D)?(T(?=\d)(\d+H)?(\d+M)?(\d+(\.\d+)?S)?)?$")
SERVICE_BUS_QUEUE_FIELDS = {
    "name": str,
    "maxDeliveryCount": int,
    "lockDuration": str,
    "defaultMessageTimeToLive": str,
    "requiresDuplicateDetection": bool,
}
OPTIONAL_FIELDS = {"duplicateDetectionHistoryTimeWindow": str}


def _seconds(duration: str) -> float:
    match = ISO_DURATION.match(duration)
    assert match, f"{duration!r} is not an ISO 8601 duration"
    days, _, hours, minutes, seconds, _ = match.groups()
    return (
        int((days or "0D")[:-1]) * 86400
        + int((hours or "0H")[:-1]) * 3600
        + int((minutes or "0M")[:-1]) * 60
        + float((seconds or "0S")[:-1])
    )


@pytest.fixture(scope="module")
def params():
    return read_bicepparam()


def test_uses_main_bicep_and_sets_only_declared_parameters(params) -> None:
    assert params.using == "main.bicep"
    declared = parsed(MAIN)["parameters"]
    assert set(params.values) <= set(declared), sorted(set(params.values) - set(declared))
    for name, value in build_params(params, {API_KEY_VARIABLE: "a-key"}).items():
        kind = declared[name]["type"]
        expected = {"string": str, "int": int, "bool": bool, "array": list, "object": dict}[kind]
        assert isinstance(value, expected), name
        assert not (kind == "int" and isinstance(value, bool)), name
        allowed = decorators(declared[name]).get("allowed")
        assert allowed is None or value in allowed, f"{name}={value!r} not in {allowed}"


def test_every_required_parameter_is_assigned_in_the_file(params) -> None:
    # The Azure CLI compiles the file once without the command line's `--parameters name=value` (to find
    # the template), and Bicep refuses a file that leaves a required parameter out (BCP258): the
    # documented deployment failed before anything deployed (found in review)
    required = required_parameters()
    assert "apiKey" in required
    assert required <= set(params.values), sorted(required - set(params.values))
    build_params(params, {API_KEY_VARIABLE: "a-key"})  # and Bicep compiles it


def test_no_secret_in_the_parameters_file(params) -> None:
    secure = {n for n, spec in parsed(MAIN)["parameters"].items() if "secure" in decorators(spec)}
    assert secure, "main.bicep has no @secure() parameter: nothing to check"
    for name in secure & set(params.values):
        # read from the deploying shell's environment when the file is compiled, with no default (a
        # default would be a secret written in the file)
        assert function(params.values[name]) == ("readEnvironmentVariable", {"arg_1": API_KEY_VARIABLE}), (
            f"{name} = {params.values[name]!r}: a secure parameter's value may come only from the environment"
        )
    with pytest.raises(
        ParamsRefused, match=f'BCP427: Environment variable "{API_KEY_VARIABLE}" does not exist'
    ):
        build_params(params, {})  # unset: Bicep stops, naming the variable
    assert (
        build_params(params, {API_KEY_VARIABLE: "from-the-environment"})["apiKey"] == "from-the-environment"
    )


def test_a_file_that_leaves_a_required_parameter_out_is_refused(tmp_path: Path) -> None:
    text = PARAMS.read_text(encoding="utf-8")
    without = tmp_path / "main.bicepparam"
    without.write_text(re.sub(r"^param apiKey = .*$", "", text, flags=re.M), encoding="utf-8")
    with pytest.raises(ParamsRefused, match=r"BCP258: .*\['apiKey'\]"):
        # the command line's value comes too late: the CLI's first compile runs without it
        build_params(read_bicepparam(without), {API_KEY_VARIABLE: "a-key"}, {"apiKey": "a-key"})


def test_generated_block_is_well_formed(params) -> None:
    text = PARAMS.read_text(encoding="utf-8")
    assert text.count(BEGIN_MARKER) == 1
    assert text.count(END_MARKER) == 1
    assert set(params.generated) == {"serviceBusQueues", "storageQueues", "queuePrefix", "queueSuffix"}
    # the block is self-contained: regenerating it cannot leave parameters half outside
    assert params.generated == {k: params.values[k] for k in params.generated}


def test_service_bus_queue_entries(params) -> None:
    queues = params.generated["serviceBusQueues"]
    assert queues, "no Service Bus queues"
    for queue in queues:
        fields = set(queue)
        assert set(SERVICE_BUS_QUEUE_FIELDS) <= fields, (
            f"{queue}: missing {set(SERVICE_BUS_QUEUE_FIELDS) - fields}"
        )
        assert fields <= set(SERVICE_BUS_QUEUE_FIELDS) | set(OPTIONAL_FIELDS), f"unknown fields in {queue}"
        for field, kind in {**SERVICE_BUS_QUEUE_FIELDS, **OPTIONAL_FIELDS}.items():
            if field in queue:
                assert isinstance(queue[field], kind)
                assert not (kind is int and isinstance(queue[field], bool))
        validate(queue["name"], Transport.SERVICE_BUS)
        assert 1 <= queue["maxDeliveryCount"] <= 2000
        assert 0 < _seconds(queue["lockDuration"]) <= 300, "Service Bus lock duration is at most PT5M"
        assert _seconds(queue["defaultMessageTimeToLive"]) > 0
        if "duplicateDetectionHistoryTimeWindow" in queue:
            window = _seconds(queue["duplicateDetectionHistoryTimeWindow"])
            assert 20 <= window <= 7 * 86400, "duplicate detection window is 20 s to 7 days"
    names = [q["name"].lower() for q in queues]
    assert len(names) == len(set(names)), "Service Bus names are case-insensitive: duplicates"


def test_storage_queue_names(params) -> None:
    names = params.generated["storageQueues"]
    assert names
    assert all(isinstance(n, str) for n in names)
    assert len(names) == len(set(names))
    for name in names:
        validate(name, Transport.STORAGE_QUEUE)
        validate(f"{name}-poison", Transport.STORAGE_QUEUE)  # the host's poison queue must fit too


def test_sample_values_for_the_example_app(params) -> None:
    by_name = {q["name"]: q for q in params.generated["serviceBusQueues"]}
    assert set(by_name) == {"capture-payment", "generate-invoice", "order-placed"}
    # one more delivery than the attempts: a message whose runs never settled reaches the kit, which
    # dead-letters it with its reason (the broker's own move leaves no history)
    assert by_name["capture-payment"]["maxDeliveryCount"] == 5
    assert by_name["generate-invoice"]["maxDeliveryCount"] == 6
    assert by_name["generate-invoice"]["lockDuration"] == "PT1M"
    assert by_name["order-placed"]["maxDeliveryCount"] == 6
    assert by_name["order-placed"]["lockDuration"] == by_name["capture-payment"]["lockDuration"] == "PT30S"
    # the example's 4 h expiration plus the 1 h grace the provider gives the service's own TTL
    assert {q["defaultMessageTimeToLive"] for q in by_name.values()} == {"PT5H"}
    assert sorted(params.generated["storageQueues"]) == sorted(by_name)


@pytest.mark.parametrize(
    ("name", "transport"),
    [
        ("Order-Placed", Transport.STORAGE_QUEUE),  # uppercase
        ("order--placed", Transport.STORAGE_QUEUE),  # double hyphen
        ("a" * 57, Transport.STORAGE_QUEUE),  # fits alone, but not with -poison (57 + 7 = 64)
        ("-order", Transport.SERVICE_BUS),
    ],
)
def test_the_name_rules_catch_bad_names(name: str, transport: Transport) -> None:
    def check(queue: str) -> None:
        validate(queue, transport)
        validate(f"{queue}-poison", transport)

    with pytest.raises(InvalidQueueName):
        check(name)


def test_a_malformed_block_is_reported_with_file_and_line(tmp_path: Path) -> None:
    text = PARAMS.read_text(encoding="utf-8").splitlines()
    line = next(i for i, s in enumerate(text, start=1) if "maxDeliveryCount" in s)
    text[line - 1] = "    maxDeliveryCount: 4 4"
    broken = tmp_path / "broken.bicepparam"
    broken.write_text("\n".join(text) + "\n", encoding="utf-8")
    with pytest.raises(BicepSyntaxError, match=rf"broken\.bicepparam:{line}\b"):
        read_bicepparam(broken)


def test_missing_markers_are_reported(tmp_path: Path) -> None:
    broken = tmp_path / "nomarkers.bicepparam"
    broken.write_text(PARAMS.read_text(encoding="utf-8").replace(END_MARKER, ""), encoding="utf-8")
    with pytest.raises(BicepSyntaxError, match="GENERATED QUEUES"):
        read_bicepparam(broken)
