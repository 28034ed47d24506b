"""Workloads: epoch-by-epoch reports, expected costs, the oracle, synthetic jobs."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from bso.core.cost import cost
from bso.core.policy import metric_reached
from bso.core.state import JobSnapshot
from bso.replay.workloads import SizeProfile, Workload, synthetic_workloads
from bso.spec import Hardware


def toy(higher_is_better: bool = True, gpu_count: int = 2) -> Workload:
    return Workload(
        name="toy",
        default_batch_size=64,
        target_metric=0.8 if higher_is_better else 30.0,
        higher_is_better_metric=higher_is_better,
        max_epochs=10,
        profiles={
            128: SizeProfile(epoch_time_s=5.0, avg_power_w=200.0),
            32: SizeProfile(epoch_time_s=20.0, avg_power_w=100.0),
            64: SizeProfile(epoch_time_s=10.0, avg_power_w=150.0),
        },
        runs={32: (3, 4), 64: (4, 6, 5), 128: (8, None)},
        gpu_model="Toy GPU",
        max_power_w=300.0,
        gpu_count=gpu_count,
    )


def test_sizes_and_hardware() -> None:
    w = toy()
    assert w.batch_sizes == [32, 64, 128]
    assert w.hardware == Hardware(gpu_model="Toy GPU", gpu_count=2, max_power_w=300.0)


def test_job_spec_describes_the_workload() -> None:
    w = toy(higher_is_better=False)
    spec = w.job_spec(job_id="toy-1", eta_knob=0.3, beta_knob=None, seed=9, policy="zeus")
    assert spec.job_id == "toy-1"
    assert spec.batch_sizes == [32, 64, 128]
    assert spec.default_batch_size == 64
    assert spec.target_metric == 30.0
    assert spec.higher_is_better_metric is False
    assert spec.max_epochs == 10
    assert (spec.eta_knob, spec.beta_knob, spec.mab_seed, spec.policy) == (0.3, None, 9, "zeus")
    assert spec.hardware == w.hardware
    assert w.job_spec(job_id="toy-2", num_pruning_rounds=3).num_pruning_rounds == 3


@pytest.mark.parametrize("higher_is_better", [True, False])
def test_metric_reaches_the_target_exactly_at_the_drawn_epoch(higher_is_better: bool) -> None:
    w = toy(higher_is_better)
    snapshot = JobSnapshot(w.job_spec(job_id="toy"), w.hardware)
    reports = list(w.epoch_reports(64, 4))
    assert [r.epoch for r in reports] == list(range(1, 11))
    reached = [metric_reached(snapshot, r.metric) for r in reports]
    assert reached == [False, False, False, True, True, True, True, True, True, True]
    assert reports[3].metric == w.target_metric
    for r in reports[:3]:
        assert (r.metric < w.target_metric) is higher_is_better


def test_a_run_that_never_converges_reports_every_epoch_short_of_the_target() -> None:
    w = toy()
    snapshot = JobSnapshot(w.job_spec(job_id="toy"), w.hardware)
    reports = list(w.epoch_reports(128, None))
    assert len(reports) == w.max_epochs
    assert not any(metric_reached(snapshot, r.metric) for r in reports)


def test_reports_are_cumulative_over_all_gpus() -> None:
    w = toy(gpu_count=2)
    reports = list(w.epoch_reports(64, 5))
    for r in reports:
        assert r.time_s == pytest.approx(10.0 * r.epoch)
        assert r.energy_j == pytest.approx(10.0 * r.epoch * 150.0 * 2)
    times = [r.time_s for r in reports]
    assert times == sorted(times)


def test_epoch_cost_uses_the_cost_formula() -> None:
    w = toy(gpu_count=2)
    energy, time = 10.0 * 150.0 * 2, 10.0
    assert w.epoch_cost(64, 0.4) == pytest.approx(0.4 * energy + 0.6 * 300.0 * 2 * time)
    spec = w.job_spec(job_id="toy", eta_knob=0.4)
    power = spec.hardware.total_max_power_w
    assert w.epoch_cost(64, 0.4) == pytest.approx(cost(energy, time, spec.eta_knob, power))


def test_expected_cost_and_oracle() -> None:
    w = toy()
    assert w.expected_cost(64, 0.5) == pytest.approx(5.0 * w.epoch_cost(64, 0.5))
    assert w.expected_cost(32, 0.5) == pytest.approx(3.5 * w.epoch_cost(32, 0.5))
    assert w.expected_cost(128, 0.5) == math.inf  # one recorded run never converged
    best, best_cost = w.oracle(0.5)
    assert best_cost == min(w.expected_cost(b, 0.5) for b in w.batch_sizes)
    assert best_cost == w.expected_cost(best, 0.5)


def test_runs_beyond_max_epochs_make_a_size_infeasible() -> None:
    w = toy()
    late = dataclasses.replace(w, runs={**w.runs, 32: (3, 11)})
    assert late.expected_cost(32, 0.5) == math.inf


def test_draw_epochs_picks_recorded_runs() -> None:
    w = toy()
    rng = np.random.default_rng(3)
    draws = [w.draw_epochs(64, rng) for _ in range(200)]
    assert set(draws) == {4, 5, 6}
    again = np.random.default_rng(3)
    assert [w.draw_epochs(64, again) for _ in range(200)] == draws


# -- synthetic workloads ----------------------------------------------------------------


def test_synthetic_workloads_are_deterministic() -> None:
    assert synthetic_workloads() == synthetic_workloads()
    assert synthetic_workloads(seed=3) == synthetic_workloads(seed=3)
    assert [w.runs for w in synthetic_workloads(seed=3)] != [w.runs for w in synthetic_workloads()]


def test_synthetic_workloads_are_sane() -> None:
    workloads = synthetic_workloads()
    assert len({w.name for w in workloads}) == len(workloads) >= 3
    for w in workloads:
        assert w.default_batch_size in w.batch_sizes
        assert set(w.runs) == set(w.profiles)
        smallest = w.batch_sizes[0]
        assert all(e is None for e in w.runs[smallest]), w.name
        assert w.expected_cost(smallest, 0.5) == math.inf
        for eta in (0.0, 0.5, 1.0):
            best, cost = w.oracle(eta)
            assert math.isfinite(cost)
            assert cost > 0
            assert best != smallest
        for b, runs in w.runs.items():
            assert len(runs) == 8
            assert all(e is None or 1 <= e <= w.max_epochs for e in runs), (w.name, b)
        for p in w.profiles.values():
            assert p.epoch_time_s > 0
            assert 0 < p.avg_power_w <= w.max_power_w


def test_synthetic_runs_per_size() -> None:
    for w in synthetic_workloads(runs_per_size=3):
        assert all(len(r) == 3 for r in w.runs.values())
