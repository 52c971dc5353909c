"""The deployer's psql reaches the PostgreSQL server it just deployed, and only while it needs to.

infra/postgres/app-role.sql is run with psql by the server's Entra administrator after the deployment
(infra/README.md). The template's only firewall rule was 0.0.0.0 (traffic from inside Azure), and a
flexible server refuses a connection from an address no rule admits ("no pg_hba.conf entry for host"):
the documented step failed from the deployer's own machine. ``postgresClientIpAddress`` admits one
address, and the documented steps say to set it (or to run psql from Cloud Shell, inside Azure) and to
delete the rule afterwards.
"""

from __future__ import annotations

import re
from typing import Any

from tests.infra.bicep_tools import INFRA, ROOT, body
from tests.infra.deployment import Deployment, deploy

FIREWALL_RULE = "Microsoft.DBforPostgreSQL/flexibleServers/firewallRules"
ADMIN = {
    "queueingProvider": "sql",
    "deployPostgres": True,
    "postgresAdminObjectId": "5f1e0e8e-0000-4000-8000-00000000ad01",
    "postgresAdminName": "dba@contoso.example",
}


def _rules(deployment: Deployment) -> dict[str, tuple[str, str]]:
    """The firewall rules the deployment creates: name -> (start, end)."""
    scope = deployment.scope_of("postgres")
    out: dict[str, tuple[str, str]] = {}
    for symbol, res in scope.doc["resources"].items():
        if res["type"] != FIREWALL_RULE or not deployment._deployed(scope, res):
            continue
        p = scope.eval(body(res)["properties"])
        out[scope.resource(symbol).name.rsplit("/", 1)[1]] = (p["startIpAddress"], p["endIpAddress"])
    return out


def test_by_default_only_traffic_from_inside_azure_is_admitted():
    assert list(_rules(deploy(**ADMIN)).values()) == [("0.0.0.0", "0.0.0.0")]


def test_the_deployers_address_is_admitted_when_given():
    rules = _rules(deploy(**ADMIN, postgresClientIpAddress="203.0.113.7"))
    assert sorted(rules.values()) == [("0.0.0.0", "0.0.0.0"), ("203.0.113.7", "203.0.113.7")]
    [name] = [n for n, r in rules.items() if r[0] == "203.0.113.7"]
    assert name == "AllowDeployerClientIp"  # the name the documented clean-up deletes
    server = deploy(**ADMIN, postgresClientIpAddress="203.0.113.7").output("postgresServerName")
    assert server.startswith("psql-")


def _docs() -> str:
    return (INFRA / "README.md").read_text(encoding="utf-8") + (
        ROOT / "docs" / "azure" / "deployment.md"
    ).read_text(encoding="utf-8")


def test_the_documented_sql_deployment_lets_psql_in_and_closes_the_door_after():
    text = _docs()
    [block] = re.findall(r"```sh\n([^`]*deployPostgres=true[^`]*)```", text)
    block = block.replace("\\\n", " ")  # continuation lines joined, as the shell reads them
    assert "postgresClientIpAddress=" in block, block
    assert block.index("postgresClientIpAddress=") < block.index("-f infra/postgres/app-role.sql")
    delete = re.search(r"az postgres flexible-server firewall-rule delete [^\n]*AllowDeployerClientIp", block)
    assert delete, block
    assert delete.start() > block.index("-f infra/postgres/app-role.sql"), (
        "delete the rule after the role exists"
    )
    assert re.search(r"Cloud Shell", text), "the way without opening the firewall: psql from inside Azure"


def _placeholders(command: str) -> set[Any]:
    return set(re.findall(r"<(\w+)>", command))


def test_the_clean_up_names_an_output():
    from tests.infra.bicep_tools import MAIN, parsed

    [block] = re.findall(r"```sh\n([^`]*deployPostgres=true[^`]*)```", _docs())
    [line] = [ln for ln in block.replace("\\\n", " ").splitlines() if "firewall-rule delete" in ln]
    outputs = set(parsed(MAIN)["outputs"])
    assert _placeholders(line) - {"rg"} <= outputs, line
