"""scripts/bench_pipeline.py works: a ``--quick`` run against bso alone, and its helpers.

No timing is asserted anywhere: the figures depend on the machine and on who
else uses it.  What is checked is that the script drives the live service
(Redis, Celery workers, SQLite) and the bare-task baseline (interleaved at C=1,
and as its own closed-loop phase at every C) end to end, prints its tables,
counts every call, and leaves no process behind; and, on made-up phases, how
it prints the bare-task floor under the p99 target.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.fixtures.scripts import load_script as load_named_script

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "bench_pipeline.py"


def load_script() -> ModuleType:
    return load_named_script("bench_pipeline")


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
    assert plan.pool == "solo"
    assert [plan.rounds_for(c) for c in (1, 8, 32)] == [8, 3, 3]
    # The bare phase: as many round trips per caller as a bso job's epoch reports.
    assert [plan.bare_calls_per_thread(c) for c in (1, 8, 32)] == [160, 60, 60]
    prefork = bench.make_plan(bench.build_parser().parse_args(["--pool", "prefork"]))
    assert prefork.pool == "prefork"
    with pytest.raises(SystemExit):
        bench.build_parser().parse_args(["--pool", "threads"])
    # The target is met at the last epoch and not before, at the same cost per epoch.
    totals = [bench.epoch_totals(e, 20) for e in range(1, 21)]
    assert [m >= bench.TARGET_METRIC for _, _, m in totals] == [False] * 19 + [True]
    assert len({energy / time for time, energy, _ in totals}) == 1


def made_up_phase(system: str, workers: int | None, calls_per_s: float, ms: float) -> object:
    """A C=32 phase of ``calls_per_s`` epoch reports per second, every one taking ``ms``."""
    bench = load_script()
    phase = bench.Phase(system, workers, 32, 3, 20)
    phase.latencies_ms["epoch"] = [ms] * 100
    phase.wall_s = 100 / calls_per_s
    return phase


def floor_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if "bare" in line and "C=32" in line]


def test_floor_line_says_whether_the_bare_task_meets_the_p99_target(
    capsys: pytest.CaptureFixture[str],
) -> None:
    bench = load_script()
    zeus = made_up_phase("zeus", None, 100.0, 400.0)  # p99 target: <= 40 ms
    bso = made_up_phase("bso", 2, 260.0, 120.0)
    slow_bare = made_up_phase("bare", 2, 400.0, 80.0)
    bench.print_targets([zeus, bso, slow_bare], {})
    out = capsys.readouterr().out
    lines = out.splitlines()
    p99_line = next(i for i, line in enumerate(lines) if "epoch p99" in line)
    floor = lines[p99_line + 1]
    assert floor.startswith("  C=32, 2 workers: bare Celery task (one commit + one reply, ")
    assert "400.0 calls/s, p99 80.0 ms" in floor
    assert "the p99 target for bso is <= 40.0 ms (Zeus p99 400.0 ms x 0.1)" in floor
    assert "~800 calls/s" in floor  # 32 callers / 40 ms
    assert "even the bare task MISSES it" in floor
    assert "bso 2w there: 260.0 epoch reports/s = 0.65x" in lines[p99_line + 2]
    assert "epoch p99 120.0 ms = 1.50x the bare task's" in lines[p99_line + 2]

    fast_bare = made_up_phase("bare", 2, 2000.0, 15.0)
    bench.print_targets([zeus, bso, fast_bare], {})
    assert "the bare task meets it, so the target is above this floor" in capsys.readouterr().out

    # Without Zeus there is no target, but the floor is still printed.
    bench.print_targets([bso, slow_bare], {})
    (line,) = [x for x in floor_lines(capsys.readouterr().out) if "calls/s, p99" in x]
    assert line.endswith("no Zeus run, so no p99 target to hold it against")

    bench.print_targets([zeus, bso], {})
    assert floor_lines(capsys.readouterr().out) == [
        "  C=32, 2 workers: bare-task floor n/a (this run has no C=32 phase of bare 2w)"
    ]


def processes_mentioning(text: str) -> list[int]:
    """Our processes whose working directory, command line or environment mentions ``text``
    (not this one)."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        if int(entry.name) == os.getpid():
            continue
        try:
            seen = os.readlink(entry / "cwd").encode()
            seen += (entry / "cmdline").read_bytes() + (entry / "environ").read_bytes()
        except OSError:
            continue
        if text.encode() in seen:
            found.append(int(entry.name))
    return found


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
    assert "solo pool" in out.splitlines()[2]
    assert "bare task, interleaved with those rounds: 30 calls" in out
    rows = re.findall(r"^\| (bso|bare) 1w \| (\d+) \| (\d+) \| [\d.]+ \|", out, re.MULTILINE)
    # bso's rounds per job, then the bare phase's round trips per caller (rounds x 5 epochs).
    assert rows == [("bso", "1", "2"), ("bare", "1", "10"), ("bso", "4", "1"), ("bare", "4", "5")]
    # The bare phase at C=4: 4 callers x 5 round trips, every one answered.
    assert re.search(r"bare 1w\s+C=4\s+5 calls each: 20 calls in [\d.]+ s, [\d.]+ calls/s", out)
    # Its row: only the epoch column (its round trip) has latencies.
    none = r"- / - / -"
    bare_row = (
        rf"^\| bare 1w \| 4 \| 5 \| [\d.]+ \| {none} \| {none} \| [\d./ ]+ \| {none} \| - \|$"
    )
    assert re.search(bare_row, out, re.MULTILINE), out
    assert "client retries 0, errors 0, trials stopped early 0" in out
    assert "Targets (printed, not asserted):" in out
    # Every call of the C=4 phase was answered: 4 jobs x (register, next, 5 epochs, end).
    assert re.search(r"bso 1w\s+C=4\s+1 rounds: 32 calls", out), out
    assert "C=32, 2 workers: bare-task floor n/a" in out
    # Nothing left running from this work dir (Redis, bso's and the bare task's nodes).
    assert processes_mentioning(str(work)) == []
