"""The deployment the READMEs describe, followed literally on a clean checkout, has no step the sources
say fails: Core Tools needs the worker runtime (``--python``) when local.settings.json is absent (it is
git-ignored); every parameter passed exists in main.bicep and the combination deploys; the PostgreSQL
step passes the variables infra/postgres/app-role.sql reads, named after outputs the template has."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from tests.infra.bicep_tools import INFRA, MAIN, ROOT, parsed
from tests.infra.deployment import Deployment
from tests.infra.provisioned import API_KEY

DOCS = [ROOT / "README.md", INFRA / "README.md"]


def _commands(path: Path) -> list[str]:
    """Shell commands in the file's ``sh`` blocks, continuation lines joined."""
    text = path.read_text(encoding="utf-8")
    out = []
    for block in re.findall(r"```sh\n(.*?)```", text, re.S):
        out.extend(line.strip() for line in block.replace("\\\n", " ").splitlines() if line.strip())
    return out


def _all(prefix: str) -> list[str]:
    found = [c for path in DOCS for c in _commands(path) if c.startswith(prefix)]
    assert found, f"no `{prefix}` in {[str(p.relative_to(ROOT)) for p in DOCS]}"
    return found


def test_the_publish_command_names_the_worker_runtime():
    assert "local.settings.json" in (ROOT / ".gitignore").read_text(encoding="utf-8").split()
    for command in _all("func azure functionapp publish"):
        assert "--python" in shlex.split(command), command
    for needed in ("host.json", "function_app.py", "requirements.txt"):
        assert (ROOT / needed).is_file()  # what the publish takes from the checkout's root


def _parameters(command: str) -> dict[str, str]:
    words = shlex.split(command.replace("$(", "(").replace('"(', '"'))
    params: dict[str, str] = {}
    for word in words[words.index("--parameters") :]:
        if "=" in word and not word.startswith("-"):
            name, value = word.split("=", 1)
            params[name] = value
    return params


def test_every_documented_deployment_passes_existing_parameters_and_deploys():
    declared = set(parsed(MAIN)["parameters"])
    from tests.infra.bicep_tools import read_bicepparam

    for command in _all("az deployment group create"):
        assert "--template-file infra/main.bicep" in command
        assert "--parameters infra/main.bicepparam" in command
        params = _parameters(command)
        assert "apiKey" in params, command
        assert set(params) <= declared, sorted(set(params) - declared)
        values: dict[str, object] = {**read_bicepparam().values, **params, "apiKey": API_KEY}
        values.update({k: v == "true" for k, v in params.items() if v in ("true", "false")})
        Deployment(values)  # raises DeploymentRefused for a combination the template refuses


def test_the_sql_deployment_is_followed_by_the_app_role_step():
    [sql] = [c for c in _all("az deployment group create") if "queueingProvider=sql" in c]
    assert "deployPostgres=true" in sql
    outputs = set(parsed(MAIN)["outputs"])
    sql_file = (INFRA / "postgres" / "app-role.sql").read_text(encoding="utf-8")
    wanted = set(re.findall(r":['\"]?(\w+)['\"]?", sql_file.split("\\set ON_ERROR_STOP on", 1)[1]))
    for command in _all("psql"):
        assert "-f infra/postgres/app-role.sql" in command
        given = dict(re.findall(r"-v (\w+)=(\S+)", command))
        assert set(given) == wanted, (given, wanted)
        for placeholder in re.findall(r"<(\w+)>", command):
            assert placeholder in outputs | set(parsed(MAIN)["parameters"]), placeholder


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_bare_publish_and_no_system_assigned_identity_left_in_the_docs(path):
    text = path.read_text(encoding="utf-8")
    assert not re.search(r"func azure functionapp publish <[\w-]+>\s*(#|$)", text, re.M)
    assert "system-assigned identity, identity-based" not in text
