"""What users read carries no internal specification ids ("SPEC E6", "(B3)", "seed 004"): they point
at documents that are not in the repository. Plain words instead."""

from __future__ import annotations

import re
import subprocess

from tests.docs.blocks import ROOT

SPEC_ID = re.compile(r"\bSPEC\s+[A-F]\d|\((?:[A-F]\d{1,2})(?:[,;)]|\s*-)|\b[Ss]eed\s+0\d\d\b")


def shipped_and_read_files() -> list[str]:
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
    return [
        f
        for f in listed.stdout.split()
        if (ROOT / f).is_file()
        and f.endswith((".py", ".md", ".sh", ".bicep", ".bicepparam", ".json", ".toml", ".yml", "Makefile"))
        and not f.startswith(("node_modules/", "tests/docs/test_wording.py"))
        and f != "package-lock.json"
    ]


def test_no_internal_spec_ids_in_the_repository():
    found = []
    for name in shipped_and_read_files():
        for number, line in enumerate((ROOT / name).read_text(errors="replace").splitlines(), 1):
            if SPEC_ID.search(line):
                found.append(f"{name}:{number}: {line.strip()}")
    assert not found, "\n".join(found)


def test_the_pattern_finds_what_it_is_for():
    for text in ("(SPEC E6)", "the worker (B13)", "(B6, B7)", "seed 004's retries", "SPEC C7, D3"):
        assert SPEC_ID.search(text), text
    for text in ("a 2-core machine", "B-tree", "(Service Bus 1-260)", "CKV_QK_1", "sha256"):
        assert not SPEC_ID.search(text), text
