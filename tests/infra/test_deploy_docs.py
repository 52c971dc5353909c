"""The deployment the READMEs describe, followed literally on a clean checkout, has no step the sources
say fails: Core Tools needs the worker runtime (``--python``) when local.settings.json is absent (it is
git-ignored); main.bicepparam compiles as the Azure CLI compiles it, in the environment the docs set
up; every parameter passed exists in main.bicep and the combination deploys; the PostgreSQL step passes
the variables infra/postgres/app-role.sql reads, named after outputs the template has."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from tests.infra.bicep_tools import INFRA, MAIN, ROOT, build_params, decorators, parsed, read_bicepparam
from tests.infra.deployment import Deployment

DOCS = [ROOT / "README.md", INFRA / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _blocks(path: Path) -> list[list[str]]:
    """Each of the file's ``sh`` blocks: its commands, continuation lines joined."""
    text = path.read_text(encoding="utf-8")
    return [
        [line.strip() for line in block.replace("\\\n", " ").splitlines() if line.strip()]
        for block in re.findall(r"```sh\n(.*?)```", text, re.S)
    ]


def _commands(path: Path) -> list[str]:
    return [command for block in _blocks(path) for command in block]


def _deployments() -> list[tuple[dict[str, str], str]]:
    """Every documented ``az deployment group create``, with the environment its block gives it
    (``export NAME=value`` before it, ``NAME=value`` in front of it)."""
    found = []
    for path in DOCS:
        for block in _blocks(path):
            environ: dict[str, str] = {}
            for command in block:
                if command.startswith("export "):
                    words = shlex.split(command, comments=True)[1:]
                    environ.update(w.split("=", 1) for w in words if "=" in w)
                    continue
                assignments, _, rest = command.partition("az deployment group create")
                if not rest or not re.fullmatch(r"(\s*[A-Za-z_]\w*=\S*)*\s*", assignments):
                    continue
                inline = dict(w.split("=", 1) for w in shlex.split(assignments))
                found.append(({**environ, **inline}, command))
    assert found, "no `az deployment group create` in the docs"
    return found


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


def test_every_documented_deployment_compiles_as_the_azure_cli_compiles_it_and_deploys():
    declared = parsed(MAIN)["parameters"]
    secure = {name for name, spec in declared.items() if "secure" in decorators(spec)}
    for environ, command in _deployments():
        assert "--template-file infra/main.bicep" in command
        assert "--parameters infra/main.bicepparam" in command
        params = _parameters(command)
        assert set(params) <= set(declared), sorted(set(params) - set(declared))
        assert not secure & set(params), f"a secret on the command line: {command}"
        overrides: dict[str, object] = {
            k: v == "true" if v in ("true", "false") else v for k, v in params.items()
        }
        # the Azure CLI compiles main.bicepparam first without the command line's values, in the
        # environment it runs in (raises ParamsRefused as Bicep refuses), then again with them
        values = build_params(read_bicepparam(), environ, overrides)
        Deployment(values)  # raises DeploymentRefused for a combination the template refuses


def test_the_sql_deployment_is_followed_by_the_app_role_step():
    [sql] = [c for c in _all("az deployment group create") if "queueingProvider=sql" in c]
    assert "deployPostgres=true" in sql
    outputs = set(parsed(MAIN)["outputs"])
    sql_file = (INFRA / "postgres" / "app-role.sql").read_text(encoding="utf-8")
    wanted = set(re.findall(r":['\"]?(\w+)['\"]?", sql_file.split("\\set ON_ERROR_STOP on", 1)[1]))
    runs = [c for c in _all("psql") if " -f " in c]
    assert runs
    assert all("-f infra/postgres/app-role.sql" in c for c in runs), runs
    for command in _all("psql"):
        if command in runs:
            given = dict(re.findall(r"-v (\w+)=(\S+)", command))
            assert set(given) == wanted, (given, wanted)
        for placeholder in re.findall(r"<(\w+)>", command):
            assert placeholder in outputs | set(parsed(MAIN)["parameters"]), placeholder


def test_the_database_fix_for_earlier_deployments_names_real_outputs():
    [check] = [c for c in _all("psql") if "pg_database" in c]
    assert "datname = 'queueing'" in check
    assert parsed(MAIN)["variables"]["postgresDatabaseName"]["value"] == "queueing"
    [delete] = _all("az postgres flexible-server db delete")
    assert "--database-name queueing" in delete
    assert "<postgresServerName>" in delete
    assert "postgresServerName" in parsed(MAIN)["outputs"]


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_bare_publish_and_no_system_assigned_identity_left_in_the_docs(path):
    text = path.read_text(encoding="utf-8")
    assert not re.search(r"func azure functionapp publish <[\w-]+>\s*(#|$)", text, re.M)
    assert "system-assigned identity, identity-based" not in text
