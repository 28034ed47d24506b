"""bso.core.size_evidence: what the finished trials say about each batch size."""

from __future__ import annotations

import math

from bso.core.size_evidence import SizeEvidence, cost_cv, gather_evidence, nearest
from bso.core.state import JobSnapshot, TrialSnapshot
from bso.core.vocabulary import StopReason, TrialPhase, TrialStatus
from bso.spec import Hardware, JobSpec

SPEC = JobSpec(
    job_id="job",
    batch_sizes=[32, 64, 128, 256],
    default_batch_size=64,
    target_metric=0.9,
    eta_knob=1.0,
    policy="bso",
    hardware=Hardware(gpu_model="V100", max_power_w=250.0),
)


def ended(
    number: int, size: int, epochs: int, per_epoch: float, reason: StopReason | None
) -> TrialSnapshot:
    status = TrialStatus.CONVERGED if reason is StopReason.TARGET_REACHED else TrialStatus.FAILED
    return TrialSnapshot(
        number, size, TrialPhase.EXPLORATION, status, epochs,
        energy_j=per_epoch * epochs, cost=per_epoch * epochs, stop_reason=reason,
    )  # fmt: skip


def test_runs_are_split_by_what_they_prove_about_the_epochs() -> None:
    trials = (
        ended(1, 64, 10, 2.0, StopReason.TARGET_REACHED),
        ended(2, 64, 12, 2.2, StopReason.TARGET_REACHED),
        ended(3, 128, 4, 1.5, StopReason.PROJECTED_COST),  # needed more than 4
        ended(4, 256, 30, 1.0, StopReason.MAX_EPOCHS),  # may never converge
    )
    evidence = gather_evidence(JobSnapshot(SPEC, SPEC.hardware, trials))
    assert set(evidence) == {32, 64, 128, 256}
    assert evidence[64].epochs == (10, 12)
    assert evidence[64].epoch_cost == 2.1  # every run with an epoch times the size
    assert evidence[64].mean_cost == 2.1 * 11
    assert evidence[128].censored == (4,)
    assert evidence[128].only_stopped
    assert evidence[128].proven_epochs == 5
    assert evidence[128].epoch_count_mattered
    assert evidence[256].hard_failures == 1
    assert not evidence[32].tried
    assert math.isinf(evidence[32].epoch_cost)


def test_a_stop_after_the_first_epoch_was_judged_on_speed_alone() -> None:
    once = SizeEvidence(epoch_cost=3.0, epochs=(), censored=(1,), hard_failures=0)
    assert not once.epoch_count_mattered  # running it again would end the same way
    assert once.proven_epochs == 2


def test_the_nearest_size_is_nearest_along_log_batch_size() -> None:
    assert nearest([32, 256], 100) == 256  # 2.56x away, against 3.1x
    assert nearest([32, 256], 80) == 32  # 2.5x away, against 3.2x
    assert nearest([32, 128], 64) == 32  # equally far: the first one


def test_noise_is_pooled_relative_to_each_size_and_shrunk_to_a_prior() -> None:
    steady = {64: SizeEvidence(2.0, (10, 10, 10), (), 0), 128: SizeEvidence(1.0, (20,), (), 0)}
    noisy = {64: SizeEvidence(2.0, (5, 15, 10), (), 0), 128: SizeEvidence(1.0, (20,), (), 0)}
    assert 0 < cost_cv(steady) < cost_cv(noisy)
