"""The stop rules every policy shares (bso/core/policy.py), and the test helpers.

Target reached, max_epochs and the beta_knob cost bound, checked on every
registered policy or on ZeusPolicy, which adds no stop rule of its own; the
helpers here (make_spec, finished, snapshot) serve test_zeus_policy.py too.
"""

from __future__ import annotations

import pytest

from bso.core.policies import POLICIES
from bso.core.policy import Policy
from bso.core.state import JobSnapshot, TrialSnapshot
from bso.core.vocabulary import StopReason, TrialPhase, TrialStatus
from bso.core.zeus_policy import ZeusPolicy
from bso.spec import Hardware, JobSpec

ZEUS = ZeusPolicy()
EXPLORE = TrialPhase.EXPLORATION


def make_spec(sizes: list[int] | None = None, default: int = 64, **changes: object) -> JobSpec:
    fields: dict[str, object] = {
        "job_id": "job",
        "batch_sizes": sizes or [8, 16, 32, 64, 128, 256],
        "default_batch_size": default,
        "target_metric": 0.9,
        "policy": "zeus",
        "hardware": Hardware(gpu_model="V100", max_power_w=250.0),
    }
    fields.update(changes)
    return JobSpec.model_validate(fields)


def finished(
    number: int,
    size: int,
    cost: float | None,
    phase: TrialPhase = EXPLORE,
    epochs: int = 5,
) -> TrialSnapshot:
    """A converged trial of ``cost``, or a failed one (beta bound) when cost is None."""
    if cost is None:
        return TrialSnapshot(
            number,
            size,
            phase,
            status=TrialStatus.FAILED,
            epochs=epochs,
            cost=1.0,
            stop_reason=StopReason.COST_BOUND,
        )
    return TrialSnapshot(
        number,
        size,
        phase,
        status=TrialStatus.CONVERGED,
        epochs=epochs,
        cost=cost,
        stop_reason=StopReason.TARGET_REACHED,
    )


def snapshot(spec: JobSpec, trials: list[TrialSnapshot]) -> JobSnapshot:
    return JobSnapshot(spec, spec.hardware, tuple(trials))


# -- shared stop rules ------------------------------------------------------------------

STOP_POLICIES = sorted(POLICIES)


def running(epochs: int, cost: float = 10.0, size: int = 64) -> TrialSnapshot:
    return TrialSnapshot(
        99, size, EXPLORE, epochs=epochs, time_s=epochs * 1.0, energy_j=epochs * 5.0, cost=cost
    )


@pytest.mark.parametrize("name", STOP_POLICIES)
def test_target_reached_higher_is_better(name: str) -> None:
    policy: Policy = POLICIES[name]
    spec = make_spec(target_metric=0.9, higher_is_better_metric=True, policy=name)
    for metric in (0.9, 0.95):
        verdict = policy.on_epoch(snapshot(spec, []), running(3), metric)
        assert (verdict.stop, verdict.converged, verdict.reason) == (
            True,
            True,
            StopReason.TARGET_REACHED,
        )


@pytest.mark.parametrize("name", STOP_POLICIES)
def test_target_reached_lower_is_better(name: str) -> None:
    policy: Policy = POLICIES[name]
    spec = make_spec(target_metric=40.0, higher_is_better_metric=False, policy=name)
    for metric in (40.0, 12.5):
        verdict = policy.on_epoch(snapshot(spec, []), running(3), metric)
        assert (verdict.stop, verdict.converged, verdict.reason) == (
            True,
            True,
            StopReason.TARGET_REACHED,
        )


def test_metric_short_of_target_continues() -> None:
    higher = make_spec(target_metric=0.9, higher_is_better_metric=True)
    lower = make_spec(target_metric=40.0, higher_is_better_metric=False)
    assert not ZEUS.on_epoch(snapshot(higher, []), running(3), 0.899).stop
    assert not ZEUS.on_epoch(snapshot(lower, []), running(3), 40.1).stop
    # A lower-is-better job must not read a high metric as success.
    assert not ZEUS.on_epoch(snapshot(lower, []), running(3), 95.0).stop


@pytest.mark.parametrize("name", STOP_POLICIES)
def test_max_epochs(name: str) -> None:
    policy: Policy = POLICIES[name]
    spec = make_spec(max_epochs=10, policy=name)
    verdict = policy.on_epoch(snapshot(spec, []), running(10), 0.5)
    assert (verdict.stop, verdict.converged, verdict.reason) == (
        True,
        False,
        StopReason.MAX_EPOCHS,
    )
    assert "10 epochs" in verdict.message
    # Reaching the target on the last allowed epoch still converges.
    last = policy.on_epoch(snapshot(spec, []), running(10), 0.9)
    assert last.converged
    assert not ZEUS.on_epoch(snapshot(spec, []), running(9), 0.5).stop


@pytest.mark.parametrize("name", STOP_POLICIES)
def test_beta_bound(name: str) -> None:
    policy: Policy = POLICIES[name]
    spec = make_spec(beta_knob=2.0, policy=name)
    history = [finished(1, 64, 100.0), finished(2, 32, 150.0)]
    verdict = policy.on_epoch(snapshot(spec, history), running(3, cost=200.5, size=16), 0.5)
    assert (verdict.stop, verdict.converged, verdict.reason) == (
        True,
        False,
        StopReason.COST_BOUND,
    )


def test_beta_bound_is_strict_and_based_on_the_cheapest_converged_run() -> None:
    spec = make_spec(beta_knob=2.0)
    history = [finished(1, 64, 100.0), finished(2, 32, 150.0), finished(3, 16, None)]
    assert not ZEUS.on_epoch(snapshot(spec, history), running(3, cost=200.0), 0.5).stop
    assert ZEUS.on_epoch(snapshot(spec, history), running(3, cost=200.01), 0.5).stop


def test_beta_none_disables_the_bound() -> None:
    spec = make_spec(beta_knob=None)
    history = [finished(1, 64, 100.0)]
    verdict = ZEUS.on_epoch(snapshot(spec, history), running(3, cost=1e9), 0.5)
    assert not verdict.stop


def test_no_bound_before_anything_converged() -> None:
    spec = make_spec(beta_knob=2.0)
    history = [finished(1, 64, None)]
    assert not ZEUS.on_epoch(snapshot(spec, history), running(3, cost=1e9), 0.5).stop
