"""What ``bso status`` shows per lane (bso/core/lane_status.py), read through the service.

Stage, running trials, the recommendation and its confidence, the expected
cost, and per size the outcomes, mean cost and chance of being the best; a
size the job is no longer given is never the recommendation.  Who may read a
status, and a job that does not exist, are the service's (test_service.py).
"""

from __future__ import annotations

import pytest

from bso.core.vocabulary import StopReason, TrialPhase
from bso.service import BsoService
from tests.test_service import V100, clock, job, make_spec, run_to_end, service

__all__ = ["clock", "job", "service"]  # fixtures, shared with test_service.py


def test_status_follows_the_job(service: BsoService, job: str) -> None:
    trial = service.next_trial(job)
    lane = service.status(job).lanes[0]
    assert lane.stage == "exploring"
    assert lane.recommended_batch_size is None
    assert lane.confidence is None
    assert lane.running_trials == 1
    run_to_end(service, job, trial)
    for _ in range(12):
        run_to_end(service, job, service.next_trial(job))
    lane = service.status(job).lanes[0]
    assert lane.stage == "exploiting"
    assert lane.hardware == V100
    assert lane.trials == 13
    assert lane.running_trials == 0
    # Costs per run: 64 -> 3 x 25 s, 32 -> 3 x 40 s, 128 -> 4 x 20 s.
    assert lane.recommended_batch_size == 64
    assert lane.confidence is not None
    assert 0 <= lane.confidence <= 100
    assert lane.expected_cost is not None
    sizes = {s.batch_size: s for s in lane.sizes}
    assert sum(s.trials for s in sizes.values()) == 13
    for s in sizes.values():
        assert s.converged + s.not_converged == s.trials
        assert s.failed == s.outcomes.get("failed", 0)
        assert s.probability_best is None or 0.0 <= s.probability_best <= 1.0
    assert sizes[64].mean_cost == pytest.approx(lane.expected_cost)
    assert sum(s.probability_best or 0.0 for s in sizes.values()) == pytest.approx(1.0)
    # Reading the status twice gives the same answer and does not move the job's RNG.
    assert service.status(job) == service.status(job)


def test_a_size_that_keeps_failing_is_dropped_and_not_recommended(service: BsoService) -> None:
    """64 is the cheapest, then diverges twice in a row after its first epoch (a NaN
    metric on new data; a crash, at any epoch, is a script error instead)."""
    service.register(make_spec(job_id="oom", batch_sizes=[32, 64]))
    for _ in range(4):  # two pruning rounds over 64 and 32
        trial = service.next_trial("oom")
        assert trial.phase is TrialPhase.EXPLORATION
        run_to_end(service, "oom", trial)
    assert service.status("oom").lanes[0].recommended_batch_size == 64
    crashes = 0
    for _ in range(20):
        trial = service.next_trial("oom")
        if trial.batch_size == 64:
            service.report_epoch(
                "oom", trial.trial_number, epoch=1, time_s=1.0, energy_j=1.0, metric=0.0
            )
            service.end_trial("oom", trial.trial_number, reason=StopReason.DIVERGED)
            crashes += 1
            if crashes == 2:
                break
        else:
            run_to_end(service, "oom", trial)
    assert crashes == 2
    for _ in range(10):
        trial = service.next_trial("oom")
        assert trial.batch_size == 32
        run_to_end(service, "oom", trial)
    lane = service.status("oom").lanes[0]
    sizes = {s.batch_size: s for s in lane.sizes}
    assert sizes[64].failed == 2
    # The recommendation is a size the job is still given, not the dropped one.
    assert lane.recommended_batch_size == 32
