"""Read the Bicep in infra/ without the Bicep CLI, through pycep-parser 0.7.

pycep returns plain dicts: ``parameters``, ``variables``, ``resources``, ``modules``, ``outputs``.
A bare identifier and a string literal both come back as ``str`` (``name: accountName`` and
``name: 'accountName'`` look alike); an expression comes back as ``{"operator": ...}`` or
``{"function": ...}``; a resource or module declared with ``for`` or ``if`` has its body one level
down, under ``config["config"]``, next to ``loop_type`` / ``condition``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import lark
from pycep import BicepParser

ROOT = Path(__file__).resolve().parents[2]
INFRA = ROOT / "infra"
MAIN = INFRA / "main.bicep"
PARAMS = INFRA / "main.bicepparam"
BEGIN_MARKER = "// BEGIN GENERATED QUEUES (queueing infra params)"
END_MARKER = "// END GENERATED QUEUES"
#: the environment variable main.bicepparam reads the ops API key (``apiKey``) from
API_KEY_VARIABLE = "QUEUEING_DEPLOY_API_KEY"


class BicepSyntaxError(AssertionError):
    """A file pycep cannot parse; the message names ``file:line:column``."""


def bicep_files() -> list[Path]:
    return sorted(INFRA.rglob("*.bicep"))


def _location(exc: Exception) -> tuple[int | None, int | None]:
    line = getattr(exc, "line", None)
    column = getattr(exc, "column", None)
    if line is None and isinstance(getattr(exc, "orig_exc", None), Exception):  # lark.VisitError
        return _location(exc.orig_exc)
    return (line if isinstance(line, int) and line > 0 else None, column if isinstance(column, int) else None)


def parse_text(text: str, name: str) -> dict[str, Any]:
    """Parse Bicep source; a syntax error becomes a :class:`BicepSyntaxError` naming ``name:line:col``."""
    try:
        return BicepParser().parse(text=text)
    except (lark.exceptions.LarkError, ValueError, KeyError, TypeError) as exc:
        line, column = _location(exc)
        where = name if line is None else f"{name}:{line}" + (f":{column}" if column else "")
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise BicepSyntaxError(f"{where}: Bicep does not parse ({type(exc).__name__}: {first})") from exc


def parse_file(path: Path) -> dict[str, Any]:
    return parse_text(path.read_text(encoding="utf-8"), _display(path))


@cache
def parsed(path: Path) -> dict[str, Any]:
    return parse_file(path)


def module_file(name: str) -> dict[str, Any]:
    return parsed(INFRA / "modules" / f"{name}.bicep")


def _display(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


# ------------------------------------------------------------------ structure helpers


def body(entity: dict[str, Any]) -> dict[str, Any]:
    """A resource's or module's own body, looking through ``for``/``if`` wrappers."""
    config = entity["config"]
    while "loop_type" in config or "condition" in config:
        config = config["config"]
    return config


def condition(entity: dict[str, Any]) -> Any:
    return entity["config"].get("condition")


def loop(entity: dict[str, Any]) -> dict[str, Any] | None:
    loop_type = entity["config"].get("loop_type")
    return loop_type["detail"] if loop_type else None


def props(entity: dict[str, Any]) -> dict[str, Any]:
    return body(entity).get("properties", {})


def resources_of(doc: dict[str, Any], rtype: str, *, existing: bool = False) -> dict[str, dict[str, Any]]:
    return {
        name: res
        for name, res in doc.get("resources", {}).items()
        if res["type"] == rtype and bool(res["existing"]) == existing
    }


def only(doc: dict[str, Any], rtype: str) -> dict[str, Any]:
    found = resources_of(doc, rtype)
    assert len(found) == 1, f"expected exactly one {rtype}, found {sorted(found)}"
    return next(iter(found.values()))


def decorators(param: dict[str, Any]) -> dict[str, Any]:
    return {d["type"]: d.get("argument", True) for d in param.get("decorators", [])}


def accessor(value: Any) -> str | None:
    """``a.b.c`` for a property-access chain (or a bare identifier); None for anything else."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and value.get("operator", {}).get("type") == "property_accessor":
        left = accessor(value["operator"]["operands"]["operand_1"])
        right = accessor(value["operator"]["operands"]["operand_2"])
        return f"{left}.{right}" if left and right else None
    return None


def function(value: Any) -> tuple[str, dict[str, Any]] | None:
    if isinstance(value, dict) and "function" in value:
        return value["function"]["type"], value["function"]["parameters"]
    return None


def conditional(value: Any) -> dict[str, Any] | None:
    if isinstance(value, dict) and value.get("operator", {}).get("type") == "conditional":
        return value["operator"]["operands"]
    return None


def walk(value: Any):
    """Every nested value (dicts, lists, scalars), depth first."""
    yield value
    if isinstance(value, dict):
        for item in value.values():
            yield from walk(item)
    elif isinstance(value, list):
        for item in value:
            yield from walk(item)


def references(value: Any) -> set[str]:
    """Dotted references found in expressions and ``${...}`` interpolations below ``value``."""
    found: set[str] = set()
    for item in walk(value):
        chain = accessor(item) if isinstance(item, dict) else None
        if chain:
            found.add(chain)
        if isinstance(item, str):
            found.update(m.strip() for m in re.findall(r"\$\{([^}]*)\}", item))
    return found


# ------------------------------------------------------------------ the parameters file


@dataclass(frozen=True)
class ParamsFile:
    values: dict[str, Any]  # every `param x = ...` in the file
    generated: dict[str, Any]  # those inside the generated block
    using: str


def read_bicepparam(path: Path = PARAMS) -> ParamsFile:
    """Read a ``.bicepparam`` with pycep: pycep 0.7 has no ``using``, so the file is parsed as Bicep
    with ``using`` blanked and each ``param x = v`` read as ``var x = v`` (same lines, so errors
    still point at the right place)."""
    text = path.read_text(encoding="utf-8")
    using = re.search(r"^using\s+'([^']+)'\s*$", text, flags=re.M)
    if using is None:
        raise BicepSyntaxError(f"{_display(path)}: no `using '<template>.bicep'` line")
    lines = text.splitlines()
    begin = [i for i, line in enumerate(lines) if line.strip() == BEGIN_MARKER]
    end = [i for i, line in enumerate(lines) if line.strip() == END_MARKER]
    if len(begin) != 1 or len(end) != 1 or begin[0] > end[0]:
        raise BicepSyntaxError(f"{_display(path)}: expected one '{BEGIN_MARKER}' ... '{END_MARKER}' block")
    as_bicep = []
    for line in lines:
        if re.match(r"^using\s", line):
            as_bicep.append("")
        else:
            as_bicep.append(re.sub(r"^param\s+(\w+)\s*=", r"var \1 =", line))
    doc = parse_text("\n".join(as_bicep) + "\n", _display(path))
    values = {name: var["value"] for name, var in doc.get("variables", {}).items()}
    block = "\n".join(as_bicep[begin[0] + 1 : end[0]]) + "\n"
    generated_doc = parse_text(block, f"{_display(path)} (generated block)")
    generated = {name: var["value"] for name, var in generated_doc.get("variables", {}).items()}
    return ParamsFile(values=values, generated=generated, using=using.group(1))


class ParamsRefused(AssertionError):
    """``bicep build-params`` refuses the file; the message starts with Bicep's diagnostic code."""


def required_parameters(template: Path = MAIN) -> set[str]:
    """The parameters Bicep wants a value for: declared without a default and not nullable
    (``string?``); Bicep's SemanticModel reports each one a ``.bicepparam`` leaves out as BCP258."""
    declared = parsed(template)["parameters"]
    return {
        name
        for name, spec in declared.items()
        if spec.get("default") is None and not str(spec.get("type", "")).endswith("?")
    }


def build_params(
    params: ParamsFile, environ: Mapping[str, str], overrides: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The parameter values ``bicep build-params`` compiles the file to in this environment, refused
    as Bicep refuses them. ``overrides``: the values the Azure CLI passes (``BICEP_PARAMETERS_OVERRIDES``,
    from ``--parameters name=value``); they replace an assignment or add one.

    The Azure CLI runs build-params once *without* the overrides (to find the template) and fails the
    deployment if that fails, so a file that leaves a required parameter for the command line to fill
    in is refused whatever the command line says: BCP258. ``readEnvironmentVariable(name[, default])``
    reads the environment at compile time and, with no default, fails when the variable is not set:
    BCP427 (Bicep's SystemNamespaceType, ReadEnvironmentVariableResultBuilder).
    """
    built: dict[str, Any] = {}
    for name, value in params.values.items():
        built[name] = _built(value, environ, name)
    missing = sorted(n for n in required_parameters() if built.get(n) is None)
    if missing:
        raise ParamsRefused(
            "BCP258: The following parameters are declared in the Bicep file but are missing an "
            f"assignment in the params file: {missing}"
        )
    return {**built, **(overrides or {})}


def _built(value: Any, environ: Mapping[str, str], where: str) -> Any:
    call = function(value)
    if call is not None and call[0] == "readEnvironmentVariable":
        args = call[1]
        variable, default = args["arg_1"], args.get("arg_2")
        if variable in environ:
            return environ[variable]
        if default is not None:
            return default
        raise ParamsRefused(
            f'BCP427: Environment variable "{variable}" does not exist and there\'s no default value set '
            f"(param {where})"
        )
    if call is not None or (isinstance(value, dict) and "operator" in value):
        raise NotImplementedError(f"param {where}: {value!r} is not modelled here")
    if isinstance(value, list):
        return [_built(v, environ, where) for v in value]
    if isinstance(value, dict):
        return {k: _built(v, environ, where) for k, v in value.items()}
    return value
