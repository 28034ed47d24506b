"""scripts/bench_pipeline.py works: a ``--quick`` run against bso alone, and its helpers.

No timing is asserted anywhere: the figures depend on the machine and on who
else uses it.  What is checked is that the script drives the live service
(Redis, Celery workers, SQLite) and the bare-task baseline end to end, prints
its tables, counts every call, and leaves no process behind.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from functools import cache
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "bench_pipeline.py"


@cache
def load_script() -> ModuleType:
    """Import the script (scripts are not a package); dataclasses need it in sys.modules."""
    spec = importlib.util.spec_from_file_location("bench_pipeline", SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_worker_times_reads_event_handled_lines(tmp_path: Path) -> None:
    bench = load_script()
    log = tmp_path / "worker1.log"
    log.write_text('ts=1 level=INFO logger=bso.tasks msg="event handled" kind=epoch ms=3.5\n')
    offsets = bench.log_offsets([log])
    with log.open("a") as out:
        out.write(
            'ts=2 level=INFO logger=bso.tasks pid=7 msg="event handled" event_id=e kind=epoch '
            "job_id=j trial=1 reply=epoch_decision ms=17.25\n"
            'ts=3 level=INFO logger=bso.tasks msg="event handled" kind=end job_id=j ms=2\n'
            "ts=4 level=WARNING logger=celery msg=unrelated ms=99\n"
        )
    assert bench.worker_times(offsets) == {"epoch": [17.25], "end": [2.0]}


def test_rounds_and_the_simulated_job() -> None:
    bench = load_script()
    plan = bench.make_plan(bench.build_parser().parse_args([]))
    assert plan.concurrency == [1, 8, 32]
    assert plan.workers == [1, 2]
    assert [plan.rounds_for(c) for c in (1, 8, 32)] == [8, 3, 3]
    # The target is met at the last epoch and not before, at the same cost per epoch.
    totals = [bench.epoch_totals(e, 20) for e in range(1, 21)]
    assert [m >= bench.TARGET_METRIC for _, _, m in totals] == [False] * 19 + [True]
    assert len({energy / time for time, energy, _ in totals}) == 1


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_quick_run_against_bso(tmp_path: Path) -> None:
    work = tmp_path / "work"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--no-zeus", "--work-dir", str(work)],
        capture_output=True,
        text=True,
        timeout=170,
        cwd=ROOT,
        check=False,
    )
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert "bare task, interleaved with those rounds: 30 calls" in out
    rows = re.findall(r"^\| bso 1w \| (\d+) \| (\d+) \| [\d.]+ \|", out, re.MULTILINE)
    assert rows == [("1", "2"), ("4", "1")]
    assert "client retries 0, errors 0, trials stopped early 0" in out
    assert "Targets (printed, not asserted):" in out
    # Every call of the C=4 phase was answered: 4 jobs x (register, next, 5 epochs, end).
    assert re.search(r"bso 1w\s+C=4\s+1 rounds: 32 calls", out), out
    # Nothing left running from this work dir.
    leftovers = subprocess.run(
        ["pgrep", "-f", str(work)], capture_output=True, text=True, check=False
    ).stdout.split()
    assert [pid for pid in leftovers if int(pid) != os.getpid()] == []
