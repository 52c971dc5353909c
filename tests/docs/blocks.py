"""Fenced code blocks of the README and the documentation, with the marker that says how to test each.

A marker is an HTML comment on the line before the fence (invisible on GitHub and in the site):

- ``<!-- docs-test: skip — REASON -->``: a shell block that cannot run here (a cloud account, a
  command that runs until stopped); the reason is required and says what covers it instead.
- ``<!-- docs-test: compile-only — REASON -->``: a Python block that needs a cloud account; it is
  compiled, not run.
- ``<!-- docs-test: pytest -->``: a Python block that is a test module; it is run by pytest with
  pytest-asyncio's ``asyncio_mode=auto``, as the page tells readers to configure it.
- ``<!-- docs-test: with-server -->``: a shell block that talks to ``queueing serve``; one is started
  (on a free port, written over the block's 8080) in the page's folder for the block.

Unmarked Python blocks of a page run in order in one namespace, as a reader would paste them into
``python -m asyncio`` (top-level ``await`` allowed); ``__name__`` is ``"__main__"``. Unmarked shell
blocks run with bash (``set -euo pipefail``) in the page's folder.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PYTHON = {"python", "py", "python3"}
SHELL = {"sh", "bash", "shell", "console"}
MARKER = re.compile(r"^\s*<!--\s*docs-test:\s*(?P<kind>[a-z-]+)\s*(?:[—:-]+\s*(?P<reason>.*?))?\s*-->\s*$")
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`]*)$")
INCLUDE = re.compile(r'^\s*--8<--\s+"(?P<path>[^"]+)"\s*$')
KINDS = {"skip", "compile-only", "pytest", "with-server"}


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    marker: str | None
    reason: str | None

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence = m["indent"], m["fence"]
        lang = (m["info"].strip().split() or [""])[0].lstrip(".{").lower()
        prev = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        mark = MARKER.match(prev)
        body: list[str] = []
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            line = lines[j]
            body.append(line[len(indent) :] if line.startswith(indent) else line.lstrip())
            j += 1
        found.append(
            Block(
                path,
                i + 1,
                lang,
                "\n".join(body) + "\n",
                mark["kind"] if mark else None,
                (mark["reason"] or None) if mark else None,
            )
        )
        i = j + 1
    return found


def pages() -> list[Path]:
    """The README, every page under docs/, and every file a page includes (``--8<-- "path"``)."""
    docs = sorted((ROOT / "docs").rglob("*.md"))
    included: list[Path] = []
    for page in docs:
        for line in page.read_text().splitlines():
            m = INCLUDE.match(line)
            if m:
                included.append(ROOT / m["path"])
    return [ROOT / "README.md", *docs, *sorted(set(included))]
