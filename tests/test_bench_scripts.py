"""The decision benchmarks run as their docstrings say and print what docs/benchmarks.md
quotes: the budget columns of ``scripts/bench_decisions.py`` and the lane pairs of
``scripts/bench_transfer.py`` (tiny replays: the figures themselves come from the
full runs the docs name)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_script(name: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / name), *args],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_bench_decisions_prints_a_column_and_a_worst_world_per_budget() -> None:
    out = run_script(
        "bench_decisions.py", "--landscapes", "--workloads", "default-optimal-0",
        "--etas", "0.5", "--seeds", "1", "--recurrences", "6", "--budgets", "0.02,0.05",
    )  # fmt: skip
    lines = out.splitlines()
    header = next(line for line in lines if line.startswith("workload"))
    assert header.split()[2:7] == ["default", "walk-floor", "bso", "bso@0.02", "bso@0.05"]
    (row,) = [line for line in lines if line.startswith("default-optimal-0")]
    assert float(row.split()[2]) >= 1.0  # always-default over the oracle
    for budget in ("0.02", "0.05"):
        (worst,) = [line for line in lines if line.startswith(f"bso@{budget}: worst world ")]
        assert worst.endswith("(default-optimal-0 eta 0.5 seed 1)")
        (worst,) = [line for line in lines if line.startswith(f"bso@{budget}: worst workload ")]
        assert worst.endswith("(default-optimal-0 eta 0.5)")


def test_bench_transfer_prints_every_pair_and_the_means() -> None:
    out = run_script(
        "bench_transfer.py", "--landscapes", "--workloads", "default-optimal-0",
        "--seeds", "1", "--recurrences", "6",
    )  # fmt: skip
    lines = out.splitlines()
    pairs = [line for line in lines if line.startswith("default-optimal-0")]
    assert len(pairs) == 4  # one per second GPU of bso.replay.lanes.TILTS
    for line in pairs:
        cold, transferred, ratio = (float(v) for v in line.split()[-3:])
        assert cold > -1.0
        assert transferred > -1.0  # costs are positive: excess over the oracle above -1
        assert ratio > 0
    assert any(line.startswith("geometric mean excess: cold ") for line in lines)
    assert any(line.startswith("worst world: transferred costs ") for line in lines)
    (worst,) = [line for line in lines if line.startswith("worst pair (its worlds summed): ")]
    ratio = float(worst.split("transferred costs ")[1].split("x cold")[0])
    worst_line = max(float(line.split()[-1]) for line in pairs)
    assert ratio == pytest.approx(worst_line, abs=0.0015)  # one seed: the pair is its world
    over, total = worst.rsplit(": ", 1)[1].split(" of ")
    assert total == "4"  # one pair per second GPU
    assert int(over) == sum(float(line.split()[-1]) > 1.01 for line in pairs)


def test_bench_decisions_prints_lane_b_cold_and_transferred() -> None:
    out = run_script(
        "bench_decisions.py", "--landscapes", "--workloads", "edge-small-0",
        "--etas", "0.5", "--seeds", "1", "--recurrences", "6", "--transfer",
    )  # fmt: skip
    lines = out.splitlines()
    header = next(line for line in lines if line.startswith("workload")).split()
    assert header[5:7] == ["B-cold", "B-transfer"]
    (row,) = [line for line in lines if line.startswith("edge-small-0")]
    cold, transferred = (float(v) for v in row.split()[5:7])
    assert cold >= 1.0  # lane B's cost over its own oracle's
    assert transferred >= 1.0


def test_bench_micro_batch_times_every_micro_batch_and_grades_the_picks() -> None:
    out = run_script(
        "bench_micro_batch.py", "--global-batch", "8", "--steps", "1", "--repeats", "2",
        "--budget", "8", "--models", "mlp", "--threads", "1",
    )  # fmt: skip
    lines = out.splitlines()
    start = lines.index("mlp: exhaustive, 1 steps each (median ms per sample)")
    table = lines[start + 1 : start + 5]
    assert [int(line.split()[0]) for line in table] == [8, 4, 2, 1]
    assert sum(line.endswith("fastest") for line in table) == 1
    repeats = [line for line in lines if line.startswith("  repeat ")]
    assert len(repeats) == 2
    for line in repeats:
        share = float(line.rsplit(" of the fastest", 1)[0].rsplit(" ", 1)[1].rstrip("%"))
        assert 0 < share <= 100
    assert lines[-1].startswith("mlp: worst pick ")


def test_gpu_recurring_job_runs_both_arms_and_compares_their_cumulative_cost(
    tmp_path: Path,
) -> None:
    """Issue 25's real-hardware check, tiny and on the CPU (time only): the probe's
    candidates, a line per run of each arm, and the comparison, also as JSON."""
    out = run_script(
        "gpu_recurring_job.py", "--recurrences", "2", "--default-runs", "1",
        "--samples", "4096", "--target", "0.5", "--max-epochs", "3",
        "--json", str(tmp_path / "found.json"),
    )  # fmt: skip
    found = json.loads((tmp_path / "found.json").read_text())
    assert out.splitlines()[0].startswith(
        f"device cpu; candidates the probe made: {found['candidates']}"
    )
    assert [len(found["runs"][arm]) for arm in ("bso", "always-default")] == [2, 1]
    assert all(
        r["batch_size"] == found["default_batch_size"] for r in found["runs"]["always-default"]
    )
    bso_total = sum(r["cost"] for r in found["runs"]["bso"])
    default_total = 2 * found["runs"]["always-default"][0]["cost"]
    assert found["ratio"] == pytest.approx(bso_total / default_total)
    assert found["energy_measured"] is False
    assert out.splitlines()[-1].endswith("(time only: no energy measured)")


def test_bench_flood_measures_a_quiet_tenant_idle_and_under_another_tenants_flood(
    tmp_path: Path,
) -> None:
    """Issue 27's flood, tiny: both rows printed, the backlog draining, also as JSON."""
    out = run_script(
        "bench_flood.py", "--items", "3000", "--calls", "20", "--seconds", "3",
        "--json", str(tmp_path / "flood.json"),
    )  # fmt: skip
    found = json.loads((tmp_path / "flood.json").read_text())
    assert found["idle"]["calls"] == 20
    assert found["flooded"]["calls"] > 0
    assert 0 < found["backlog_at_start"] <= 3000
    assert found["backlog_at_end"] < found["backlog_at_start"]
    lines = out.splitlines()
    assert lines[0] == (
        f"2 worker nodes; the loud tenant pushed 3000 status reads onto its own queue in "
        f"{found['push_s']:.1f} s"
    )
    assert lines[2].startswith(f"quiet tenant, under the flood: {found['flooded']['calls']} calls")
