"""Importing any module of bso starts nothing and opens no connection.

Checked in a fresh interpreter that imports every module of ``bso``,
``bso_workers`` and ``bso_client`` (the Celery entry point ``bso_workers.app``
included) with the ways a module could reach out replaced by recorders: a
socket connect, a child process, a thread start.  The training frameworks the
client's integrations wrap are imported before the recorders are in place:
what they do at import is theirs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PROBE = r"""
import contextlib, importlib, json, pkgutil, socket, subprocess, sys, threading

# The frameworks bso_client.integrations exist to wrap are imported by those
# modules on purpose, and do their own things at import (torch may start a
# child process): imported first, so what is recorded below is bso's alone.
for framework in ("torch", "pytorch_lightning", "transformers"):
    with contextlib.suppress(ImportError):
        importlib.import_module(framework)

done = []

def record(what):
    def refuse(*args, **kwargs):
        done.append(what)
        raise RuntimeError(f"{what} at import")
    return refuse

socket.socket.connect = record("socket connect")
socket.create_connection = record("socket connect")
subprocess.Popen.__init__ = record("child process")
threading.Thread.start = record("thread start")

failed = {}
for package in ("bso", "bso_workers", "bso_client"):
    root = importlib.import_module(package)
    for info in pkgutil.walk_packages(root.__path__, f"{package}."):
        if ".migrations." in info.name or info.name.endswith(".migrations"):
            continue  # Alembic scripts, run only by Alembic
        try:
            importlib.import_module(info.name)
        except Exception as exc:
            failed[info.name] = repr(exc)
print(json.dumps({"done": done, "failed": failed, "count": len(sys.modules)}))
"""


def test_importing_every_module_starts_nothing_and_connects_nowhere(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONPATH": ""}
    result = subprocess.run(
        [sys.executable, "-c", PROBE],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=240,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["failed"] == {}
    assert report["done"] == []


def test_the_probe_notices_a_module_that_connects(tmp_path: Path) -> None:
    """The recorders work: a module that connects at import is caught."""
    package = tmp_path / "noisy"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "connects.py").write_text(
        "import socket\ntry:\n    socket.create_connection(('127.0.0.1', 9))\nexcept Exception:\n"
        "    pass\n"
    )
    probe = PROBE.replace('("bso", "bso_workers", "bso_client")', '("noisy",)')
    result = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONPATH": str(tmp_path)},
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1])["done"] == ["socket connect"]
