"""bso's own policy: cheaper exploration than Zeus, then confident exploitation.

Where Zeus spends money, and what this policy does instead:

* Zeus explores every size down from the default until one fails, then every
  size up, and repeats that for ``num_pruning_rounds``.  Cost is usually
  unimodal in batch size, so this policy walks from the cheapest size known so
  far toward its untried neighbours and ends a direction at the first size that
  is clearly worse, judged against the job's epoch noise.  The walk is re-run
  on every request, so when exploitation moves the best size, the walk
  follows it.  It tries the larger neighbour first: epochs to target do not
  fall as the batch grows, so a wrong upward probe is exposed after one epoch,
  while a wrong downward one runs for several.
* On a job's new lane, the walk's end is not the end: a size the other lanes
  converged at gets one epoch, which tells its cost here, when their curve says
  it may well win (:func:`~bso.core.transfer.one_epoch_look`).
* A run's per-epoch cost is known after one epoch; only the number of epochs
  is noisy.  A size that is cheaper per epoch than the best lost on that noisy
  part, so it is measured again before the walk gives up on it.
* An exploration is stopped (``projected_cost``) when, by an optimistic bound
  on its epochs, finishing it costs more than a fresh run of the best size, or
  once it has overrun that bound: a larger size when it is already well above
  the best (past the critical batch size epochs grow without a useful bound),
  a smaller size when the epochs it is predicted to still need cost more than
  a fresh run of the best (epochs do not rise as the batch shrinks, so it is
  likely near its end).  A run that is merely likely worse is finished: its
  sunk cost is spent, and the rest is cheaper than starting over.
* A stop is a projection, so it is not final: a size only ever stopped keeps
  a predictive cost (its measured cost per epoch times a neighbour's epochs,
  or the epochs the job's other lanes measured at it, with the guess's
  uncertainty) and takes part in exploitation's Thompson
  draw; when drawn it is revisited, and the revisit runs unless the
  ``beta_knob`` bound stops it (Zeus and the first version of this policy
  pruned it for good: imagenet 360, cheaper than the default, never came back).
* ``beta_knob`` multiplies the best size's mean cost, not its luckiest run, so
  noisy epochs do not get the best size's own runs stopped.
* Zeus's Thompson sampling estimates each size's noise from its own two or
  three samples and keeps paying for near-ties and losers.  Here noise is
  relative and pooled over sizes, and sizes clearly worse than the best are
  not sampled at all.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from bso.core import bandit, gaussian
from bso.core.epoch_predictions import (
    epochs_to_target,
    least_epochs,
    plausible_low,
    revisit_guesses,
)
from bso.core.outcomes import CENSORING_REASONS
from bso.core.policy import (
    CONTINUE,
    MAX_CONSECUTIVE_FAILURES,
    Assignment,
    Policy,
    Verdict,
    arm_observations,
    concurrent,
    drop_repeatedly_failing,
    exploration_trials,
    failure_multiple,
)
from bso.core.size_evidence import SizeEvidence, cost_cv, gather_evidence
from bso.core.state import JobSnapshot, TrialSnapshot
from bso.core.transfer import one_epoch_look, prior_says_worse
from bso.core.vocabulary import StopReason, TrialPhase
from bso.errors import NoFeasibleBatchSize

# How many standard errors of the cost difference a neighbour must be above the
# best before the walk calls it worse: one noisy run must not end a walk.
WALK_Z = 1.0
# A size that was only ever stopped for cost gets this many tries before the
# walk gives up on it: a single unlucky draw of epochs ends runs early too.
MAX_CENSORED_TRIES = 2
# Runs a size that is cheaper per epoch than the best gets before the walk
# calls it worse.
FASTER_SIZE_TRIES = 2
# ...provided its mean is within this many standard errors of epoch noise of
# the best: a size twice as expensive did not lose to an unlucky draw.
RETRY_Z = 3.0
# An exploration of a larger size that has used up its optimistic epochs is
# stopped once its cost is this fraction above the best.  Below that, finishing
# is likely cheaper than a restart; above it, the run is far off its bound and
# may run on to the beta_knob limit (2x the best by default).  (A smaller size
# is judged on its predicted remaining epochs instead: finishing_costs_more.)
OVERRUN_SLACK = 0.4
# An upward exploration is stopped after its first epoch unless its optimistic
# cost is at least this fraction below the best.  Epochs do not shrink as the
# batch grows, so an upward size can only win by its per-epoch saving; a saving
# this small is within epoch noise, and a larger batch that is not clearly
# cheaper per epoch tends to need many more epochs (cifar100 2048: 2x to 4x).
MIN_UPWARD_GAIN = 0.05
# Sizes whose mean cost is this much above the best are not sampled any more.
EXPLOIT_MARGIN = 0.2


def cheapest_converged(evidence: dict[int, SizeEvidence]) -> tuple[int, float]:
    """The converged size of lowest mean cost (ties: the smaller) and that mean: the
    best that :meth:`BsoPolicy.early_stop` and its cost ceiling judge a run by.
    Needs a converged size."""
    converged = {b: e for b, e in evidence.items() if e.epochs}
    best_size = min(converged, key=lambda b: (converged[b].mean_cost, b))
    return best_size, converged[best_size].mean_cost


class BsoPolicy(Policy):
    name = "bso"

    def exploration(
        self, snapshot: JobSnapshot, evidence: dict[int, SizeEvidence]
    ) -> Assignment | None:
        """Next size to explore, or None once the walk is over."""
        sizes = snapshot.candidate_sizes
        start_size = snapshot.exploration_start
        assert start_size is not None, "Policy.assign refuses a lane without candidates"
        if any(t.running for ts in exploration_trials(snapshot).values() for t in ts):
            return concurrent(snapshot)
        if not evidence[start_size].tried:
            return Assignment(start_size, TrialPhase.EXPLORATION)

        converged = {b: e for b, e in evidence.items() if e.epochs}
        if not converged:
            # Nothing converged yet: look for any working size near the default.
            start = sizes.index(start_size)
            for step in (-1, 1):
                index = start + step
                while 0 <= index < len(sizes) and not evidence[sizes[index]].hard_failures:
                    if not evidence[sizes[index]].tried:
                        return Assignment(sizes[index], TrialPhase.EXPLORATION)
                    index += step
            return None

        best_size = min(
            converged, key=lambda b: (converged[b].mean_cost, snapshot.default_distance(b), b)
        )
        best = converged[best_size]
        cv = cost_cv(converged)
        start = sizes.index(best_size)
        # Upward first: a wrong upward probe is stopped after one epoch
        # (MIN_UPWARD_GAIN), a wrong downward one runs on for several.
        for step in (1, -1):
            index = start + step
            while 0 <= index < len(sizes):
                b = sizes[index]
                e = evidence[b]
                if not e.tried:
                    if prior_says_worse(snapshot, b, best_size):
                        break  # another lane's curve: clearly worse here too
                    return Assignment(b, TrialPhase.EXPLORATION)
                if e.hard_failures and not e.epochs:
                    break
                if self.clearly_worse(e, best, cv):
                    if self.worth_remeasuring(e, best, cv):
                        return Assignment(b, TrialPhase.EXPLORATION)
                    break
                if not e.epochs:
                    # Stopped for cost, yet still in reach of the best: the draw of
                    # epochs may have been unlucky, so try again.
                    if e.tries >= MAX_CENSORED_TRIES or not e.epoch_count_mattered:
                        break
                    return Assignment(b, TrialPhase.EXPLORATION)
                index += step
        # Past where the walk ends: a size another GPU's curve says may well win.
        look = one_epoch_look(snapshot, evidence)
        return None if look is None else Assignment(look, TrialPhase.EXPLORATION)

    @staticmethod
    def clearly_worse(e: SizeEvidence, best: SizeEvidence, cv: float) -> bool:
        """More than ``WALK_Z`` standard errors of epoch noise above the best.

        A size with only stopped runs is judged on its lower bound: it needed
        more epochs than its longest run had.
        """
        if e.epochs:
            spread = cv * math.sqrt(1 / len(e.epochs) + 1 / len(best.epochs))
            return e.mean_cost > best.mean_cost * (1 + WALK_Z * spread)
        spread = cv * math.sqrt(1 + 1 / len(best.epochs))
        return e.epoch_cost * e.proven_epochs > best.mean_cost * (1 + WALK_Z * spread)

    @staticmethod
    def worth_remeasuring(e: SizeEvidence, best: SizeEvidence, cv: float) -> bool:
        """A worse-looking size that lost on the noisy epoch count, not on speed.

        It must be cheaper per epoch than the best, have had fewer than
        ``FASTER_SIZE_TRIES`` runs, and, if it converged, be within ``RETRY_Z``
        standard errors of the best.  A run stopped for cost says too little about
        the size's mean to rule a retry out.
        """
        if e.epoch_cost >= best.epoch_cost or e.tries >= FASTER_SIZE_TRIES:
            return False
        if not e.epochs:
            return e.epoch_count_mattered
        return e.mean_cost * (1 - RETRY_Z * cv / math.sqrt(len(e.epochs))) < best.mean_cost

    def next_trial(self, snapshot: JobSnapshot, rng: np.random.Generator) -> Assignment:
        evidence = gather_evidence(snapshot)
        assignment = self.exploration(snapshot, evidence)
        if assignment is not None:
            return assignment
        means = snapshot.mean_costs()
        arms = drop_repeatedly_failing(snapshot, sorted(means))
        if not arms and means:
            raise NoFeasibleBatchSize(
                f"every batch size that converged has failed its last "
                f"{MAX_CONSECUTIVE_FAILURES} runs since (did the model, its data or the "
                "target change?)"
            )
        if not arms:
            raise NoFeasibleBatchSize("no batch size converged")
        best = min(means[b] for b in arms)
        arms = [b for b in arms if means[b] <= best * (1 + EXPLOIT_MARGIN)]
        # A run stopped for cost was cut short on a projection; arm_observations
        # would charge it the failure penalty (2x the best) and push exploitation
        # off a size that was merely unlucky once (imagenet 256 -> 192 for good).
        measured = dataclasses.replace(
            snapshot,
            trials=tuple(t for t in snapshot.trials if t.stop_reason not in CENSORING_REASONS),
        )
        predicted = {
            b: guess
            for b, guess in revisit_guesses(evidence).items()
            if math.exp(plausible_low(guess, evidence[b])) <= best * (1 + EXPLOIT_MARGIN)
        }
        choice = bandit.pooled_thompson_pick(
            arm_observations(measured, arms), rng, snapshot.default_distance, predicted
        )
        if choice in predicted:
            return Assignment(choice, TrialPhase.EXPLORATION)
        return Assignment(choice, TrialPhase.EXPLOITATION)

    def cost_bound_base(self, snapshot: JobSnapshot) -> float | None:
        """The best size's mean cost, not its luckiest run.

        With noisy epochs the cheapest single run sits well below what the best
        size costs on average (noise 0.25: a third lower), so ``beta_knob`` times
        it stops typical runs of the best size itself and makes the job pay twice.
        """
        return snapshot.best_mean_cost

    def early_stop(self, snapshot: JobSnapshot, trial: TrialSnapshot) -> Verdict:
        """Stop an exploration once finishing it is a worse deal than a fresh best run.

        All tests start from the optimistic epoch bound of
        :func:`~bso.core.epoch_predictions.least_epochs`:

        * the least it can still cost exceeds a full run of the best size: a
          restart is cheaper whatever the run's sunk cost;
        * it has used up its optimistic epochs and, if it is larger than the
          best size, already costs more than ``1 + OVERRUN_SLACK`` times the
          best: past the critical batch size epochs grow without a useful bound,
          so how many such a run still needs is anyone's guess; if it is
          smaller, finishing it is expected to cost more than a fresh run of the
          best (:meth:`finishing_costs_more`): epochs do not rise as the batch
          shrinks, so a smaller size that overran is predicted to end near its
          neighbour's epochs, and cutting it there paid for most of a run and
          learnt only a bound (imagenet 192 and 128, stopped at 1.3x the best
          and then a full run more: docs/benchmarks.md);
        * it is larger than the best size and, after its first epoch, even at its
          bound saves less than ``MIN_UPWARD_GAIN``: its only edge is a per-epoch
          saving that epoch noise would swallow.  Later epochs are sunk cost, so
          the rule does not cut a run one epoch from the target.

        Otherwise the run goes on even if it is likely worse, since its sunk cost
        is spent and finishing it is cheaper than starting over.  (Stopping on
        the total instead, as an earlier version did, cut short runs one epoch
        from the target and threw away sizes that were only unlucky.)
        """
        if trial.phase is not TrialPhase.EXPLORATION or trial.epochs == 0:
            return CONTINUE
        evidence = gather_evidence(snapshot)
        if trial.batch_size not in evidence:
            # No longer a candidate here (another run of it ran out of memory
            # meanwhile): no projection to judge it by; the beta_knob bound still holds.
            return CONTINUE
        if evidence[trial.batch_size].only_stopped:
            # A revisit of a size stopped on a projection checks that projection:
            # cutting it on the same projection would learn nothing, so only the
            # beta_knob bound stops it.
            return CONTINUE
        least = least_epochs(evidence, trial.batch_size)
        if least is None:
            return CONTINUE
        best_size, best_cost = cheapest_converged(evidence)
        per_epoch = trial.cost / trial.epochs
        least_total = per_epoch * max(least, trial.epochs + 1)
        restart_cheaper = per_epoch * max(1.0, least - trial.epochs) > best_cost
        no_upward_gain = (
            trial.batch_size > best_size
            and trial.epochs == 1
            and trial.epochs < least
            and least_total > best_cost * (1 - MIN_UPWARD_GAIN)
        )
        if (
            restart_cheaper
            or no_upward_gain
            or (
                trial.epochs >= least
                and trial.batch_size >= best_size
                and least_total > best_cost * (1 + OVERRUN_SLACK)
            )
        ):
            return Verdict(
                True,
                False,
                StopReason.PROJECTED_COST,
                f"batch size {trial.batch_size} cannot beat {best_size}: it would cost at least "
                f"{least_total:.4g} in all (best {best_cost:.4g})",
            )
        if (
            trial.epochs >= least
            and trial.batch_size < best_size
            and self.finishing_costs_more(snapshot, evidence, trial)
        ):
            return Verdict(
                True,
                False,
                StopReason.PROJECTED_COST,
                f"batch size {trial.batch_size} overran its fewest plausible epochs "
                f"({least:.3g}): the epochs it likely still needs cost more than a "
                f"fresh run of {best_size} ({best_cost:.4g})",
            )
        return CONTINUE

    def cost_ceiling(self, snapshot: JobSnapshot, trial: TrialSnapshot) -> float:
        """The ``beta_knob`` bound, and for an exploration of a size at or above the
        best its overrun stop: once past its optimistic epochs (which a run still
        going at this ceiling is), :meth:`early_stop` ends it when it costs more
        than ``1 + OVERRUN_SLACK`` times the best."""
        ceiling = super().cost_ceiling(snapshot, trial)
        if trial.phase is not TrialPhase.EXPLORATION:
            return ceiling
        evidence = gather_evidence(snapshot)
        own = evidence.get(trial.batch_size)
        if own is None or own.only_stopped or not any(e.epochs for e in evidence.values()):
            return ceiling
        best_size, best_cost = cheapest_converged(evidence)
        if trial.batch_size < best_size:
            return ceiling
        return min(ceiling, (1 + OVERRUN_SLACK) * best_cost)

    def finishing_costs_more(
        self, snapshot: JobSnapshot, evidence: dict[int, SizeEvidence], trial: TrialSnapshot
    ) -> bool:
        """Whether finishing the run is expected to cost more than a fresh run of the best.

        The run has not reached the target after ``trial.epochs`` epochs.  Its
        epochs to target are predicted log-normal
        (:func:`~bso.core.epoch_predictions.epochs_to_target`), conditioned on
        having passed ``trial.epochs``.  (The revisit guess of
        :func:`~bso.core.epoch_predictions.revisit_guesses` is deliberately more hopeful for
        a size that was only ever stopped: its median is the neighbour's epochs,
        and its spread grows with the square root of the doublings.)  Finishing
        costs the epochs still to run, up to the ``beta_knob`` bound (or,
        without one, the failure penalty exploitation charges:
        :func:`~bso.core.policy.failure_multiple`), past which the run is
        stopped and a run of the best is still owed.  The log-normal's
        tail is thin, so near its neighbour's epochs a run is predicted nearly
        done: a smaller size that never converges is in practice ended by that
        bound (2x the best by default, against the larger sizes' 1.4x).
        """
        centre, spread = epochs_to_target(evidence, trial.batch_size)
        per_epoch = trial.cost / trial.epochs
        best_cost = self.cost_bound_base(snapshot)
        if per_epoch <= 0 or not best_cost:
            return False  # nothing measured (eta_knob=1 without energy): finishing is free
        # Without beta_knob nothing else would end a run that never converges: count
        # one as failed at the penalty exploitation charges a failure.
        cap = failure_multiple(snapshot.spec) * best_cost / per_epoch
        ran = float(trial.epochs)
        if cap <= ran:
            return False  # the beta_knob bound decides
        surviving = gaussian.lognormal_survival(centre, spread, ran)
        beyond_cap = gaussian.lognormal_survival(centre, spread, cap)
        owed = beyond_cap / surviving if surviving > 0 else 0.0
        remaining = gaussian.lognormal_remaining(centre, spread, ran, cap) * per_epoch
        return remaining + owed * best_cost > best_cost
