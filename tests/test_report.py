"""Text, JSON and PNG output of ``bso simulate``."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import pytest

from bso.replay.report import (
    geometric_mean,
    learning_policies,
    plot,
    to_json,
    write_recurrences,
    write_summary,
)
from bso.replay.simulate import Comparison, RecurrenceResult, ReplayResult, compare
from bso.replay.workloads import synthetic_workloads

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def rec(index: int, sizes: list[int], cost: float, converged: bool = True) -> RecurrenceResult:
    return RecurrenceResult(
        index,
        sizes=sizes,
        time_s=3600.0 * len(sizes),
        energy_j=1e6 * len(sizes),
        cost=cost,
        converged=converged,
        recommendation=sizes[-1] if converged else None,
        confidence=75 if converged else None,
    )


def handmade(workload: str = "toy", scale: float = 1.0) -> Comparison:
    """Oracle pays 10 per recurrence, default 20, bso 30 then 10, zeus 40 then 20."""

    def result(policy: str, recs: list[RecurrenceResult]) -> ReplayResult:
        return ReplayResult(workload, policy, 0.5, 2.0, recs)

    return Comparison(
        workload,
        0.5,
        64,
        {
            "oracle": result("oracle", [rec(0, [64], 10e6), rec(1, [64], 10e6)]),
            "default": result("default", [rec(0, [128], 20e6), rec(1, [128], 20e6)]),
            "bso": result("bso", [rec(0, [128, 32], 30e6), rec(1, [64], 10e6)]),
            "zeus": result(
                "zeus", [rec(0, [128, 16], 40e6 * scale, converged=False), rec(1, [64], 20e6)]
            ),
        },
    )


def test_geometric_mean() -> None:
    assert geometric_mean([1.0, 4.0]) == pytest.approx(2.0)
    assert geometric_mean([3.0]) == pytest.approx(3.0)
    assert geometric_mean([2.0, 2.0, 2.0]) == pytest.approx(2.0)
    assert math.isnan(geometric_mean([]))


def test_learning_policies_are_the_non_baselines() -> None:
    assert learning_policies(handmade()) == ["bso", "zeus"]


def test_per_recurrence_table() -> None:
    out = io.StringIO()
    write_recurrences(handmade(), "bso", out)
    lines = out.getvalue().strip().splitlines()
    assert "toy" in lines[0]
    assert "policy=bso" in lines[0]
    assert "oracle size=64" in lines[0]
    header = lines[1].split()
    assert header[0] == "rec"
    assert "cum/oracle" in header
    assert "cum/default" in header
    rows = lines[2:]
    assert len(rows) == 2
    first, second = (r.split() for r in rows)
    assert first[0] == "1"
    assert first[1] == "128,32"
    assert first[2] == "2"  # tries
    assert second[0] == "2"
    # Running totals: bso 40 vs oracle 20 and default 40 after two recurrences.
    assert first[6:8] == ["3.000", "1.500"]
    assert second[6:8] == ["2.000", "1.000"]
    assert "64 (75)" in rows[1]


def test_failed_recurrences_are_marked() -> None:
    out = io.StringIO()
    write_recurrences(handmade(), "zeus", out)
    rows = out.getvalue().strip().splitlines()[2:]
    assert "(failed)" in rows[0]
    assert "(failed)" not in rows[1]
    assert rows[0].rstrip().endswith("-")  # no recommendation to show


def test_summary_with_geometric_mean() -> None:
    out = io.StringIO()
    write_summary([handmade("a"), handmade("b", scale=2.0)], out)
    text = out.getvalue()
    assert "Cumulative cost / oracle's" in text
    lines = text.strip().splitlines()
    header = lines[1].split()
    assert header[-3:] == ["default", "bso", "zeus"]
    a = lines[2].split()
    b = lines[3].split()
    assert a[0] == "a"
    assert b[0] == "b"
    assert a[-3:] == ["2.000", "2.000", "3.000"]
    assert b[-3:] == ["2.000", "2.000", "5.000"]
    mean = lines[4]
    assert mean.startswith("geometric mean")
    assert mean.split()[-3:] == ["2.000", "2.000", f"{math.sqrt(15.0):.3f}"]


def test_summary_of_nothing_writes_nothing() -> None:
    out = io.StringIO()
    write_summary([], out)
    assert out.getvalue() == ""


def test_json_report() -> None:
    data = json.loads(json.dumps(to_json([handmade("a"), handmade("b", scale=2.0)])))
    assert [c["workload"] for c in data["comparisons"]] == ["a", "b"]
    first = data["comparisons"][0]
    assert first["oracle_batch_size"] == 64
    assert first["ratio_to_oracle"] == {"oracle": 1.0, "default": 2.0, "bso": 2.0, "zeus": 3.0}
    assert first["ratio_to_default"]["default"] == 1.0
    assert first["ratio_to_default"]["zeus"] == pytest.approx(1.5)
    assert first["results"]["bso"]["total_cost"] == pytest.approx(40e6)
    assert len(first["results"]["bso"]["recurrences"]) == 2
    means = data["geometric_mean_ratio_to_oracle"]
    assert set(means) == {"default", "bso", "zeus"}
    assert means["zeus"] == pytest.approx(math.sqrt(15.0))


def test_report_of_a_real_replay() -> None:
    workload = synthetic_workloads()[1]
    comparison = compare(workload, ["zeus"], eta_knob=0.5, beta_knob=2.0, recurrences=3, seed=1)
    out = io.StringIO()
    write_recurrences(comparison, "zeus", out)
    write_summary([comparison], out)
    assert out.getvalue().count("\n") >= 2 + 3 + 4
    data = to_json([comparison])
    assert data["comparisons"][0]["ratio_to_oracle"]["oracle"] == 1.0


def test_plot_writes_a_png(tmp_path: Path) -> None:
    path = tmp_path / "replay.png"
    plot([handmade("a"), handmade("b")], path)
    blob = path.read_bytes()
    assert blob.startswith(PNG_SIGNATURE)
    assert len(blob) > 10_000
