"""``celery -A bso_workers.app``: the entry point's own behaviour, as a process."""

from __future__ import annotations

import os
import subprocess
import sys
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
