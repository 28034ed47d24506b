"""scripts/soak.py works at tiny scale: every fault kind fires and nothing is lost or counted twice.

The full-scale run (10,000 epoch events, 100 jobs, 4 workers) takes minutes
and is recorded in docs/benchmarks.md; this runs the same script on a few jobs
and two worker nodes for about 20 s of load, with faults frequent enough that
each kind happens at least once (``--min-seconds`` keeps the load on past the
slowest schedule), on a database of the test session's PostgreSQL server.
"""

from __future__ import annotations

import random
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.fixtures.scripts import load_script

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "soak.py"
KINDS = ("worker_kill", "redis_restart", "db_drop", "duplicate", "reorder", "garbage")


def test_a_tiny_soak_loses_nothing_and_counts_nothing_twice(
    fresh_postgres_url: str, tmp_path: Path
) -> None:
    fault_log = tmp_path / "faults.log"
    argv = [
        sys.executable, str(SCRIPT),
        "--database-url", fresh_postgres_url,
        "--data-dir", str(tmp_path / "stack"),
        "--fault-log", str(fault_log),
        "--jobs", "6", "--runners-per-job", "2", "--workers", "2",
        "--epochs-total", "300", "--min-seconds", "18", "--duration-limit", "150",
        "--worker-kill-every", "6", "--redis-restart-every", "8", "--redis-down", "1",
        "--db-drop-every", "4", "--garbage-every", "0.5",
        "--duplicate-rate", "0.05", "--reorder-rate", "0.05",
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=240, check=False)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    final = done.stdout.strip().splitlines()[-1]
    counts = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", final)}
    assert final.startswith("soak: "), final
    assert counts["lost"] == 0, output
    assert counts["double_counted"] == 0, output
    assert counts["epochs"] >= 300
    assert counts["accepted"] + counts["rejected"] == counts["sent"]
    assert "replay=ok" in final
    assert "result=pass" in final
    for kind in KINDS:
        assert counts[kind] >= 1, (kind, final)
    lines = fault_log.read_text().splitlines()
    for kind in KINDS:
        logged = [line for line in lines if line.split()[2] == kind]
        assert logged, kind
        if kind not in ("garbage",):  # a garbage line logs a burst of items
            assert len(logged) == counts[kind], kind
    assert f"fault log: {fault_log}" in done.stdout


def test_redis_started_again_by_a_fault_outlives_the_thread_that_injected_it(
    tmp_path: Path,
) -> None:
    """A child dies with the thread that started it (the parent-death signal is
    per thread), and the soak's fault injector ends before the soak reads its
    last counts: a Redis it started again had gone by then (connection refused
    for a minute, the tiny soak failed on a busy machine).  The restart is done
    by a thread that lives as long as the stack."""
    soak_service = load_script("soak_service")
    stack = soak_service.SoakStack(
        tmp_path / "stack", f"sqlite:///{tmp_path / 'bso.sqlite3'}", 1,
        soak_service.FaultLog(tmp_path / "faults.log"),
    )  # fmt: skip
    stack.start()
    try:
        injector = threading.Thread(
            target=stack.restart_redis, args=(random.Random(1), 0.2), name="injector"
        )
        injector.start()
        injector.join()
        time.sleep(1.0)  # Redis acts on SIGTERM at its next cron tick (100 ms)
        _, restarted = stack._redis()
        assert restarted.alive(), restarted.log_tail()
        assert stack.dead_letter_counts(within_s=0) == {}
    finally:
        stack.stop()
