"""A deployment into a re-created resource group of the same name is not stopped by the deleted vault.

The vault's name comes from ``namePrefix`` and the resource group's id, and the vault has soft delete with
purge protection. Deleting the resource group soft-deletes the vault, which keeps its name for 90 days and
cannot be purged; a deployment into a new resource group of the same name (same subscription, so the same
id) computes the same name, and Azure refuses it ("a vault with the same name" exists, deleted). Two ways
out, documented next to the deployment: recover the deleted vault (`az keyvault recover`), after which the
deployment updates it, or give the vault a new name with ``vaultNameSalt``.
"""

from __future__ import annotations

import re

from tests.infra.bicep_tools import INFRA, MAIN, ROOT, parsed
from tests.infra.deployment import deploy

VAULT = "Microsoft.KeyVault/vaults"


def test_the_vault_keeps_its_name_for_90_days_after_deletion():
    vault = deploy().resource_properties("keyVault", VAULT)
    # why a name can be held: these stay (purge protection cannot be turned off once on)
    assert vault["enableSoftDelete"] is True
    assert vault["enablePurgeProtection"] is True
    assert vault["softDeleteRetentionInDays"] == 90


def test_a_name_salt_gives_the_vault_a_fresh_name_and_only_the_vault():
    first, again = deploy(), deploy()  # the same subscription and resource group name
    assert first.output("keyVaultName") == again.output("keyVaultName")  # what a soft-deleted vault holds
    salted = deploy(vaultNameSalt="2")
    other = deploy(vaultNameSalt="3")
    names = {first.output("keyVaultName"), salted.output("keyVaultName"), other.output("keyVaultName")}
    assert len(names) == 3, names
    for name in names:
        assert 3 <= len(name) <= 24, name  # Key Vault's rule
        assert re.fullmatch(r"[a-z][a-z0-9-]*[a-z0-9]", name), name
    # nothing else is renamed: the app, its identity and its queues stay where they were
    assert salted.output("functionAppName") == first.output("functionAppName")
    assert salted.output("serviceBusNamespaceName") == first.output("serviceBusNamespaceName")
    # and the app reads its key from the vault that is there
    assert salted.app_settings["QUEUEING_API_KEY"].startswith(
        f"@Microsoft.KeyVault(SecretUri=https://{salted.output('keyVaultName')}.vault.azure.net/"
    )


def test_the_docs_say_how_to_deploy_again_after_deleting_the_resource_group():
    assert "vaultNameSalt" in parsed(MAIN)["parameters"]
    for path in (INFRA / "README.md", ROOT / "docs" / "azure" / "deployment.md"):
        text = path.read_text(encoding="utf-8")
        if "--8<--" in text and "infra/README.md" in text:
            continue  # deployment.md includes the README
        assert "az keyvault recover" in text, path
        assert "vaultNameSalt" in text, path
        assert re.search(r"purge protection", text, re.I), path
