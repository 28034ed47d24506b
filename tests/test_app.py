"""``celery -A bso_workers.app``: the entry point's own behaviour, as a process."""

from __future__ import annotations

import base64
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path


def test_a_worker_on_a_pool_bso_cannot_time_limit_refuses_to_start(tmp_path: Path) -> None:
    env = {
        **os.environ,
        # Nothing listens there: the refusal comes before any connection.
        "BSO_BROKER_URL": "redis://127.0.0.1:1/0",
        "BSO_DATABASE_URL": f"sqlite:///{tmp_path / 'bso.sqlite3'}",
    }
    done = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "bso_workers.app", "worker", "--pool", "threads"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=60,
        check=False,
    )
    assert done.returncode != 0
    assert "bso workers run the solo or prefork pool, not celery.concurrency.thread" in (
        done.stderr + done.stdout
    )


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _status(url: str, login: str | None = None) -> int:
    headers = {"Authorization": f"Basic {login}"} if login else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=5) as r:
            return int(r.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def test_flowers_metrics_ask_for_its_login_and_only_the_healthcheck_stays_open(
    tmp_path: Path,
) -> None:
    """Flower 2 leaves its own ``/metrics`` (every task's name, worker and timing) open
    even with a login set; ``bso_workers.flower_login`` closes it.  No Redis needed:
    Flower serves its pages while its event thread retries the broker."""
    port = _free_port()
    env = {
        **os.environ,
        "BSO_BROKER_URL": "redis://127.0.0.1:1/0",
        "BSO_DATABASE_URL": f"sqlite:///{tmp_path / 'bso.sqlite3'}",
        "FLOWER_BASIC_AUTH": "bso:the-password",
    }
    argv = [sys.executable, "-m", "celery", "-A", "bso_workers.app", "flower"]
    argv += ["--address=127.0.0.1", f"--port={port}"]
    flower = subprocess.Popen(
        argv, env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while _status_or_none(f"{base}/healthcheck") != 200:
            assert time.monotonic() < deadline, "Flower did not start"
            time.sleep(0.3)
        login = base64.b64encode(b"bso:the-password").decode()
        assert _status(f"{base}/metrics") == 401
        assert _status(f"{base}/metrics", base64.b64encode(b"bso:wrong").decode()) == 401
        assert _status(f"{base}/metrics", login) == 200
        assert _status(f"{base}/api/tasks") == 401
        not_ascii = base64.b64encode("bso:\u00e9".encode()).decode()  # Flower's own 500
        assert _status(f"{base}/api/tasks", not_ascii) == 401
        assert _status(f"{base}/metrics", not_ascii) == 401
    finally:
        flower.terminate()
        flower.wait(30)


def _status_or_none(url: str) -> int | None:
    try:
        return _status(url)
    except OSError:
        return None
