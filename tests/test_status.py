"""bso.status: the read models a status reply carries."""

from __future__ import annotations

import itertools

from bso.core.outcomes import Outcome, outcome_from
from bso.core.vocabulary import StopReason, TrialStatus, lost_its_run
from bso.status import FINAL_OUTCOMES


def test_a_final_outcome_is_never_one_a_resume_reopens() -> None:
    """A detached run sends a lost report again only to a trial listed with a final
    outcome (bso_client.reattachment): a trial that could be resumed may have been, by
    another run, which would take the report as its own next epoch."""
    assert {outcome.value for outcome in Outcome} >= FINAL_OUTCOMES
    for status, reason in itertools.product(TrialStatus, [None, *StopReason]):
        if outcome_from(status, reason).value in FINAL_OUTCOMES:
            assert not lost_its_run(status, reason), (status, reason)


def test_bso_stops_and_convergence_are_final() -> None:
    """The endings a lost reply can hide: the report's stop, target or max_epochs."""
    for status, reason in [
        (TrialStatus.FAILED, StopReason.COST_BOUND),
        (TrialStatus.FAILED, StopReason.MAX_EPOCHS),
        (TrialStatus.CONVERGED, StopReason.TARGET_REACHED),
    ]:
        assert outcome_from(status, reason).value in FINAL_OUTCOMES, (status, reason)
