"""Frozen snapshots: trial predicates and the job-level cost bookkeeping."""

from __future__ import annotations

import dataclasses

import pytest

from bso.core.cost import cost
from bso.core.state import JobSnapshot, TrialSnapshot
from bso.core.vocabulary import StopReason, TrialPhase, TrialStatus
from bso.spec import Hardware, JobSpec

SPEC = JobSpec(
    job_id="job",
    batch_sizes=[32, 64, 128],
    default_batch_size=64,
    target_metric=0.9,
    eta_knob=0.25,
    hardware=Hardware(gpu_model="V100", gpu_count=1, max_power_w=250.0),
)


def trial(
    number: int,
    size: int,
    status: TrialStatus = TrialStatus.CONVERGED,
    *,
    cost: float = 0.0,
    reason: StopReason | None = None,
    phase: TrialPhase = TrialPhase.EXPLORATION,
) -> TrialSnapshot:
    return TrialSnapshot(number, size, phase, status=status, cost=cost, stop_reason=reason)


def test_trial_predicates() -> None:
    running = trial(1, 64, TrialStatus.RUNNING)
    converged = trial(2, 64, TrialStatus.CONVERGED, reason=StopReason.TARGET_REACHED)
    assert running.running
    assert not running.converged
    assert not running.failed
    assert converged.converged
    assert not converged.running


def test_a_fresh_trial_is_running_with_nothing_spent() -> None:
    fresh = TrialSnapshot(1, 64, TrialPhase.EXPLORATION)
    assert fresh.running
    assert (fresh.epochs, fresh.time_s, fresh.energy_j, fresh.cost) == (0, 0.0, 0.0, 0.0)


def test_snapshots_are_frozen() -> None:
    snap = trial(1, 64)
    with pytest.raises(dataclasses.FrozenInstanceError):
        snap.cost = 3.0  # type: ignore[misc]


def test_empty_job_has_no_costs() -> None:
    job = JobSnapshot(SPEC, SPEC.hardware)
    assert job.min_cost is None
    assert job.best_mean_cost is None
    assert job.mean_costs() == {}
    assert job.best_batch_size() is None
    assert job.converged_costs() == []


def test_costs_only_count_converged_trials() -> None:
    job = JobSnapshot(
        SPEC,
        SPEC.hardware,
        (
            trial(1, 64, cost=100.0),
            trial(2, 32, TrialStatus.FAILED, cost=10.0, reason=StopReason.COST_BOUND),
            trial(3, 64, cost=140.0),
            trial(4, 128, cost=110.0),
            trial(5, 32, TrialStatus.RUNNING, cost=1.0),
        ),
    )
    assert job.converged_costs() == [100.0, 140.0, 110.0]
    assert job.converged_costs(64) == [100.0, 140.0]
    assert job.converged_costs(32) == []
    assert job.min_cost == 100.0
    assert job.best_mean_cost == pytest.approx(110.0)  # 128's mean, below 64's 120
    assert job.mean_costs() == {64: pytest.approx(120.0), 128: pytest.approx(110.0)}
    # Best by mean, not by single best run.
    assert job.best_batch_size() == 128


def test_best_size_ties_go_to_the_smaller_size() -> None:
    job = JobSnapshot(SPEC, SPEC.hardware, (trial(1, 128, cost=50.0), trial(2, 32, cost=50.0)))
    assert job.best_batch_size() == 32


def test_snapshot_cost_uses_the_lanes_hardware() -> None:
    a100 = Hardware(gpu_model="A100", gpu_count=8, max_power_w=400.0)
    job = JobSnapshot(SPEC, a100)
    assert job.max_power_w == 3200.0
    assert job.cost(1000.0, 10.0) == pytest.approx(0.25 * 1000.0 + 0.75 * 3200.0 * 10.0)
    own = JobSnapshot(SPEC, SPEC.hardware)
    power = SPEC.hardware.total_max_power_w
    assert own.cost(1000.0, 10.0) == pytest.approx(cost(1000.0, 10.0, SPEC.eta_knob, power))


def test_rng_state_does_not_affect_equality() -> None:
    a = JobSnapshot(SPEC, SPEC.hardware, rng_state={"state": 1})
    b = JobSnapshot(SPEC, SPEC.hardware, rng_state={"state": 2})
    assert a == b
