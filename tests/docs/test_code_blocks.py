"""Every code block of the README and the documentation runs as written (see tests/docs/blocks.py for
the markers): Python blocks page by page, test modules under pytest, shell blocks under bash, and the
few that need a cloud account or run until stopped are compiled or skipped with a stated reason."""

from __future__ import annotations

import ast
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.docs.blocks import KINDS, PYTHON, ROOT, SHELL, Block, blocks, pages

ALL = [b for page in pages() for b in blocks(page)]
BIN = Path(sys.prefix) / "bin"


def clean_env(**extra: str) -> dict[str, str]:
    """The reader's environment: none of the kit's settings from this test run."""
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("QUEUEING_") and not k.startswith("Queueing")
    }
    env["PYTHONPATH"] = str(ROOT)  # for tests.docs.run_python only; the kit itself comes from the venv
    return {**env, **extra}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def page_id(path: Path) -> str:
    return str(path.relative_to(ROOT))


# -- every block is accounted for ------------------------------------------------------------------
def test_the_pages_have_code_blocks_to_test():
    assert len([b for b in ALL if b.lang in PYTHON]) >= 8
    assert len([b for b in ALL if b.lang in SHELL and b.marker != "skip"]) >= 3


@pytest.mark.parametrize("block", ALL, ids=lambda b: b.where)
def test_every_block_declares_its_language_and_a_valid_marker(block: Block):
    assert block.lang, f"{block.where}: give the fence a language (`text` for output)"
    if block.marker is None:
        return
    assert block.marker in KINDS, f"{block.where}: unknown marker {block.marker!r}"
    if block.marker in ("skip", "compile-only"):
        assert len(block.reason or "") > 10, f"{block.where}: say why it cannot run here"
    allowed = {"skip": SHELL, "with-server": SHELL, "compile-only": PYTHON, "pytest": PYTHON}[block.marker]
    assert block.lang in allowed, f"{block.where}: {block.marker!r} does not apply to {block.lang} blocks"


@pytest.mark.parametrize("block", [b for b in ALL if b.lang in PYTHON], ids=lambda b: b.where)
def test_every_python_block_compiles(block: Block):
    compile(block.code, block.where, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)


def test_the_readme_opens_with_the_two_set_up_commands():
    first = blocks(ROOT / "README.md")[0]
    commands = [line.split("#")[0].strip() for line in first.code.splitlines() if line.strip()]
    assert commands == ["make serve", "make test"]
    before = (ROOT / "README.md").read_text().splitlines()[: first.line - 1]
    assert [line for line in before if line.strip() and not line.startswith("<!--")] == ["# queueing-kit"]


# -- Python ----------------------------------------------------------------------------------------
PY_PAGES = sorted(
    {b.path for b in ALL if b.lang in PYTHON and b.marker not in ("pytest", "compile-only")}, key=page_id
)


@pytest.mark.parametrize("page", PY_PAGES, ids=page_id)
def test_the_python_blocks_of_a_page_run_in_order(page: Path, tmp_path: Path):
    done = subprocess.run(
        [sys.executable, "-m", "tests.docs.run_python", str(page)],
        cwd=tmp_path,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


@pytest.mark.parametrize("block", [b for b in ALL if b.marker == "pytest"], ids=lambda b: b.where)
def test_a_test_module_in_the_docs_passes_under_pytest(block: Block, tmp_path: Path):
    (tmp_path / "test_from_docs.py").write_text(block.code)
    (tmp_path / "pytest.ini").write_text("[pytest]\nasyncio_mode = auto\n")  # what the page tells readers
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_from_docs.py"],
        cwd=tmp_path,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert " passed" in done.stdout
    assert "failed" not in done.stdout


# -- shell -----------------------------------------------------------------------------------------
SH_PAGES = sorted({b.path for b in ALL if b.lang in SHELL and b.marker != "skip"}, key=page_id)


class Server:
    """``queueing serve`` for a block that talks to it, on a free port, in the page's folder."""

    def __init__(self, cwd: Path) -> None:
        self.port = free_port()
        # its log goes to a file: a pipe nobody reads fills up and stalls the server mid-run
        self.log = cwd / f"serve-{self.port}.log"
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(
                [str(BIN / "queueing"), "serve", "--port", str(self.port)],
                cwd=cwd,
                env=clean_env(EXAMPLE_INVOICE_SECONDS="0.01"),
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 120  # generous: a loaded machine starts slowly
        url = f"http://127.0.0.1:{self.port}/api/_system/queueing/health"
        while True:
            try:
                with urllib.request.urlopen(url, timeout=5):
                    return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise AssertionError(f"queueing serve did not answer: {self.log.read_text()}") from None
                time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=60)


@pytest.mark.parametrize("page", SH_PAGES, ids=page_id)
def test_the_shell_blocks_of_a_page_run(page: Path, tmp_path: Path):
    # the page's folder looks like a checkout after `make install` / `make serve`: both environments
    # are this test run's own, and infra/ is a copy (commands may write the generated parameters)
    for venv in (".venv", ".venv-serve"):
        (tmp_path / venv).symlink_to(sys.prefix)
    shutil.copytree(ROOT / "infra", tmp_path / "infra")
    env = clean_env(PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    for block in blocks(page):
        if block.lang not in SHELL or block.marker == "skip":
            continue
        server = Server(tmp_path) if block.marker == "with-server" else None
        code = block.code.replace("8080", str(server.port)) if server else block.code
        try:
            done = subprocess.run(
                ["bash", "-c", "set -euo pipefail\n" + code],
                cwd=tmp_path,
                env=env,
                capture_output=True,
                text=True,
                timeout=120,
                check=False,
            )
        finally:
            if server:
                server.stop()
        assert done.returncode == 0, f"{block.where}:\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
