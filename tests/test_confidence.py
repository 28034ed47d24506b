"""bso.core.confidence: the recommendation and its posterior probability of being the cheapest."""

from __future__ import annotations

from typing import Any

import pytest

from bso.core.confidence import MAX_WITH_ONE_CONVERGED, recommend
from bso.core.outcomes import learning_view
from bso.core.state import JobSnapshot, TrialSnapshot
from bso.events import StopReason, TrialPhase, TrialStatus
from bso.spec import Hardware, JobSpec

GPU = Hardware(gpu_model="Tesla V100", gpu_count=1, max_power_w=250.0)


def lane(sizes: list[int], default: int, runs: dict[int, list[Any]]) -> JobSnapshot:
    """``runs[b]``: costs of converged runs, or (StopReason, epochs, cost) of other ends."""
    spec = JobSpec(
        job_id="j", batch_sizes=sizes, default_batch_size=default, target_metric=1, max_epochs=50
    )
    trials, number = [], 0
    for b, outcomes in runs.items():
        for outcome in outcomes:
            number += 1
            if isinstance(outcome, tuple):
                reason, epochs, cost = outcome
                trials.append(
                    TrialSnapshot(
                        number,
                        b,
                        TrialPhase.EXPLORATION,
                        TrialStatus.FAILED,
                        epochs,
                        0,
                        0,
                        cost,
                        reason,
                    )
                )
            else:
                trials.append(
                    TrialSnapshot(
                        number,
                        b,
                        TrialPhase.EXPLORATION,
                        TrialStatus.CONVERGED,
                        10,
                        0,
                        0,
                        outcome,
                        StopReason.TARGET_REACHED,
                    )
                )
    return learning_view(JobSnapshot(spec, GPU, tuple(trials)))


def test_nothing_converged_means_no_recommendation() -> None:
    assert recommend(lane([32, 64], 64, {})) is None


def test_one_converged_size_is_far_from_certain() -> None:
    found = recommend(lane([16, 32, 64, 128, 256], 64, {64: [100.0] * 5}))
    assert found is not None
    assert found.batch_size == 64
    # Each untried neighbour may as well be cheaper: far below 0.9.
    assert found.confidence < 0.5
    assert found.converged_sizes == 1
    assert found.gain_over_default == pytest.approx(1.0)


def test_a_single_candidate_is_still_capped() -> None:
    found = recommend(lane([64], 64, {64: [100.0] * 20}))
    assert found is not None
    assert found.confidence == MAX_WITH_ONE_CONVERGED


def test_every_size_measured_and_one_clearly_cheaper_is_near_certain() -> None:
    runs = {32: [150.0, 152.0, 149.0], 64: [100.0, 101.0, 99.0], 128: [140.0, 139.0, 141.0]}
    found = recommend(lane([32, 64, 128], 128, runs))
    assert found is not None
    assert found.batch_size == 64
    assert found.confidence > 0.95
    assert found.gain_over_default == pytest.approx(140 / 100, rel=0.01)


def test_more_runs_more_confidence() -> None:
    few = recommend(lane([32, 64], 32, {32: [104.0], 64: [100.0]}))
    many = recommend(lane([32, 64], 32, {32: [104.0] * 6, 64: [100.0] * 6}))
    assert few is not None
    assert many is not None
    assert few.batch_size == many.batch_size == 64
    assert few.confidence < many.confidence


def test_what_a_stopped_run_proved_bounds_its_size() -> None:
    sizes, measured = [32, 64, 128], {32: [100.0] * 4, 64: [100.0] * 4}
    untried = recommend(lane(sizes, 32, measured))
    # 128 was stopped after 2 epochs at a cost that proves it costs at least 300.
    stopped = recommend(lane(sizes, 32, {**measured, 128: [(StopReason.PROJECTED_COST, 2, 200.0)]}))
    assert untried is not None
    assert stopped is not None
    assert stopped.probability_best.get(128, 0.0) < untried.probability_best[128]


def test_failed_and_out_of_memory_sizes_are_never_the_cheapest() -> None:
    runs = {
        32: [(StopReason.MAX_EPOCHS, 50, 900.0)],
        64: [100.0] * 3,
        128: [110.0] * 3,
        256: [(StopReason.OUT_OF_MEMORY, 0, 0.0)],
    }
    found = recommend(lane([32, 64, 128, 256, 512], 64, runs))
    assert found is not None
    assert set(found.probability_best) == {64, 128}


def test_equal_costs_resolve_toward_the_default_and_reads_repeat() -> None:
    snapshot = lane([32, 64, 128], 64, {32: [100.0] * 3, 64: [100.0] * 3, 128: [100.0] * 3})
    first, second = recommend(snapshot), recommend(snapshot)
    assert first is not None
    assert first.batch_size == 64
    assert first == second
