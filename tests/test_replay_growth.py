"""Online batch growth replayed on traces: the progress-fraction model, costed as bso costs."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path

import pytest

from bso.cli import main
from bso.core.growth import BatchGrowth
from bso.replay.growth import compare_growth, grown_cost, grown_run
from bso.replay.traces import load_trace_workloads
from bso.replay.workloads import SizeProfile, Workload, synthetic_workloads

TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"
MAX_POWER = 250.0


def workload(
    runs: Mapping[int, tuple[int | None, ...]],
    profiles: Mapping[int, SizeProfile] | None = None,
    *,
    max_epochs: int = 20,
    gpu_count: int = 1,
) -> Workload:
    """A hand-made job; every size's epoch takes 10 s at 100 W unless ``profiles`` says."""
    return Workload(
        name="hand-made",
        default_batch_size=min(runs),
        target_metric=0.9,
        higher_is_better_metric=True,
        max_epochs=max_epochs,
        profiles=profiles or {b: SizeProfile(10.0, 100.0) for b in runs},
        runs=runs,
        gpu_model="Hand GPU",
        max_power_w=MAX_POWER,
        gpu_count=gpu_count,
    )


def zeus_cost(energy_j: float, time_s: float, eta: float, gpus: int = 1) -> float:
    """``eta * ETA + (1 - eta) * MaxPower * TTA``, written out again for the check."""
    return eta * energy_j + (1 - eta) * MAX_POWER * gpus * time_s


# Size 32: 10 s at 100 W an epoch, 4 epochs to target; size 64: 6 s at 150 W, 6 epochs.
HAND = workload(
    {32: (4,), 64: (6,)},
    {32: SizeProfile(10.0, 100.0), 64: SizeProfile(6.0, 150.0)},
)


def test_two_epochs_at_32_do_half_the_work_and_three_at_64_the_rest() -> None:
    run = grown_run(HAND, BatchGrowth(every_epochs=2, factor=2.0), 32)
    # 2 of 4 epochs at 32 (half the work), then half of 64's 6 epochs.
    assert run.reaches == "always"
    assert run.sizes == (32, 64)
    assert run.epochs == 5
    assert run.time_s == pytest.approx(2 * 10.0 + 3 * 6.0)  # 38 s
    assert run.energy_j == pytest.approx(2 * 10.0 * 100.0 + 3 * 6.0 * 150.0)  # 4,700 J
    assert grown_cost(HAND, run, 0.5) == pytest.approx(0.5 * 4700 + 0.5 * 250 * 38)  # 7,100 J


def test_the_comparison_against_the_best_fixed_size() -> None:
    c = compare_growth(HAND, BatchGrowth(every_epochs=2, factor=2.0), 0.5)
    fixed_32 = 4 * zeus_cost(10.0 * 100.0, 10.0, 0.5)  # 7,000 J
    fixed_64 = 6 * zeus_cost(6.0 * 150.0, 6.0, 0.5)  # 7,200 J
    assert c.best_fixed == 32
    assert c.best_fixed_cost == pytest.approx(fixed_32)
    assert [r.start for r in c.rows] == [32, 64]
    assert [r.fixed_cost for r in c.rows] == pytest.approx([fixed_32, fixed_64])
    # From 64 there is nothing to grow to: the grown run is the fixed run.
    assert [r.grown_cost for r in c.rows] == pytest.approx([7100.0, fixed_64])
    assert c.best_start == 32
    assert c.best_grown_cost == pytest.approx(7100.0)
    assert c.ratio == pytest.approx(7100.0 / fixed_32)
    assert not c.pays  # 7,100 J grown against 7,000 J for always 32


def test_growth_beats_a_poor_start_but_not_the_size_it_grows_to() -> None:
    # 64 is faster per epoch and needs no more epochs, but the schedule must start at 32.
    w = workload({32: (4,), 64: (4,)}, {32: SizeProfile(10.0, 100.0), 64: SizeProfile(5.0, 100.0)})
    c = compare_growth(w, BatchGrowth(every_epochs=1, factor=2.0), 0.5)
    (row_32, row_64) = c.rows
    assert row_32.run.epochs == 4  # 1 epoch at 32, 3 at 64
    assert row_32.run.time_s == pytest.approx(10.0 + 3 * 5.0)
    assert row_32.ratio == pytest.approx(25.0 / 40.0)
    assert row_32.grown_cost > row_64.grown_cost == row_64.fixed_cost
    assert (c.best_start, c.best_fixed) == (64, 64)
    assert not c.pays  # still dearer than always 64 (20 s): growth only averages sizes


def test_the_last_epoch_is_rounded_up_to_a_whole_one() -> None:
    w = workload({32: (4,), 64: (5,)}, {32: SizeProfile(10.0, 100.0), 64: SizeProfile(6.0, 150.0)})
    run = grown_run(w, BatchGrowth(every_epochs=2, factor=2.0), 32)
    # Half the work left at a size that needs 5 epochs: 2.5, so 3 whole epochs.
    assert run.epochs == 5
    assert run.time_s == pytest.approx(2 * 10.0 + 3 * 6.0)


def test_work_that_adds_up_to_exactly_the_target_is_not_an_epoch_off() -> None:
    # Half the work at 8, a third at 16: exactly one epoch of 32's six is left.  In
    # floats, (1 - (1/2 + 1/3)) * 6 comes to 1.0000000000000004, which rounds up to 2.
    w = workload({8: (2,), 16: (3,), 32: (6,)})
    run = grown_run(w, BatchGrowth(every_epochs=1, factor=2.0), 8)
    assert run.sizes == (8, 16, 32)
    assert run.epochs == 3


@pytest.mark.parametrize("growth", [BatchGrowth(1, 1.5), BatchGrowth(1, 4.0, max_batch_size=16)])
def test_a_schedule_that_never_grows_costs_what_the_fixed_size_costs(growth: BatchGrowth) -> None:
    # Neighbouring sizes are 2x apart: a 1.5x factor finds none, nor a cap at the smallest.
    w = workload(
        {16: (5, 7, 6, 9), 32: (4, 4, 8), 64: (11, 3)},
        {16: SizeProfile(9.0, 80.0), 32: SizeProfile(5.0, 120.0), 64: SizeProfile(3.0, 170.0)},
        gpu_count=2,
    )
    for eta in (0.0, 0.3, 1.0):
        c = compare_growth(w, growth, eta)
        for row in c.rows:
            assert row.run.sizes == (row.start,)
            needed = [e for e in w.runs[row.start] if e is not None]
            assert row.run.epochs == pytest.approx(sum(needed) / len(needed))
            assert row.grown_cost == pytest.approx(row.fixed_cost)
            assert row.ratio == pytest.approx(1.0)
        assert c.best_grown_cost == pytest.approx(c.best_fixed_cost)
        assert c.best_start == c.best_fixed
        assert not c.pays  # equal, to rounding, is not paying


def test_expected_cost_averages_over_the_recorded_runs_of_each_size() -> None:
    # 32 needs 2 or 4 epochs: after 1 epoch, a half or a quarter of the work is done,
    # and 64 (6 epochs) needs 3 or ceil(4.5) = 5 more: 4 or 6 epochs in all.
    w = workload(
        {32: (2, 4), 64: (6,)}, {32: SizeProfile(10.0, 100.0), 64: SizeProfile(6.0, 150.0)}
    )
    run = grown_run(w, BatchGrowth(every_epochs=1, factor=2.0), 32)
    assert run.epochs == pytest.approx(5.0)
    assert run.time_s == pytest.approx(10.0 + 4 * 6.0)
    assert run.energy_j == pytest.approx(10.0 * 100.0 + 4 * 6.0 * 150.0)
    assert run.sizes == (32, 64)


def test_a_size_that_never_converges_makes_no_progress() -> None:
    w = workload({16: (None, None), 32: (4,)}, max_epochs=8)
    growth = BatchGrowth(every_epochs=2, factor=2.0)
    run = grown_run(w, growth, 16)
    # Two epochs at 16 do nothing; the four at 32 do it all.
    assert run.reaches == "always"
    assert run.epochs == 6
    assert run.time_s == pytest.approx(60.0)
    row_16 = compare_growth(w, growth, 0.5).rows[0]
    assert row_16.fixed_cost == math.inf  # always 16 never gets there
    assert row_16.grown_cost == pytest.approx(zeus_cost(6 * 10.0 * 100.0, 60.0, 0.5))
    assert math.isnan(row_16.ratio)  # no fixed cost to compare with
    # With two epochs fewer to spare, the run that lost two at 16 fails.
    tight = workload({16: (None, None), 32: (4,)}, max_epochs=5)
    assert grown_run(tight, growth, 16).reaches == "never"
    assert grown_run(tight, growth, 32).reaches == "always"


def test_growing_into_a_size_that_never_converges_fails() -> None:
    w = workload({32: (4,), 64: (None,)})
    c = compare_growth(w, BatchGrowth(every_epochs=1, factor=2.0), 0.5)
    row_32 = c.rows[0]
    assert row_32.run.reaches == "never"
    assert row_32.run.epochs is None
    assert row_32.grown_cost == math.inf
    assert row_32.ratio == math.inf
    assert c.best_grown_cost == math.inf
    assert not c.pays
    assert c.to_dict()["rows"][0]["grown_cost"] is None  # JSON has no inf


def test_a_start_whose_draws_sometimes_fail_costs_inf() -> None:
    w = workload({32: (4,), 64: (6, None)})
    run = grown_run(w, BatchGrowth(every_epochs=2, factor=2.0), 32)
    assert run.reaches == "sometimes"
    assert grown_cost(w, run, 0.5) == math.inf
    # Within 5 epochs: 2 at 32, then 3 more at 64 if it needs 6, but 4 (3.5) if it needs 7.
    late = workload({32: (4,), 64: (6, 7)}, max_epochs=5)
    assert grown_run(late, BatchGrowth(every_epochs=2, factor=2.0), 32).reaches == "sometimes"
    later = workload({32: (4,), 64: (6, 7)}, max_epochs=4)
    assert grown_run(later, BatchGrowth(every_epochs=2, factor=2.0), 32).reaches == "never"


def test_a_grown_run_costs_no_less_than_the_cheapest_size_it_visits() -> None:
    """Under the model, each unit of work at b costs what a whole fixed run of b costs."""
    grown = 0
    for synthetic in synthetic_workloads():
        one_run = {b: runs[1:2] for b, runs in synthetic.runs.items()}  # no luck of the draw
        w = workload(one_run, synthetic.profiles, max_epochs=synthetic.max_epochs // 2)
        for growth in (BatchGrowth(1, 2.0), BatchGrowth(3, 2.0), BatchGrowth(2, 4.0)):
            for row in compare_growth(w, growth, 0.5).rows:
                if row.run.reaches != "always":
                    continue
                # What a whole run of each size costs, past max_epochs or not.
                whole = [
                    e * w.epoch_cost(b, 0.5)
                    for b in row.run.sizes
                    for e in w.runs[b]
                    if e is not None
                ]
                assert row.grown_cost >= min(whole) * (1 - 1e-12), (synthetic.name, growth, row)
                grown += len(row.run.sizes) > 1
    assert grown > 10  # the check saw runs that grew


# -- bso simulate --growth --------------------------------------------------------------


@pytest.fixture(scope="module")
def trace_workloads() -> list[Workload]:
    if not (TRACES / "summary_train.csv").is_file():
        pytest.fail(f"Zeus's traces are missing: expected them in {TRACES}")
    return load_trace_workloads(TRACES)


def test_simulate_growth_prints_a_row_per_size_on_the_traces(
    trace_workloads: list[Workload], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["simulate", "--traces", str(TRACES), "--growth", "2:2"]) == 0
    out = capsys.readouterr().out
    sections = out.split("\n== ")[1:]
    assert [s.split()[0] for s in sections] == [w.name for w in trace_workloads]
    for section, w in zip(sections, trace_workloads, strict=True):
        assert section.startswith(f"{w.name} (eta=0.5) growth every 2 epochs by up to 2x\n")
        lines = section.splitlines()
        rows = [line.split() for line in lines if line.split()[:1] and line.split()[0].isdigit()]
        assert [int(r[0]) for r in rows] == w.batch_sizes
        for r in rows:
            fixed = w.expected_cost(int(r[0]), 0.5)
            assert r[1] == ("inf" if math.isinf(fixed) else f"{fixed / 1e6:.5g}")
        assert rows[-1][2] == rows[-1][1]  # nothing to grow to from the largest size
        (summary,) = [line for line in lines if line.startswith(f"{w.name}: growth ")]
        oracle, oracle_cost = w.oracle(0.5)
        assert f"best fixed {oracle_cost / 1e6:.5g} MJ (size {oracle})" in summary


def test_simulate_growth_json(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "--workload", "synthetic-language", "--growth", "1:2", "--growth", "3:4:32"]
    assert main([*argv, "--eta", "0.2", "--json"]) == 0
    (w,) = [w for w in synthetic_workloads() if w.name == "synthetic-language"]
    first, second = json.loads(capsys.readouterr().out)["growth"]
    assert first["growth"] == {"every_epochs": 1, "factor": 2.0, "max_batch_size": None}
    assert second["growth"] == {"every_epochs": 3, "factor": 4.0, "max_batch_size": 32}
    for data, growth in ((first, BatchGrowth(1, 2.0)), (second, BatchGrowth(3, 4.0, 32))):
        expected = compare_growth(w, growth, 0.2)
        assert data["eta_knob"] == 0.2
        assert [r["start"] for r in data["rows"]] == w.batch_sizes
        assert data["best_fixed"] == {"batch_size": w.oracle(0.2)[0], "cost": w.oracle(0.2)[1]}
        assert data["best_grown"]["cost"] == pytest.approx(expected.best_grown_cost)
        assert data["pays"] == expected.pays
        smallest = data["rows"][0]  # never converges at a fixed size
        assert smallest["fixed_cost"] is None
        assert smallest["ratio"] is None


@pytest.mark.parametrize("value", ["2", "2:1", "0:2", "1:2:0", "x:2", "1:nan", "1:2:3:4"])
def test_bad_growth_exits_2(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["simulate", "--growth", value])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --growth" in err
    assert repr(value) in err


def test_growth_refuses_a_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--growth", "1:2", "--plot", str(tmp_path / "p.png")]) == 2
    assert "--plot" in capsys.readouterr().err
    assert not (tmp_path / "p.png").exists()


def test_the_best_start_under_growth_need_not_be_the_best_fixed_size() -> None:
    # Equal power, so cost goes with time.  Fixed: 16 takes 2 x 10 s, 32 takes 4 x 4 s (the
    # best), 64 takes 10 x 10 s.  Growing every epoch from 16: 10 s (half the work), 4 s at
    # 32 (a quarter), then ceil(10 / 4) = 3 epochs at 64: 44 s.  From 32: 4 s (a quarter),
    # then ceil(7.5) = 8 epochs at 64: 84 s.  From 64: 100 s.
    w = workload(
        {16: (2,), 32: (4,), 64: (10,)},
        {16: SizeProfile(10.0, 100.0), 32: SizeProfile(4.0, 100.0), 64: SizeProfile(10.0, 100.0)},
    )
    c = compare_growth(w, BatchGrowth(every_epochs=1, factor=2.0), 0.5)
    per_second = zeus_cost(100.0, 1.0, 0.5)
    assert [r.run.time_s for r in c.rows] == pytest.approx([44.0, 84.0, 100.0])
    assert c.best_fixed == 32
    assert c.best_start == 16
    assert c.best_grown_cost == pytest.approx(44.0 * per_second)
    assert c.ratio == pytest.approx(44.0 / 16.0)
