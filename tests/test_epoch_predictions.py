"""The epochs a size's run will likely take (bso/core/epoch_predictions.py)."""

from __future__ import annotations

import math

import pytest

from bso.core import confidence
from bso.core.epoch_predictions import (
    EPOCH_GUESS_Z,
    epochs_to_target,
    least_epochs,
    plausible_low,
    revisit_guesses,
)
from bso.core.size_evidence import SizeEvidence
from bso.core.state import EpochGuess

UNTRIED = SizeEvidence(math.inf, (), (), 0)


def test_a_larger_size_may_need_one_epoch_fewer_and_a_smaller_one_fewer_in_proportion() -> None:
    evidence = {128: SizeEvidence(1.0, (20, 22), (), 0), 64: UNTRIED, 256: UNTRIED}
    assert least_epochs(evidence, 256) == pytest.approx(21 - 1)
    assert least_epochs(evidence, 64) == pytest.approx(21 * 64 / 128)


def test_another_lanes_epochs_raise_the_bound_but_never_lower_it() -> None:
    """The higher of the neighbour's bound and the guess less EPOCH_GUESS_Z sds holds."""
    evidence = {128: SizeEvidence(1.0, (20,), (), 0)}
    dear = EpochGuess(math.log(60.0), 0.05, 0.08)
    evidence[256] = SizeEvidence(0.8, (), (), 0, other_lane=dear)
    assert least_epochs(evidence, 256) == pytest.approx(
        math.exp(dear.log_mean - EPOCH_GUESS_Z * dear.run_log_sd)
    )
    cheap = EpochGuess(math.log(10.0), 0.05, 0.08)
    evidence[256] = SizeEvidence(0.8, (), (), 0, other_lane=cheap)
    assert least_epochs(evidence, 256) == pytest.approx(19.0)


def test_a_size_remeasured_is_bounded_by_its_own_mean_when_lower() -> None:
    evidence = {128: SizeEvidence(1.0, (20,), (), 0), 256: SizeEvidence(0.8, (12,), (), 0)}
    assert least_epochs(evidence, 256) == pytest.approx(12.0)
    assert least_epochs({256: SizeEvidence(0.8, (), (), 0)}, 256) is None


def test_epochs_to_target_rest_on_own_runs_then_other_lanes_then_a_neighbour() -> None:
    guess = EpochGuess(math.log(30.0), 0.05, 0.08)
    evidence = {
        128: SizeEvidence(1.0, (20, 20), (), 0),
        256: SizeEvidence(0.8, (), (1,), 0, other_lane=guess),
        512: SizeEvidence(0.7, (), (1,), 0),
    }
    own_centre, own_spread = epochs_to_target(evidence, 128)
    assert own_centre == pytest.approx(math.log(20.0))
    assert epochs_to_target(evidence, 256) == pytest.approx((guess.log_mean, guess.run_log_sd))
    centre, spread = epochs_to_target(evidence, 512)
    assert centre == pytest.approx(math.log(20.0) + confidence.EPOCH_SLOPE[0] * 2)
    assert spread > own_spread  # two doublings of an unknown slope


def test_a_size_cut_on_another_lanes_epochs_is_judged_by_a_plausible_low() -> None:
    """Its median alone would keep a first-epoch cut out of exploitation for good."""
    guess = EpochGuess(math.log(30.0), 0.1, 0.08)
    evidence = {
        128: SizeEvidence(1.0, (20,), (), 0),
        256: SizeEvidence(0.8, (), (1,), 0, other_lane=guess),
    }
    prediction = revisit_guesses(evidence)[256]
    low = plausible_low(prediction, evidence[256])
    assert low == pytest.approx(prediction.log_median - EPOCH_GUESS_Z * prediction.log_sd)
    assert low < prediction.log_median
    alone = {128: evidence[128], 256: SizeEvidence(0.8, (), (1,), 0)}
    assert plausible_low(revisit_guesses(alone)[256], alone[256]) == pytest.approx(
        revisit_guesses(alone)[256].log_median
    )
