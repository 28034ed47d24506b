"""Frozen snapshots of job state handed to the policies."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from bso.core.cost import cost
from bso.core.micro_batch import KEPT_RUNS, Timings, merge_timings
from bso.core.vocabulary import StopReason, TrialPhase, TrialStatus
from bso.spec import Hardware, JobSpec


@dataclass(frozen=True, slots=True)
class TrialSnapshot:
    """One trial as the core sees it: cumulative figures of its last report."""

    trial_number: int
    batch_size: int
    phase: TrialPhase
    status: TrialStatus = TrialStatus.RUNNING
    epochs: int = 0
    time_s: float = 0.0
    energy_j: float = 0.0
    cost: float = 0.0
    stop_reason: StopReason | None = None
    grown_to: int | None = None
    """The size online growth took the trial to (its last epoch's); None: it never grew."""
    detached: bool = False
    """Trained while the service was unreachable, delivered afterwards: bso could not
    stop it, so its cost is the whole run's (up to the epoch that reached the target)."""
    micro_batches: tuple[tuple[int, Timings], ...] = ()
    """The micro-batch exploration at the start of the run (:mod:`bso.core.micro_batch`):
    each candidate it timed at :attr:`batch_size`, with its counted steps."""

    @property
    def largest_size_run(self) -> int:
        """The largest batch the trial ran: what its running out of memory says about."""
        return self.grown_to or self.batch_size

    @property
    def converged(self) -> bool:
        return self.status is TrialStatus.CONVERGED

    @property
    def failed(self) -> bool:
        return self.status is TrialStatus.FAILED

    @property
    def running(self) -> bool:
        return self.status is TrialStatus.RUNNING

    @property
    def interrupted(self) -> bool:
        return self.status is TrialStatus.INTERRUPTED

    @property
    def out_of_memory(self) -> bool:
        return self.stop_reason is StopReason.OUT_OF_MEMORY


@dataclass(frozen=True, slots=True)
class EpochGuess:
    """What other lanes' converged runs of a size say of its epochs to target here."""

    log_mean: float
    """Mean log epochs of the other lanes' converged runs of the size."""
    log_sd: float
    """How far this lane's mean log epochs of the size may be from it: the other
    lanes' run-to-run noise over their runs, and how far lanes differ
    (:func:`bso.core.transfer.lane_epochs_sd`)."""
    noise: float
    """Run-to-run noise of one run's log epochs, pooled over the sizes and lanes of
    the job: like the epochs, a property of the optimisation."""

    @property
    def run_log_sd(self) -> float:
        """How far one run's log epochs here may be from :attr:`log_mean`: its own
        noise and the uncertainty of the guess."""
        return math.hypot(self.noise, self.log_sd)


@dataclass(frozen=True, slots=True)
class EpochFloor:
    """What other lanes' runs of a size that bso stopped for cost say of its epochs
    to target here: each ran that many epochs short of the target, and epochs belong
    to the optimisation, not to the GPU."""

    epochs: int
    """One more than the longest such run: the fewest epochs it proved the size needs."""
    log_sd: float
    """How far one run's log epochs here may fall from a run's there: run-to-run
    noise and how far lanes differ (:func:`bso.core.transfer.lane_epochs_sd`)."""


@dataclass(frozen=True, slots=True)
class LanePrior:
    """What another lane of the job learned, as a new lane starts from it."""

    start: int
    """Where this lane's walk starts: the other lane's recommendation, moved to this
    lane's nearest candidate."""
    relative_costs: Mapping[int, float]
    """The other lane's mean cost per size it converged at, over its cheapest mean:
    the shape of its cost curve."""
    log_sd: float
    """How far (log scale, per doubling of the batch between two sizes) this lane's
    cost ratios may be from the other lane's (:func:`bso.core.transfer.shape_noise`)."""


@dataclass(frozen=True, slots=True)
class JobSnapshot:
    """Everything a policy may read about one job on one hardware configuration."""

    spec: JobSpec
    hardware: Hardware
    trials: tuple[TrialSnapshot, ...] = ()
    """Trials of this hardware key, in trial-number order."""
    rng_state: Mapping[str, Any] | None = field(default=None, compare=False)
    memory_reprobed_through: int = 0
    """Out-of-memory trials numbered up to this were before the caller's last memory
    re-probe: forgotten."""
    memory_limit: int | None = None
    """Smallest batch size known not to fit on this hardware: it and every larger
    size are not candidates (:func:`bso.core.outcomes.learning_view` sets it)."""
    prior: LanePrior | None = None
    """What another lane of the job learned (:mod:`bso.core.transfer`); None: nothing."""
    other_lanes_epochs: Mapping[int, EpochGuess] = field(default_factory=dict)
    """Per size the job's other lanes converged at, their epochs to target as a guess
    of this lane's (:func:`bso.core.transfer.epoch_guesses`): epochs belong to the
    optimisation, not to the GPU."""
    other_lanes_floors: Mapping[int, EpochFloor] = field(default_factory=dict)
    """Per size the job's other lanes stopped for cost, the epochs those runs proved
    it needs (:func:`bso.core.transfer.epoch_floors`): a size past another GPU's
    critical batch, never converged there, is judged by them here."""

    @property
    def max_power_w(self) -> float:
        return self.hardware.total_max_power_w

    @property
    def candidate_sizes(self) -> list[int]:
        """The job's batch sizes that may still be handed out on this hardware."""
        limit = self.memory_limit
        return [b for b in self.spec.batch_sizes if limit is None or b < limit]

    @property
    def start_batch_size(self) -> int | None:
        """Where exploration starts: the default, or the largest candidate below it
        when the default does not fit; None when nothing fits."""
        default = self.spec.default_batch_size
        below = [b for b in self.candidate_sizes if b <= default]
        if below:
            return below[-1]
        return self.candidate_sizes[0] if self.candidate_sizes else None

    @property
    def exploration_start(self) -> int | None:
        """Where bso's walk starts: the size another lane transferred, while it is a
        candidate, else :attr:`start_batch_size`."""
        if self.prior is not None and self.prior.start in self.candidate_sizes:
            return self.prior.start
        return self.start_batch_size

    def default_distance(self, batch_size: int) -> float:
        """How far ``batch_size`` is from the default on a log scale: the tie-breaker,
        so that sizes no measurement tells apart resolve toward the default."""
        return abs(math.log(batch_size / self.spec.default_batch_size))

    def cost(self, energy_j: float, time_s: float) -> float:
        return cost(energy_j, time_s, self.spec.eta_knob, self.max_power_w)

    def converged_costs(self, batch_size: int | None = None) -> list[float]:
        return [
            t.cost
            for t in self.trials
            if t.converged and (batch_size is None or t.batch_size == batch_size)
        ]

    @property
    def min_cost(self) -> float | None:
        """Lowest cost of any converged trial: the base of the ``beta_knob`` bound."""
        costs = self.converged_costs()
        return min(costs) if costs else None

    @property
    def best_mean_cost(self) -> float | None:
        """Lowest mean converged cost of any size: the expected cost of the best
        size, which one lucky run does not drag down."""
        means = self.mean_costs()
        return min(means.values()) if means else None

    def micro_batch_runs(self, batch_size: int) -> list[TrialSnapshot]:
        """The latest :data:`~bso.core.micro_batch.KEPT_RUNS` runs of this lane that
        explored micro-batches at global batch ``batch_size``."""
        explored = [t for t in self.trials if t.batch_size == batch_size and t.micro_batches]
        return explored[-KEPT_RUNS:]

    def micro_batch_timings(self, batch_size: int) -> dict[int, Timings]:
        """Per micro-batch, what :meth:`micro_batch_runs` timed (:mod:`bso.core.micro_batch`):
        where a new run's exploration starts."""
        return merge_timings(*(dict(t.micro_batches) for t in self.micro_batch_runs(batch_size)))

    def mean_costs(self) -> dict[int, float]:
        """Mean converged cost per batch size (only sizes that converged at least once)."""
        per_size: dict[int, list[float]] = {}
        for t in self.trials:
            if t.converged:
                per_size.setdefault(t.batch_size, []).append(t.cost)
        return {b: statistics.fmean(c) for b, c in per_size.items()}

    def best_batch_size(self) -> int | None:
        """The size with the lowest mean converged cost, if any converged; equal
        means resolve toward the default."""
        means = self.mean_costs()
        if not means:
            return None
        return min(means, key=lambda b: (means[b], self.default_distance(b), b))
