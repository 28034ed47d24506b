"""The exploration budget (bso/core/budget.py): the ledger, the gate on new trials,
the stop of running ones, and what a budgeted job costs over its life."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from pydantic import ValidationError

from bso.core import budget
from bso.core.bso_policy import BsoPolicy
from bso.core.policy import Assignment, within_budget
from bso.core.state import EpochGuess, JobSnapshot, TrialSnapshot
from bso.core.vocabulary import StopReason, TrialPhase, TrialStatus
from bso.replay.landscapes import landscape_workloads
from bso.replay.simulate import make_world, replay_fixed, replay_policy
from bso.spec import Hardware, JobSpec

BSO = BsoPolicy()
SIZES = [32, 64, 128, 256]


def spec(exploration_budget: float | None = 0.02, **changes: object) -> JobSpec:
    fields: dict[str, object] = {
        "job_id": "job",
        "batch_sizes": SIZES,
        "default_batch_size": 128,
        "target_metric": 0.9,
        "eta_knob": 1.0,
        "mab_seed": 1,
        "exploration_budget": exploration_budget,
        "hardware": Hardware(gpu_model="V100", max_power_w=250.0),
    }
    fields.update(changes)
    return JobSpec.model_validate(fields)


def run(
    number: int,
    size: int,
    epochs: int,
    per_epoch: float,
    *,
    status: TrialStatus = TrialStatus.CONVERGED,
    reason: StopReason | None = StopReason.TARGET_REACHED,
) -> TrialSnapshot:
    return TrialSnapshot(
        number, size, TrialPhase.EXPLORATION, status, epochs,
        energy_j=per_epoch * epochs, cost=per_epoch * epochs, stop_reason=reason,
    )  # fmt: skip


def snapshot(job: JobSpec, *trials: TrialSnapshot) -> JobSnapshot:
    return JobSnapshot(job, job.hardware, tuple(trials))


def defaults(count: int, per_epoch: float = 10.0, epochs: int = 10) -> list[TrialSnapshot]:
    """``count`` converged runs of the default, 100 each by default."""
    return [run(n, 128, epochs, per_epoch) for n in range(1, count + 1)]


# -- the ledger ------------------------------------------------------------------------


def test_the_allowance_counts_the_budget_from_recurrence_one_over_the_budget() -> None:
    """A 2% budget allows one default run of excess until recurrence 50, then 2%."""
    ledger = budget.ledger(snapshot(spec(0.02), *defaults(3)))
    assert ledger is not None
    assert ledger.baseline_cost == pytest.approx(100.0)
    # Three runs of the default: its mean's lower 90% bound, at the lane's pooled noise.
    assert 80.0 < ledger.baseline_lower < 100.0
    assert ledger.allowed_excess(3) == pytest.approx(100.0)
    assert ledger.allowed_excess(50) == pytest.approx(100.0)
    assert ledger.allowed_excess(100) == pytest.approx(200.0)
    assert ledger.used == pytest.approx(0.0)
    assert ledger.allowed == pytest.approx(1.0)


def test_runs_of_the_default_cancel_whatever_their_noise() -> None:
    """Always-default paid exactly what the default's own runs cost in their
    recurrences: however noisy they are, they use none of the budget."""
    noisy = [run(n, 128, epochs, 10.0) for n, epochs in enumerate((6, 14, 9, 13), start=1)]
    ledger = budget.ledger(snapshot(spec(), *noisy))
    assert ledger is not None
    assert ledger.used == 0.0
    assert ledger.excess == 0.0


def test_no_budget_or_no_converged_default_means_no_ledger() -> None:
    assert budget.ledger(snapshot(spec(None), *defaults(3))) is None
    failed = run(1, 128, 100, 10.0, status=TrialStatus.FAILED, reason=StopReason.MAX_EPOCHS)
    assert budget.ledger(snapshot(spec(), failed)) is None


def test_a_size_is_safe_only_when_clearly_cheaper_than_the_default() -> None:
    trials = defaults(3)
    trials += [run(n, 64, 10, 6.0) for n in (4, 5, 6)]  # 60 against 100: clearly cheaper
    trials += [run(7, 256, 10, 9.8)]  # 98 once: within noise of the default
    ledger = budget.ledger(snapshot(spec(), *trials))
    assert ledger is not None
    assert ledger.safe_sizes == (64, 128)
    assert ledger.cheapest_safe_size == 64
    assert ledger.fallback_cost == pytest.approx(60.0)


# -- the gate on new trials ---------------------------------------------------------------


def test_the_default_runs_first_while_its_cost_is_unknown() -> None:
    job = spec()
    wanted = Assignment(64, TrialPhase.EXPLORATION)
    assert within_budget(snapshot(job), wanted) == Assignment(128, TrialPhase.EXPLORATION)
    running = dataclasses.replace(defaults(1)[0], status=TrialStatus.RUNNING, stop_reason=None)
    assert within_budget(snapshot(job, running), wanted).batch_size == 128
    assert within_budget(snapshot(spec(None)), wanted) == wanted


def test_an_exploration_the_ledger_can_pay_for_is_handed_out() -> None:
    job = spec()
    wanted = Assignment(256, TrialPhase.EXPLORATION)
    assert within_budget(snapshot(job, *defaults(2)), wanted) == wanted


def test_a_spent_budget_hands_out_the_cheapest_safe_size() -> None:
    """An exploration stopped at 1.5 default runs used the allowance up: the next
    unsafe size must wait for savings or for the budget to grow."""
    job = spec()
    stopped = run(3, 256, 15, 10.0, status=TrialStatus.FAILED, reason=StopReason.PROJECTED_COST)
    trials = [*defaults(2), stopped]
    wanted = Assignment(64, TrialPhase.EXPLORATION)
    assert within_budget(snapshot(job, *trials), wanted) == Assignment(128, TrialPhase.EXPLOITATION)
    # Without the budget, the same lane explores.
    assert within_budget(snapshot(spec(None), *trials), wanted) == wanted


def test_savings_refill_the_budget() -> None:
    """The same overspend, followed by runs of a size that saves 40% a run."""
    job = spec()
    stopped = run(3, 256, 15, 10.0, status=TrialStatus.FAILED, reason=StopReason.PROJECTED_COST)
    cheaper = [run(n, 64, 10, 6.0) for n in (4, 5, 6)]
    view = snapshot(job, *defaults(2), stopped, *cheaper)
    ledger = budget.ledger(view)
    assert ledger is not None
    # Savings are credited against the default's lower bound, not its mean.
    assert ledger.used == pytest.approx((150.0 + 3 * 60.0 - 3 * ledger.baseline_lower) / 100.0)
    assert ledger.used < 1.0
    wanted = Assignment(32, TrialPhase.EXPLORATION)
    assert within_budget(view, wanted) == wanted


# -- stopping a running trial -----------------------------------------------------------------


def overdrawn_lane() -> list[TrialSnapshot]:
    """Two default runs and a stopped exploration: 0.9 of the one-run allowance spent."""
    stopped = run(3, 256, 9, 10.0, status=TrialStatus.FAILED, reason=StopReason.PROJECTED_COST)
    return [*defaults(2), stopped]


def test_a_run_whose_finish_would_overdraw_the_budget_is_stopped() -> None:
    job = spec()
    # Three times the default's cost per epoch: the rest costs more than a fallback run.
    early = TrialSnapshot(4, 64, TrialPhase.EXPLORATION, epochs=2, cost=60.0, energy_j=60.0)
    verdict = BSO.on_epoch(snapshot(job, *overdrawn_lane(), early), early, 0.0)
    assert verdict.stop
    assert not verdict.converged
    assert verdict.reason is StopReason.EXPLORATION_BUDGET
    assert "exploration budget" in verdict.message


def test_a_run_nearly_done_is_not_stopped_since_stopping_costs_more() -> None:
    """At epoch 9 of about 10 the rest costs less than a fallback run, though finishing
    overdraws the budget too."""
    job = spec()
    late = TrialSnapshot(4, 64, TrialPhase.EXPLORATION, epochs=9, cost=270.0, energy_j=270.0)
    verdict = BSO.on_epoch(snapshot(job, *overdrawn_lane(), late), late, 0.0)
    assert verdict.reason is not StopReason.EXPLORATION_BUDGET


def test_a_run_long_past_its_predicted_epochs_is_stopped_once_overdrawn() -> None:
    """Ten epochs are typical; at 256, twice the default's cost per epoch, in a lane
    already over its allowance, a run at epoch 30 is told nearly done by the
    epoch model every epoch: it is stopped instead of running to max_epochs."""
    job = spec(beta_knob=None)  # nothing else would stop it
    over = run(3, 256, 12, 10.0, status=TrialStatus.FAILED, reason=StopReason.PROJECTED_COST)
    lane_trials = [*defaults(2), over]
    late = TrialSnapshot(4, 64, TrialPhase.EXPLORATION, epochs=30, cost=600.0, energy_j=600.0)
    verdict = BSO.on_epoch(snapshot(job, *lane_trials, late), late, 0.0)
    assert verdict.reason is StopReason.EXPLORATION_BUDGET


def test_a_run_is_not_bet_on_past_where_the_policy_would_stop_it() -> None:
    """At epoch 9, 10% dearer per epoch than the default, a run of 256 has used the
    one-run allowance: one more epoch would overdraw it if the run then stopped.
    The default's ten epochs say it is nearly done, and the budget alone would let
    it finish (converging, it replaces a default run).  But bso's overrun stop
    ends a larger size unconverged at 1.4 times the best's cost, about epoch 13,
    and the run is not 90% sure to converge by then: stopped later, it would cost
    its whole spend and a fallback run, so the budget stops it now."""
    job = spec()
    running = TrialSnapshot(9, 256, TrialPhase.EXPLORATION, epochs=9, cost=99.0, energy_j=99.0)
    lane = snapshot(job, *defaults(3), running)
    assert budget.budget_stop(lane, running) is None  # no ceiling: finishing fits
    assert BSO.cost_ceiling(lane, running) == pytest.approx(140.0)
    assert budget.budget_stop(lane, running, BSO.cost_ceiling(lane, running)) is not None
    verdict = BSO.on_epoch(lane, running, 0.0)
    assert verdict.reason is StopReason.EXPLORATION_BUDGET


def test_a_run_sure_to_converge_below_the_policy_s_ceiling_is_let_go_on() -> None:
    """The same run of 256 at epoch 9, 10% dearer per epoch, but its size converged
    here twice in ten epochs: it is all but sure to end before the overrun stop's
    ceiling, and finishing replaces a default run, so the budget lets it go on."""
    job = spec()
    measured = [*defaults(3), run(4, 256, 10, 10.5), run(5, 256, 10, 10.5)]
    running = TrialSnapshot(9, 256, TrialPhase.EXPLORATION, epochs=9, cost=99.0, energy_j=99.0)
    lane = snapshot(job, *measured, running)
    ceiling = BSO.cost_ceiling(lane, running)
    assert math.isfinite(ceiling)
    assert budget.budget_stop(lane, running, ceiling) is None
    assert not BSO.on_epoch(lane, running, 0.0).stop


def test_the_policy_s_ceiling_is_beta_knob_s_bound_but_for_explorations_at_or_above_the_best() -> (
    None
):
    job = spec(beta_knob=3.0)
    lane = snapshot(job, *defaults(3))
    smaller = TrialSnapshot(4, 64, TrialPhase.EXPLORATION, epochs=2, cost=30.0, energy_j=30.0)
    larger = TrialSnapshot(4, 256, TrialPhase.EXPLORATION, epochs=2, cost=16.0, energy_j=16.0)
    exploiting = dataclasses.replace(larger, phase=TrialPhase.EXPLOITATION)
    assert BSO.cost_ceiling(lane, smaller) == pytest.approx(300.0)
    assert BSO.cost_ceiling(lane, exploiting) == pytest.approx(300.0)
    assert BSO.cost_ceiling(lane, larger) == pytest.approx(140.0)
    assert BSO.cost_ceiling(snapshot(spec(beta_knob=None), *defaults(3)), smaller) == math.inf


def test_converges_by_counts_only_the_epochs_left_before_the_horizon() -> None:
    """Ten epochs are typical.  At epoch 8, with the policy stopping the run at a
    cost of 120 (12 epochs of 10), converging by epoch 12 is all it can do: more
    epochs than that add nothing, none at or below 8 give anything, and a run so
    far past its prediction that its tail underflows is not bet on."""
    trials = defaults(3)
    running = TrialSnapshot(4, 128, TrialPhase.EXPLORATION, epochs=8, cost=80.0)
    seen = budget.outlook([*trials, running], running, max_epochs=100, cost_ceiling=120.0)
    assert seen.horizon == pytest.approx(12.0)
    assert seen.converges_by(1000.0) == pytest.approx(seen.converges)
    assert 0.0 < seen.converges_by(10.0) < seen.converges_by(12.0) < 1.0
    assert seen.converges_by(8.0) == seen.converges_by(5.0) == 0.0
    far = TrialSnapshot(4, 128, TrialPhase.EXPLORATION, epochs=10**9, cost=10.0**10)
    gone = budget.outlook([*trials, far], far, max_epochs=10**10)
    assert gone.overran
    assert gone.converges_by(math.inf) == 0.0


def test_running_trials_at_other_sizes_give_concurrent_requests_no_room() -> None:
    """Three unsafe trials asked for at once: the first fits the one-run allowance;
    while it runs, it is not counted as having saved a default run already, and
    what it may still cost is kept from the others."""
    job = spec()
    trials: list[TrialSnapshot] = [*defaults(3)]
    given = []
    for number, wanted in ((4, 256), (5, 64), (6, 32)):
        assignment = within_budget(
            snapshot(job, *trials), Assignment(wanted, TrialPhase.EXPLORATION)
        )
        given.append(assignment.batch_size)
        trials.append(TrialSnapshot(number, assignment.batch_size, assignment.phase))
    assert given[0] == 256
    assert given[1:] == [128, 128]  # the default, not two more explorations


def test_the_default_is_never_stopped_for_the_budget() -> None:
    job = spec()
    default = TrialSnapshot(4, 128, TrialPhase.EXPLOITATION, epochs=2, cost=20.0, energy_j=20.0)
    verdict = BSO.on_epoch(snapshot(job, *overdrawn_lane(), default), default, 0.0)
    assert not verdict.stop


def test_the_outlook_of_a_run_past_its_median_is_a_short_rest() -> None:
    trials = defaults(3)
    young = TrialSnapshot(4, 128, TrialPhase.EXPLORATION, epochs=2, cost=20.0)
    old = TrialSnapshot(4, 128, TrialPhase.EXPLORATION, epochs=12, cost=120.0)
    assert budget.outlook([*trials, young], young, max_epochs=100).remaining_cost > 60.0
    assert budget.outlook([*trials, old], old, max_epochs=100).remaining_cost < 20.0


def test_the_outlook_counts_the_chance_of_reaching_max_epochs_first() -> None:
    """Ten epochs are typical: a run at epoch 12 of a job capped at 13 may still end
    unconverged; capped at 100, all but never; capped at 12, surely."""
    trials = defaults(3)
    old = TrialSnapshot(4, 128, TrialPhase.EXPLORATION, epochs=12, cost=120.0)
    capped = budget.outlook([*trials, old], old, max_epochs=13)
    free = budget.outlook([*trials, old], old, max_epochs=100)
    assert capped.converges < free.converges
    assert capped.remaining_cost <= 10.0 + 1e-9  # one epoch at most
    assert budget.outlook([*trials, old], old, max_epochs=12).converges == 0.0


# -- the spec -------------------------------------------------------------------------------


def test_the_budget_is_zero_or_a_usable_fraction() -> None:
    for refused in (-0.01, math.inf, 1e-310):  # 1 / 1e-310 recurrences is no number
        with pytest.raises(ValidationError, match="exploration_budget"):
            spec(refused)
    assert spec(0.0).exploration_budget == 0.0
    assert spec(1e-4).exploration_budget == 1e-4


def test_a_job_registered_before_the_budget_existed_keeps_its_fingerprint() -> None:
    """The fingerprint a spec without a budget had when the field did not exist
    (computed by the code before it, for this exact spec): a job id registered then
    must still match its relaunches."""
    assert spec(None).config_fingerprint() == (
        "5b3897fcdf38df1372253a0d512ac01acb84faa0ea8a5506c97fc22be3ef752d"
    )
    assert spec(0.02).config_fingerprint() != spec(None).config_fingerprint()


# -- over a job's life --------------------------------------------------------------------


def test_a_budgeted_job_ends_within_its_budget_where_the_default_is_best() -> None:
    """On a landscape whose optimum is the default, exploring can only lose: with a
    2% budget, 50 recurrences end within 3% of always-default (2% and the noise of
    the default's estimated cost), where the unbudgeted policy is free to overspend."""
    workload = next(w for w in landscape_workloads() if w.oracle(0.5)[0] == w.default_batch_size)
    world = make_world(workload, 50, seed=1)
    default = replay_fixed(world, workload.default_batch_size, 0.5, "default").total_cost
    budgeted = replay_policy(
        world, "bso", eta_knob=0.5, beta_knob=2.0, seed=1, exploration_budget=0.02
    )
    assert budgeted.total_cost <= 1.03 * default
    stops = [size for r in budgeted.recurrences for size in r.sizes[:-1]]
    assert len(stops) <= 5, "a few explorations stopped, not one a recurrence"


def test_a_budget_of_zero_always_runs_the_default() -> None:
    """No size is known cheaper, and an untried one may cost more: a zero budget
    never pays for finding out (without a budget, the same lane explores)."""
    assert {t.batch_size for t in _replay_lane(spec(0.0), recurrences=6)} == {128}
    assert len({t.batch_size for t in _replay_lane(spec(None), recurrences=6)}) > 1


def _replay_lane(job: JobSpec, recurrences: int) -> list[TrialSnapshot]:
    """Recurrences on a lane where every size needs 10 epochs at 10 a epoch."""
    rng = np.random.default_rng(0)
    trials: list[TrialSnapshot] = []
    for _ in range(recurrences):
        assignment = BSO.assign(snapshot(job, *trials), rng)
        trials.append(run(len(trials) + 1, assignment.batch_size, 10, 10.0))
    return trials


def test_the_outlook_of_a_size_another_lane_ran_follows_that_lanes_epochs() -> None:
    """128 converges in ten epochs here; 256 was never run on this lane, but another
    GPU needed 30 epochs at it: at epoch 5, the run is predicted to need about 25
    more, not the handful its neighbour would say."""
    trials = defaults(3)
    running = TrialSnapshot(4, 256, TrialPhase.EXPLORATION, epochs=5, cost=25.0)
    guess = EpochGuess(math.log(30.0), 0.1, 0.1)
    known = budget.outlook([*trials, running], running, max_epochs=100, other_lane=guess)
    unknown = budget.outlook([*trials, running], running, max_epochs=100)
    assert known.remaining_cost == pytest.approx(25 * 5.0, rel=0.1)
    assert unknown.remaining_cost < 0.5 * known.remaining_cost
