"""A new user's first minutes: `pip install .` into a fresh environment, then `queueing serve` from a
folder outside the repository serves the example app shipped in the package and processes its
messages; then `make serve PORT=...` (the README's first command) answers on that port.

The one test here that builds a virtual environment (slow: it installs the kit and its dependencies,
from pip's cache when it is warm). Start-up time is measured by bench/first_serve.sh, not here.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.docs.blocks import ROOT
from tests.docs.test_code_blocks import clean_env, free_port

pytestmark = pytest.mark.slow

API = "http://127.0.0.1:{port}/api/_system/queueing"


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=2) as response:
        return json.load(response)


def wait_for(port: int, proc: subprocess.Popen, log: Path, seconds: float = 120) -> dict:
    deadline = time.monotonic() + seconds
    while True:
        try:
            return get(API.format(port=port) + "/health")
        except OSError:
            if proc.poll() is not None:
                raise AssertionError(f"exited with {proc.returncode}: {log.read_text()}") from None
            if time.monotonic() > deadline:
                raise AssertionError("the ops API did not answer") from None
            time.sleep(0.2)


def start(cmd: list, cwd: Path, env: dict[str, str], log: Path) -> subprocess.Popen:
    """In a session of its own (stop() signals make and the server it started together); the log goes
    to a file, as a pipe nobody reads would fill up and stall the server."""
    with log.open("w") as out:
        return subprocess.Popen(
            [str(c) for c in cmd],
            cwd=cwd,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def stop(proc: subprocess.Popen, log: Path) -> str:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=60)
    return log.read_text()


def run(*cmd: str | Path, cwd: Path, env: dict[str, str], timeout: float = 600) -> str:
    done = subprocess.run(
        [str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert done.returncode == 0, f"{cmd}: {done.stdout[-2000:]}{done.stderr[-2000:]}"
    return done.stdout


def test_pip_install_then_queueing_serve_from_another_folder_then_make_serve(tmp_path: Path):
    venv, elsewhere = tmp_path / "venv", tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = clean_env(EXAMPLE_INVOICE_SECONDS="0.01", EXAMPLE_PAYMENT_FAILURE_RATE="0")
    env.pop("PYTHONPATH")  # nothing from the checkout: only what `pip install .` put in the environment
    run(sys.executable, "-m", "venv", venv, cwd=tmp_path, env=env)
    run(
        venv / "bin" / "python",
        "-m",
        "pip",
        "install",
        "-q",
        "--disable-pip-version-check",
        ROOT,
        cwd=tmp_path,
        env=env,
    )
    located = run(
        venv / "bin" / "python",
        "-c",
        "import queueing_core; print(queueing_core.__file__)",
        cwd=elsewhere,
        env=env,
    )
    assert located.startswith(str(venv)), located  # the installed package, not the source tree
    licence = 'import importlib.metadata as m; print(m.metadata("queueing-kit")["License-Expression"])'
    assert run(venv / "bin" / "python", "-c", licence, cwd=elsewhere, env=env).strip() == "MIT"  # SPDX

    # the default QUEUEING_APP is the packaged example: no --app, no checkout on the path
    port = free_port()
    serve_log = tmp_path / "serve.log"
    serve = start([venv / "bin" / "queueing", "serve", "--port", port], elsewhere, env, serve_log)
    try:
        wait_for(port, serve, serve_log)
        run(
            venv / "bin" / "queueing",
            "enqueue",
            "OrderPlaced",
            "--example",
            "--count",
            "2",
            cwd=elsewhere,
            env=env,
        )
        deadline = time.monotonic() + 60
        while True:  # each order: its confirmation, invoice and payment capture
            queues = {q["queue"]: q["counts"] for q in get(API.format(port=port) + "/stats")["queues"]}
            done = sum(c.get("Succeeded", 0) for c in queues.values())
            if done == 6 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert done == 6, queues
        # the dashboard, from the installed package (its templates and static files included)
        ui = f"http://127.0.0.1:{port}/api/_system/queueing/ui/"
        with urllib.request.urlopen(ui, timeout=30) as page:
            assert "order-placed" in page.read().decode()
        with urllib.request.urlopen(ui + "static/htmx.min.js", timeout=30) as script:
            assert script.status == 200
    finally:
        log = stop(serve, serve_log)
    assert "app orders (3 queues) on sqlite:///./queueing.db" in log
    assert f"dashboard: {ui} (no key: open to this machine only)" in log
    assert (elsewhere / "queueing.db").exists()

    # the README's first command, with its port setting, in the same environment
    port = free_port()
    make_log = tmp_path / "make-serve.log"
    make_env = {**env, "QUEUEING_DATABASE_URL": f"sqlite:///{tmp_path}/make-serve.db"}
    make = start(["make", "serve", f"PORT={port}", f"SERVE_VENV={venv}"], ROOT, make_env, make_log)
    try:
        health = wait_for(port, make, make_log)
    finally:
        log = stop(make, make_log)
    assert set(health["queues"]) == {"order-placed", "generate-invoice", "capture-payment"}
    assert f"--port {port}" in log
