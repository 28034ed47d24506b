"""Zeus's policy: pruning rounds, then Gaussian Thompson sampling; the baseline to beat.

It follows Zeus's batch size optimizer: explore down from the default until a
size fails, then up, for ``num_pruning_rounds``; then Thompson sampling over
the survivors with each size's own variance (:func:`bso.core.bandit.zeus_thompson_pick`).
"""

from __future__ import annotations

import math

import numpy as np

from bso.core import bandit
from bso.core.policy import (
    Assignment,
    Policy,
    arm_observations,
    concurrent,
    drop_repeatedly_failing,
    exploration_trials,
)
from bso.core.state import JobSnapshot
from bso.core.vocabulary import TrialPhase
from bso.errors import NoFeasibleBatchSize


class ZeusPolicy(Policy):
    """Zeus's pruning + Gaussian Thompson sampling, as the baseline to beat."""

    name = "zeus"

    def pruning(self, snapshot: JobSnapshot) -> Assignment | list[int]:
        """Next exploration, or the sizes that survived every pruning round."""
        spec = snapshot.spec
        explored = exploration_trials(snapshot)
        candidates = snapshot.candidate_sizes
        pivot = snapshot.start_batch_size
        assert pivot is not None, "Policy.assign refuses a lane without candidates"
        for round_index in range(spec.num_pruning_rounds):
            survivors: list[int] = []
            best_cost, best_size = math.inf, pivot
            down = sorted((b for b in candidates if b <= pivot), reverse=True)
            up = sorted(b for b in candidates if b > pivot)
            for direction in (down, up):
                for b in direction:
                    history = explored.get(b, [])
                    if len(history) <= round_index:
                        return Assignment(b, TrialPhase.EXPLORATION)
                    trial = history[round_index]
                    if trial.running:
                        return concurrent(snapshot)
                    if not trial.converged:
                        break
                    survivors.append(b)
                    if trial.cost < best_cost:
                        best_cost, best_size = trial.cost, b
            if not survivors:
                raise NoFeasibleBatchSize("no batch size converged during pruning")
            candidates, pivot = sorted(survivors), best_size
        return candidates

    def next_trial(self, snapshot: JobSnapshot, rng: np.random.Generator) -> Assignment:
        outcome = self.pruning(snapshot)
        if isinstance(outcome, Assignment):
            return outcome
        arms = drop_repeatedly_failing(snapshot, outcome)
        if not arms:
            raise NoFeasibleBatchSize("every surviving batch size kept failing")
        spec = snapshot.spec
        choice = bandit.zeus_thompson_pick(
            arm_observations(snapshot, arms),
            prior_mean=spec.mab_prior_mean,
            prior_precision=spec.mab_prior_precision,
            num_explorations=spec.mab_num_explorations,
            rng=rng,
        )
        return Assignment(choice, TrialPhase.EXPLOITATION)
