"""MkDocs hook: the reference pages are generated from the code at every build, so they cannot drift.

- ``<!-- generated: settings -->`` becomes a table of every field of ``QueueingSettings`` (its
  environment variable, default, accepted values and description);
- ``<!-- generated: openapi -->`` becomes the ops API reference, rendered from the OpenAPI document
  the API itself serves (``GET openapi.json``), which is also written next to the site as
  ``openapi.json``.

Registered in ``mkdocs.yml`` under ``hooks:``; the tests call the same functions.
"""

from __future__ import annotations

import functools
import json
import types
import typing
from datetime import timedelta
from typing import Any

from pydantic import SecretStr
from pydantic.fields import FieldInfo

SETTINGS_MARK = "<!-- generated: settings -->"
OPENAPI_MARK = "<!-- generated: openapi -->"
METHODS = ("get", "post", "put", "patch", "delete")
OPENAPI_FILE = "operations/openapi.json"


# -- configuration reference ---------------------------------------------------------------------
def _iso_duration(td: timedelta) -> str:
    from pydantic import TypeAdapter

    return str(TypeAdapter(timedelta).dump_python(td, mode="json"))


def _default(field: FieldInfo) -> str:
    value = field.get_default(call_default_factory=True)
    if value is None:
        return "not set"
    if isinstance(value, SecretStr):
        value = value.get_secret_value()
    if isinstance(value, timedelta):
        return f"`{_iso_duration(value)}`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, list):
        return f"`{json.dumps(value)}`"
    if value == "":
        return "empty"
    return f"`{value}`"


def _accepted(field: FieldInfo) -> str:
    """What the setting accepts, from its type and constraints (never hand-written)."""
    notes: list[str] = []
    annotation = field.annotation
    inner = annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):  # `X | None`: describe X
        inner = next(a for a in typing.get_args(annotation) if a is not type(None))
    if typing.get_origin(inner) is typing.Literal:
        notes.append(", ".join(f"`{v}`" for v in typing.get_args(inner)))
    elif inner is timedelta:
        notes.append("ISO 8601 duration (`PT30S`, `P7D`) or seconds")
    elif inner is bool:
        notes.append("`true` / `false`")
    elif inner is int:
        notes.append("integer")
    elif inner is float:
        notes.append("number")
    elif typing.get_origin(inner) is list:
        notes.append("JSON list")
    elif inner is SecretStr:
        notes.append("secret: never logged")
    for meta in field.metadata:
        for attr, word in (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<")):
            bound = getattr(meta, attr, None)
            if bound is not None:
                notes.append(f"{word} {bound:,}" if isinstance(bound, int) else f"{word} {bound:g}")
        pattern = getattr(meta, "pattern", None)
        if pattern:
            notes.append(f"matching `{pattern}`")
    return "; ".join(notes)


def settings_reference() -> str:
    from queueing_core.settings import QueueingSettings

    prefix = str(QueueingSettings.model_config.get("env_prefix", ""))
    rows = [
        "| Environment variable | Default | Accepts | What it does |",
        "| --- | --- | --- | --- |",
    ]
    for name, field in QueueingSettings.model_fields.items():
        variable = f"{prefix}{name}".upper()
        description = (field.description or "").replace("|", "\\|").replace("\n", " ")
        accepted = _accepted(field).replace("|", "\\|")
        rows.append(f"| `{variable}` | {_default(field)} | {accepted} | {description} |")
    return "\n".join(rows)


# -- ops API reference ---------------------------------------------------------------------------
def openapi_document() -> dict[str, Any]:
    """The document the ops API serves, fetched through the API itself (auth included)."""
    import asyncio

    import httpx

    from queueing_core.examples.orders import app as example
    from queueing_core.ops.api import PREFIX, create_app
    from queueing_core.ops.service import OpsService
    from queueing_core.testing import in_process

    key = "reference-build"
    api = create_app(OpsService(in_process(example)), api_key=key)

    async def fetch() -> httpx.Response:
        transport = httpx.ASGITransport(app=api)
        async with httpx.AsyncClient(transport=transport, base_url="http://docs") as client:
            return await client.get(f"{PREFIX}/openapi.json", headers={"X-API-Key": key})

    response = asyncio.run(fetch())
    response.raise_for_status()
    doc: dict[str, Any] = response.json()
    return doc


def _ref_name(ref: str) -> str:
    return ref.rsplit("/", 1)[-1]


def _type(schema: dict[str, Any]) -> str:
    if "$ref" in schema:
        name = _ref_name(schema["$ref"])
        return f"[{name}](#{name.lower()})"
    for key in ("anyOf", "oneOf"):
        if key in schema:
            parts = [_type(s) for s in schema[key] if s.get("type") != "null"]
            optional = any(s.get("type") == "null" for s in schema[key])
            return " or ".join(parts) + (" or null" if optional else "")
    if "enum" in schema:
        return " \\| ".join(f"`{v}`" for v in schema["enum"])
    kind = schema.get("type", "any")
    if kind == "array":
        return f"list of {_type(schema.get('items', {}))}"
    if kind == "object" and "additionalProperties" in schema:
        extra = schema["additionalProperties"]
        return f"map of {_type(extra) if isinstance(extra, dict) else 'any'}"
    fmt = schema.get("format")
    return f"{kind} ({fmt})" if fmt else str(kind)


def _cell(text: object) -> str:
    return str(text or "").replace("|", "\\|").replace("\n", " ")


def _constraints(schema: dict[str, Any]) -> str:
    notes = []
    for key, word in (
        ("minimum", "≥"),
        ("maximum", "≤"),
        ("minLength", "length ≥"),
        ("maxLength", "length ≤"),
    ):
        if key in schema:
            notes.append(f"{word} {schema[key]}")
    if "pattern" in schema:
        notes.append(f"matching `{schema['pattern']}`")
    if "default" in schema and schema["default"] is not None:
        notes.append(f"default `{json.dumps(schema['default'])}`")
    return "; ".join(notes)


def _operation(path: str, method: str, op: dict[str, Any]) -> list[str]:
    lines = [f"### `{method.upper()} {path}`", ""]
    if op.get("summary"):
        lines += [_cell(op["summary"]) + ".", ""]
    if op.get("description"):
        lines += [op["description"].strip(), ""]
    params = op.get("parameters", [])
    if params:
        lines += ["| Parameter | In | Type | Required | Notes |", "| --- | --- | --- | --- | --- |"]
        for p in params:
            schema = p.get("schema", {})
            notes = "; ".join(x for x in (_cell(p.get("description")), _constraints(schema)) if x)
            lines.append(
                f"| `{p['name']}` | {p['in']} | {_type(schema)} | {'yes' if p.get('required') else 'no'} "
                f"| {_cell(notes)} |"
            )
        lines.append("")
    body = op.get("requestBody")
    if body:
        for media, content in body.get("content", {}).items():
            lines += [f"Request body ({media}): {_type(content.get('schema', {}))}", ""]
    lines += ["| Response | Meaning | Body |", "| --- | --- | --- |"]
    for code, resp in op.get("responses", {}).items():
        schemas = [c.get("schema") for c in resp.get("content", {}).values() if c.get("schema")]
        lines.append(
            f"| {code} | {_cell(resp.get('description'))} | {_type(schemas[0]) if schemas else ''} |"
        )
    lines.append("")
    return lines


def _schema(name: str, schema: dict[str, Any]) -> list[str]:
    lines = [f"### {name}", ""]
    if schema.get("description"):
        lines += [_cell(schema["description"]), ""]
    props = schema.get("properties", {})
    if not props:
        lines += [f"Type: {_type(schema)}", ""]
        return lines
    required = set(schema.get("required", []))
    lines += ["| Field | Type | Required | Notes |", "| --- | --- | --- | --- |"]
    for prop, sub in props.items():
        notes = "; ".join(x for x in (_cell(sub.get("description")), _constraints(sub)) if x)
        lines.append(f"| `{prop}` | {_type(sub)} | {'yes' if prop in required else 'no'} | {_cell(notes)} |")
    lines.append("")
    return lines


def openapi_reference(doc: dict[str, Any] | None = None) -> str:
    doc = doc or openapi_document()
    lines = [
        f"Generated from the OpenAPI document the API serves ({doc['info']['title']}, version "
        f"{doc['info']['version']}); the raw document is [openapi.json](openapi.json).",
        "",
        "## Routes",
        "",
    ]
    for path, item in doc["paths"].items():
        for method in METHODS:
            if method in item:
                lines += _operation(path, method, item[method])
    lines += ["## Schemas", ""]
    for name, schema in sorted(doc.get("components", {}).get("schemas", {}).items()):
        lines += _schema(name, schema)
    return "\n".join(lines)


# -- the MkDocs hooks ----------------------------------------------------------------------------
def on_files(files: Any, config: Any) -> Any:
    """Add the OpenAPI document to the site as a file of its own (the reference links to it)."""
    from mkdocs.structure.files import File

    files.append(File.generated(config, OPENAPI_FILE, content=json.dumps(_document(), indent=2)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if SETTINGS_MARK in markdown:
        markdown = markdown.replace(SETTINGS_MARK, settings_reference())
    if OPENAPI_MARK in markdown:
        markdown = markdown.replace(OPENAPI_MARK, openapi_reference(_document()))
    return markdown


@functools.cache
def _document() -> dict[str, Any]:
    return openapi_document()
