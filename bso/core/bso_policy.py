"""bso's own policy: cheaper exploration than Zeus, then confident exploitation.

Where Zeus spends money, and what this policy does instead:

* Zeus explores every size down from the default until one fails, then every
  size up, and repeats that for ``num_pruning_rounds``.  Cost is usually
  unimodal in batch size, so this policy walks from the default toward cheaper
  neighbours and stops a direction at the first size that is worse; the other
  direction is walked only when the first step down did not improve.
* A run's per-epoch cost is known after one epoch.  With the epochs the
  nearest measured size needed, an exploration that would cost more to finish
  than a fresh run of the best size is stopped at once (``projected_cost``).
* Zeus's Thompson sampling estimates each size's noise from its own two or
  three samples and keeps paying for near-ties and losers.  Here noise is
  relative and pooled over sizes, and sizes clearly worse than the best are
  not sampled at all.
"""

from __future__ import annotations

import math

import numpy as np

from bso.core import bandit
from bso.core.policy import (
    CONTINUE,
    Assignment,
    Policy,
    Verdict,
    arm_observations,
    concurrent,
    drop_repeatedly_failing,
    exploration_trials,
)
from bso.core.state import JobSnapshot, TrialSnapshot
from bso.errors import NoFeasibleBatchSize
from bso.events import StopReason, TrialPhase

# A neighbour whose cost is within this fraction of the best still counts as
# "not worse", so the walk goes on through noisy plateaus.
WALK_TOLERANCE = 0.12
# "Cheaper per epoch" means at least this much cheaper.
CHEAPER_EPOCH = 0.97
# Slack on the optimistic bound before an exploration is called provably worse.
PROVABLY_WORSE_SLACK = 0.05
# Sizes whose mean cost is this much above the best are not sampled any more.
EXPLOIT_MARGIN = 0.2


class BsoPolicy(Policy):
    name = "bso"

    def exploration(self, snapshot: JobSnapshot) -> Assignment | None:
        """Next size to explore, or None once the walk is over."""
        spec = snapshot.spec
        sizes = spec.batch_sizes
        explored = exploration_trials(snapshot)
        if any(t.running for ts in explored.values() for t in ts):
            return concurrent(snapshot)

        finished: dict[int, list[TrialSnapshot]] = {}
        for t in snapshot.trials:
            if not t.running:
                finished.setdefault(t.batch_size, []).append(t)

        def outcome(b: int) -> float | None:
            """Mean converged cost of ``b`` (any phase); inf if it only failed; None if untried.

            Exploitation runs count too, so a walk that stopped on one unlucky
            sample reopens once Thompson sampling has measured that size again.
            """
            history = finished.get(b)
            if not history:
                return None
            costs = [t.cost for t in history if t.converged]
            return float(np.mean(costs)) if costs else math.inf

        def epoch_cost(b: int) -> float:
            return float(np.mean([t.cost / t.epochs for t in finished[b] if t.epochs > 0] or [math.inf]))

        def hard_failure(b: int) -> bool:
            """Never converged, and not merely stopped for being provably worse."""
            history = finished.get(b, [])
            return not any(t.converged for t in history) and any(
                t.stop_reason is not StopReason.PROJECTED_COST for t in history
            )

        start = sizes.index(spec.default_batch_size)
        base = outcome(sizes[start])
        if base is None:
            return Assignment(sizes[start], TrialPhase.EXPLORATION)

        first_step_improved = False
        for step in (-1, 1):
            if step == 1 and first_step_improved:
                break  # unimodal: the minimum lies below the default
            best, best_size, missed = base, sizes[start], False
            index = start + step
            while 0 <= index < len(sizes):
                b = sizes[index]
                cost = outcome(b)
                if cost is None:
                    return Assignment(b, TrialPhase.EXPLORATION)
                if hard_failure(b):
                    break
                if cost > best * (1 + WALK_TOLERANCE):
                    # One miss is forgiven when the size is cheaper per epoch than
                    # the best: it lost on the (noisy) epoch count, not on speed.
                    if missed or epoch_cost(b) >= epoch_cost(best_size) * CHEAPER_EPOCH:
                        break
                    missed = True
                else:
                    if step == -1 and index == start - 1 and cost < base:
                        first_step_improved = True
                    if cost < best:
                        best, best_size = cost, b
                    missed = False
                index += step
        return None

    def next_trial(self, snapshot: JobSnapshot, rng: np.random.Generator) -> Assignment:
        assignment = self.exploration(snapshot)
        if assignment is not None:
            return assignment
        means = snapshot.mean_costs()
        arms = drop_repeatedly_failing(snapshot, sorted(means))
        if not arms:
            raise NoFeasibleBatchSize(
                "no batch size converged; reconfigure batch_sizes (or max_epochs / "
                "target_metric) and relaunch"
            )
        best = min(means[b] for b in arms)
        arms = [b for b in arms if means[b] <= best * (1 + EXPLOIT_MARGIN)]
        choice = bandit.pooled_thompson_pick(arm_observations(snapshot, arms), rng)
        return Assignment(choice, TrialPhase.EXPLOITATION)

    def early_stop(self, snapshot: JobSnapshot, trial: TrialSnapshot) -> Verdict:
        if trial.phase is not TrialPhase.EXPLORATION or trial.epochs == 0:
            return CONTINUE
        means = snapshot.mean_costs()
        if not means:
            return CONTINUE
        best_size = min(means, key=lambda b: means[b])
        best_cost = means[best_size]
        expected_epochs = self.expected_epochs(snapshot, trial.batch_size)
        if expected_epochs is None:
            return CONTINUE
        per_epoch = trial.cost / trial.epochs
        least_total = per_epoch * max(expected_epochs, trial.epochs + 1)
        least_remaining = per_epoch * max(1.0, expected_epochs - trial.epochs)
        if least_total > best_cost * (1 + PROVABLY_WORSE_SLACK) or least_remaining > best_cost:
            return Verdict(
                True,
                False,
                StopReason.PROJECTED_COST,
                f"batch size {trial.batch_size} cannot beat {best_size}: it would cost at least "
                f"{least_total:.4g} in all (best {best_cost:.4g})",
            )
        return CONTINUE

    @staticmethod
    def expected_epochs(snapshot: JobSnapshot, batch_size: int) -> float | None:
        """Fewest epochs ``batch_size`` plausibly needs, from the nearest converged size.

        Epochs to target do not shrink with larger batches and at most halve when
        the batch halves (steps per epoch double), so this is an optimistic bound:
        a run stopped on it could not have been a bargain.
        """
        epochs: dict[int, list[int]] = {}
        for t in snapshot.trials:
            if t.converged:
                epochs.setdefault(t.batch_size, []).append(t.epochs)
        if not epochs:
            return None
        ref = min(epochs, key=lambda b: abs(math.log(b / batch_size)))
        ref_epochs = float(np.mean(epochs[ref]))
        return ref_epochs * min(1.0, batch_size / ref)
