"""What the finished trials of a lane say about each batch size, for the bso policy.

A run's cost is its cost per epoch (close to fixed for a size on given
hardware, known after one epoch) times its epochs to target (noisy): the
evidence keeps the two apart, and splits the runs by what they prove about the
epochs (converged: this many; stopped for cost: more than this many; failed
hard: maybe never).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass

from bso.core import bandit
from bso.core.outcomes import CENSORING_REASONS
from bso.core.state import EpochFloor, EpochGuess, JobSnapshot

EPOCHS_STEP_SD = 0.3
"""Prior standard deviation of the change of log epochs-to-target per doubling of
the batch: from no change (perfect scaling) to a third more or less epochs.  Both
bso's walk (:mod:`bso.core.bso_policy`) and the budget's outlook of a running
trial (:mod:`bso.core.budget`) predict a size's epochs from a neighbour's with it."""


@dataclass(frozen=True, slots=True)
class SizeEvidence:
    """What the finished trials of one batch size say about it."""

    epoch_cost: float
    """Cost of one epoch (deterministic for a size); inf before any epoch was reported."""
    epochs: tuple[int, ...]
    """Epochs of each converged run."""
    censored: tuple[int, ...]
    """Epochs of each run stopped for cost: the size needed more than that."""
    hard_failures: int
    """Runs that crashed or hit ``max_epochs``: the size may not work at all."""
    other_lane: EpochGuess | None = None
    """What the job's other lanes say of its epochs to target (:mod:`bso.core.transfer`)."""
    other_lane_floor: EpochFloor | None = None
    """The epochs the job's other lanes' runs of it that bso stopped proved it needs."""

    @property
    def tried(self) -> bool:
        return bool(self.epochs or self.censored or self.hard_failures)

    @property
    def epoch_count_mattered(self) -> bool:
        """Whether a stop of this size depended on the noisy number of epochs.

        A run stopped after its first epoch was judged on its per-epoch cost
        alone, which is deterministic: running it again would end the same way.
        """
        return any(epochs > 1 for epochs in self.censored)

    @property
    def proven_epochs(self) -> int:
        """Fewest epochs the size can need by its stopped runs: one more than the longest."""
        return max(self.censored, default=0) + 1

    @property
    def tries(self) -> int:
        return len(self.epochs) + len(self.censored) + self.hard_failures

    @property
    def only_stopped(self) -> bool:
        """Stopped by bso and never converged: what is known of it is a projection."""
        return bool(self.censored) and not self.epochs

    @property
    def mean_cost(self) -> float:
        return self.epoch_cost * statistics.fmean(self.epochs) if self.epochs else math.inf


def gather_evidence(snapshot: JobSnapshot) -> dict[int, SizeEvidence]:
    """Evidence for every configured size, tried or not."""
    per_epoch: dict[int, list[float]] = {}
    epochs: dict[int, list[int]] = {}
    censored: dict[int, list[int]] = {}
    hard: dict[int, int] = {}
    for t in snapshot.trials:
        if t.epochs > 0:
            per_epoch.setdefault(t.batch_size, []).append(t.cost / t.epochs)
        if t.running:
            continue
        if t.converged:
            epochs.setdefault(t.batch_size, []).append(t.epochs)
        elif t.stop_reason in CENSORING_REASONS:
            censored.setdefault(t.batch_size, []).append(t.epochs)
        else:
            hard[t.batch_size] = hard.get(t.batch_size, 0) + 1
    return {
        b: SizeEvidence(
            statistics.fmean(per_epoch[b]) if b in per_epoch else math.inf,
            tuple(epochs.get(b, ())),
            tuple(censored.get(b, ())),
            hard.get(b, 0),
            snapshot.other_lanes_epochs.get(b),
            snapshot.other_lanes_floors.get(b),
        )
        for b in snapshot.candidate_sizes
    }


def nearest(sizes: Iterable[int], batch_size: int) -> int:
    """The size closest to ``batch_size`` along log batch size."""
    return min(sizes, key=lambda b: abs(math.log(b / batch_size)))


def cost_cv(converged: dict[int, SizeEvidence]) -> float:
    """Relative run-to-run noise of cost, pooled over sizes (it is all epoch noise)."""
    return bandit.pooled_cost_cv(
        {b: [e.epoch_cost * n for n in e.epochs] for b, e in converged.items()}
    )
