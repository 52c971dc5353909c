"""The documentation site: `make docs` fails on a broken link, and the generated reference pages
cover every setting and every route (they are built from the code, so they cannot drift)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from queueing_core.settings import QueueingSettings
from tests.docs.blocks import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import docs_reference

MKDOCS = Path(sys.prefix) / "bin" / "mkdocs"


def makefile_docs_command() -> list[str]:
    """The command `make docs` runs, read from the Makefile (so its flags are what is tested)."""
    recipe = re.search(r"^docs:.*\n\t(?P<cmd>.+)$", (ROOT / "Makefile").read_text(), re.M)
    assert recipe, "the Makefile has no docs target"
    words = recipe["cmd"].split()
    return [str(MKDOCS) if w.endswith("/mkdocs") else w for w in words if "=" not in w]


def test_a_broken_link_fails_the_build(tmp_path: Path):
    for part in ("docs", "scripts", "infra", "bench"):
        shutil.copytree(ROOT / part, tmp_path / part, ignore=shutil.ignore_patterns(".out", "__pycache__"))
    shutil.copy(ROOT / "mkdocs.yml", tmp_path)
    page = tmp_path / "docs" / "index.md"
    page.write_text(page.read_text() + "\nSee [a page that is not there](transports/kafka.md).\n")
    done = subprocess.run(
        makefile_docs_command(), cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode != 0
    assert "transports/kafka.md" in done.stdout + done.stderr


def test_the_configuration_reference_names_every_setting_with_a_description():
    table = docs_reference.settings_reference()
    for name, field in QueueingSettings.model_fields.items():
        assert field.description, f"QueueingSettings.{name} has no description for the reference"
        assert f"| `QUEUEING_{name.upper()}` |" in table
    assert "| `QUEUEING_ARCHIVE_AFTER` | `P7D` |" in table
    assert "`inprocess`, `sql`, `storage_queue`, `servicebus`, `rabbitmq`, `sqs`" in table  # from the type


@pytest.fixture(scope="module")
def openapi() -> dict:
    return docs_reference.openapi_document()


def test_the_api_reference_lists_every_route_of_the_served_document(openapi):
    page = docs_reference.openapi_reference(openapi)
    routes = [(m, p) for p, item in openapi["paths"].items() for m in item if m in docs_reference.METHODS]
    assert len(routes) >= 18
    for method, path in routes:
        assert f"### `{method.upper()} {path}`" in page
    for schema in openapi["components"]["schemas"]:
        assert f"### {schema}\n" in page


def test_the_readme_links_point_at_files_that_exist():
    text = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [link for link in links if "://" not in link]
    assert len(local) >= 20  # the front page links into the documentation
    missing = [link for link in local if not (ROOT / link).exists()]
    assert not missing, missing
