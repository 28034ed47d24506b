"""bso.core.confidence: the recommendation and its posterior probability of being
the cheapest (within 1%)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest

from bso.core.confidence import MAX_WITH_ONE_CONVERGED, MODEL_SIZES, recommend
from bso.core.outcomes import learning_view
from bso.core.state import JobSnapshot, TrialSnapshot
from bso.core.vocabulary import StopReason, TrialPhase, TrialStatus
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


def test_a_single_candidate_is_certain_and_one_converged_of_two_is_capped() -> None:
    """A job of one size showed confidence 89 forever beside P(best) 1.00: no other size
    can be cheaper, so the recommendation is right with probability 1."""
    found = recommend(lane([64], 64, {64: [100.0] * 20}))
    assert found is not None
    assert (found.confidence, found.probability_best[64]) == pytest.approx((1.0, 1.0))
    untried_neighbour = recommend(lane([64, 128], 64, {64: [100.0] * 20}))
    assert untried_neighbour is not None
    assert untried_neighbour.confidence <= MAX_WITH_ONE_CONVERGED


def test_an_untried_size_close_to_the_lone_converged_one_keeps_the_cap() -> None:
    """The model leaves out an untried size within a step of a kept one (68 beside
    64, 128 beside 120), so the lone converged size had P(best) 1.00 and, uncapped,
    confidence 100 while a size that may be cheaper had never run."""
    for sizes in ([64, 68], [120, 128]):
        found = recommend(lane(sizes, sizes[0], {sizes[0]: [100.0] * 3}))
        assert found is not None
        assert found.confidence <= MAX_WITH_ONE_CONVERGED
    failed_twice = [(StopReason.MAX_EPOCHS, 50, 500.0)] * 2
    rest_ruled_out = recommend(lane([64, 68], 64, {64: [100.0] * 3, 68: failed_twice}))
    assert rest_ruled_out is not None
    assert rest_ruled_out.confidence == pytest.approx(1.0)  # no size left to be cheaper


def test_every_size_measured_and_one_clearly_cheaper_is_near_certain() -> None:
    runs = {32: [150.0, 152.0, 149.0], 64: [100.0, 101.0, 99.0], 128: [140.0, 139.0, 141.0]}
    found = recommend(lane([32, 64, 128], 128, runs))
    assert found is not None
    assert found.batch_size == 64
    assert found.confidence > 0.95
    assert found.gain_over_default == pytest.approx(140 / 100, rel=0.01)


def test_a_near_tie_is_right_either_way() -> None:
    """Two sizes 0.3% apart, each run eight times: which is cheaper outright is
    nearly a coin toss, but either is within the 1% tolerance of the cheapest, so
    the confidence is far higher (not certain: the model still allows the
    smooth curve and each size's quirk to differ from the runs' means).  Six
    percent apart, the tolerance adds nothing."""
    tie = recommend(lane([32, 64], 32, {32: [100.3] * 4 + [100.2] * 4, 64: [100.0] * 8}))
    assert tie is not None
    assert tie.batch_size == 64
    assert tie.probability_best[64] < 0.7
    assert tie.confidence > 0.8
    apart = recommend(lane([32, 64], 32, {32: [106.0] * 8, 64: [100.0] * 8}))
    assert apart is not None
    assert apart.confidence == pytest.approx(apart.probability_best[64], abs=0.01)


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
    runs: dict[int, list[Any]] = {
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


def converged_at(epochs: int, cost: float, number: int, size: int) -> TrialSnapshot:
    return TrialSnapshot(
        number,
        size,
        TrialPhase.EXPLORATION,
        TrialStatus.CONVERGED,
        epochs,
        0,
        0,
        cost,
        StopReason.TARGET_REACHED,
    )


def epochs_lane(
    sizes: list[int], runs: dict[int, list[int]], epoch_cost: dict[int, float]
) -> JobSnapshot:
    """Converged runs given as epochs, each size's epoch at a fixed cost."""
    spec = JobSpec(
        job_id="j", batch_sizes=sizes, default_batch_size=sizes[0], target_metric=1, max_epochs=200
    )
    trials: list[TrialSnapshot] = []
    for b, epochs in runs.items():
        for e in epochs:
            trials.append(converged_at(e, e * epoch_cost[b], len(trials) + 1, b))
    return learning_view(JobSnapshot(spec, GPU, tuple(trials)))


def test_two_separated_sizes_on_a_rising_landscape_are_near_certain() -> None:
    # Epochs double per doubling while an epoch gets only a little cheaper: 32 wins.
    sizes = [32, 64, 128, 256]
    cost = {32: 10.0, 64: 9.0, 128: 8.5, 256: 8.2}
    found = recommend(epochs_lane(sizes, {32: [10, 11, 10, 9] * 3, 64: [20, 21, 19, 22] * 3}, cost))
    assert found is not None
    assert found.batch_size == 32
    assert found.converged_sizes == 2
    assert found.confidence > 0.9


def test_one_converged_size_never_reaches_090() -> None:
    found = recommend(epochs_lane([32, 64, 128], {64: [10] * 30}, {64: 5.0}))
    assert found is not None
    assert found.confidence < 0.9


def test_a_censored_run_lowers_its_size_chance() -> None:
    sizes, runs, cost = [32, 64, 128], {32: [10, 10, 11], 64: [10, 11, 10]}, {32: 10.0, 64: 9.8}
    base = epochs_lane(sizes, runs, cost)
    censored = TrialSnapshot(
        99,
        128,
        TrialPhase.EXPLORATION,
        TrialStatus.FAILED,
        12,
        0,
        0,
        12 * 9.5,
        StopReason.COST_BOUND,
    )
    stopped = learning_view(dataclasses.replace(base, trials=(*base.trials, censored)))
    before, after = recommend(base), recommend(stopped)
    assert before is not None
    assert after is not None
    assert after.probability_best[128] < before.probability_best[128]


def test_sizes_past_a_max_epochs_failure_are_ruled_out() -> None:
    base = epochs_lane([32, 64, 128, 256], {32: [10, 10], 64: [12, 12]}, {32: 10.0, 64: 9.0})
    failure = TrialSnapshot(
        9, 128, TrialPhase.EXPLORATION, TrialStatus.FAILED, 200, 0, 0, 1600.0, StopReason.MAX_EPOCHS
    )
    found = recommend(learning_view(dataclasses.replace(base, trials=(*base.trials, failure))))
    assert found is not None
    assert set(found.probability_best) == {32, 64}
    assert sum(found.probability_best.values()) == pytest.approx(1.0)


def test_below_the_measured_sizes_the_chance_stays_near_them() -> None:
    """Each factor is log-convex: below the measured sizes an epoch gets dearer at
    least as fast as at the edge and epochs fall no faster, so a size four
    doublings away is less likely the cheapest than the nearer sizes together
    (a shape prior on the sum alone put most of the chance at the far edge)."""
    sizes = [8, 16, 32, 64, 128, 256, 512, 1024]
    cost = {128: 10.0, 256: 8.5, 512: 7.5}
    runs = {128: [10, 11], 256: [13, 14], 512: [19, 20]}
    found = recommend(epochs_lane(sizes, runs, cost))
    assert found is not None
    assert found.batch_size == 128
    nearer = sum(found.probability_best.get(b, 0.0) for b in (16, 32, 64, 128))
    assert found.probability_best[8] < nearer


def valley_epochs(b: int, epoch_cost: dict[int, float]) -> int:
    """Epochs that make 64 the bottom of a valley 15% deeper per doubling."""
    relative = 1 + 0.15 * abs(math.log2(b / 64))
    return round(20 * relative * epoch_cost[64] / epoch_cost[b])


def test_sizes_left_unmeasured_beyond_a_dearer_one_keep_the_model_short_of_certain() -> None:
    """A valley measured at 64 and its two neighbours: the shape says no size past
    them is cheaper, but the shape can be wrong where nothing was measured (a
    second valley), so the confidence stays below 0.99 (SHAPE_DOUBT); with every
    size measured there is nothing left to doubt."""
    sizes = [16, 32, 64, 128, 256, 512, 1024]
    epoch_cost = {b: 10.0 * (64 / b) ** 0.5 for b in sizes}
    around = {b: [valley_epochs(b, epoch_cost)] * 4 for b in (32, 64, 128)}
    partly = recommend(epochs_lane(sizes, around, epoch_cost))
    assert partly is not None
    assert partly.batch_size == 64
    assert 0.9 < partly.confidence < 0.99
    assert partly.probability_best[1024] > 0
    everywhere = {b: [valley_epochs(b, epoch_cost)] * 4 for b in sizes}
    whole = recommend(epochs_lane(sizes, everywhere, epoch_cost))
    assert whole is not None
    assert whole.batch_size == 64
    assert whole.confidence > 0.999


def test_the_recommendation_is_the_size_most_likely_the_cheapest() -> None:
    """32 has the lowest mean (three runs, 1.093), but 64's one run (1.100) sits
    below the line its neighbours draw from 32 through 128 and 256: the model
    makes 64 likelier the cheapest, so 64 is recommended, and its gain over the
    default 32 is above 1 because both are judged by the same model."""
    sizes = [32, 64, 128, 256, 512]
    cost = {32: 1.093 / 27, 64: 1.100 / 36, 128: 1.127 / 43.5, 256: 1.233 / 52.5}
    runs = {32: [27, 27, 27], 64: [36], 128: [43, 44], 256: [52, 53]}
    snapshot = epochs_lane(sizes, runs, cost)
    assert min(snapshot.mean_costs().items(), key=lambda item: item[1])[0] == 32
    found = recommend(snapshot)
    assert found is not None
    assert found.batch_size == 64
    assert found.probability_best[64] == max(found.probability_best.values())
    # Within 1% of the cheapest takes in the draws where 64 is cheapest outright.
    assert found.confidence >= found.probability_best[64]
    assert found.gain_over_default is not None
    assert found.gain_over_default > 1


def test_the_gain_follows_the_measured_ratio_where_both_sizes_are_well_measured() -> None:
    found = recommend(lane([32, 64], 32, {32: [120.0] * 8, 64: [100.0] * 8}))
    assert found is not None
    assert found.batch_size == 64
    assert found.gain_over_default == pytest.approx(1.2, rel=0.03)


def test_a_recommendation_cheaper_than_the_default_never_shows_a_gain_below_one() -> None:
    """One run each, far apart: the few draws with the widest noise must not turn
    the gain around (a ratio of expected costs gave 0.84 here)."""
    sizes = [16, 32, 64, 128, 256, 512]
    found = recommend(epochs_lane(sizes, {16: [8], 512: [38]}, {16: 26.76, 512: 3.58}))
    assert found is not None
    assert found.batch_size == 512
    assert found.gain_over_default is not None
    assert found.gain_over_default > 1


def test_a_job_declaring_thousands_of_sizes_is_modelled_on_a_bounded_grid() -> None:
    """A job may declare up to 4,096 sizes; the model's cost grows with the square
    of the sizes it is drawn over, so it keeps every size with runs, the
    default, and spreads the rest: a worker's status read stays bounded."""
    sizes = list(range(8, 8 * 4097, 8))
    runs = {64: [30.0, 31.0], 128: [25.0, 26.0], 256: [28.0, 27.0]}
    found = recommend(lane(sizes, 16384, runs))
    assert found is not None
    assert len(found.probability_best) <= MODEL_SIZES
    assert {64, 128, 256} <= set(found.probability_best)
    assert found.batch_size == 128
    assert 16384 in found.probability_best  # the default stays, so the gain is known
    assert found.gain_over_default is not None
    # Below the bound, on a grid no denser than MIN_STEP, every size counts.
    geometric = sorted({round(8 * 2 ** (k / 4)) for k in range(MODEL_SIZES)} | {64, 128, 256})
    assert len(geometric) == MODEL_SIZES
    few = recommend(lane(geometric, 64, runs))
    assert few is not None
    assert len(few.probability_best) == MODEL_SIZES


def test_two_sizes_a_few_percent_apart_measured_once_are_a_toss_up() -> None:
    """A grid in steps of 8 around 1024: 1024 and 1032 ran once each, 0.03% apart
    in cost.  Slopes over 0.8% of batch size are noise over almost nothing; held
    to the shape priors, one draw in 4,000 carried the answer and 1032 was
    shown at confidence 100.  Now it is a toss-up, and the lower mean wins it."""
    sizes = [1000 + 8 * i for i in range(6)]
    found = recommend(lane(sizes, 1024, {1024: [11762.0], 1032: [11766.0]}))
    assert found is not None
    assert found.batch_size == 1024
    assert 0.3 < found.confidence < 0.7
    # The untried sizes within a tenth of a doubling are left to their measured twins.
    assert set(found.probability_best) == {1024, 1032}


def test_one_run_far_off_the_curve_does_not_bend_it_through_every_size() -> None:
    """A new user's job: the default 16's only run was slowed 20x (a slow node, a first
    run that downloads its data), then 32 converged twice at about half the cost of
    64's only converged run.  With no room for a size to depart from the smooth curve
    of an epoch's cost, that one run bent the curve through 32 and 64: 64 was the
    recommendation, at confidence 100.  The measured costs say 32."""

    def run(number: int, size: int, epochs: int, cost: float, converged: bool) -> TrialSnapshot:
        status = TrialStatus.CONVERGED if converged else TrialStatus.FAILED
        reason = StopReason.TARGET_REACHED if converged else StopReason.PROJECTED_COST
        return TrialSnapshot(
            number, size, TrialPhase.EXPLORATION, status, epochs, 0, 0, cost, reason
        )

    spec = JobSpec(
        job_id="j", batch_sizes=[8, 16, 32, 64], default_batch_size=16, target_metric=0.92,
        max_epochs=10,
    )  # fmt: skip
    trials = (
        run(1, 16, 3, 313.0, True),
        run(2, 32, 4, 7.25, True),
        run(3, 64, 7, 9.07, False),
        run(4, 64, 8, 13.5, True),
        run(5, 32, 4, 7.86, True),
    )
    found = recommend(learning_view(JobSnapshot(spec, GPU, trials)))
    assert found is not None
    assert found.batch_size == 32
    assert found.confidence >= 0.9
    assert found.probability_best[64] < 0.05
