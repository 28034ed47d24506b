"""Frozen snapshots of job state handed to the policies."""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from bso.events import StopReason, TrialPhase, TrialStatus
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

    @property
    def converged(self) -> bool:
        return self.status is TrialStatus.CONVERGED

    @property
    def failed(self) -> bool:
        return self.status is TrialStatus.FAILED

    @property
    def running(self) -> bool:
        return self.status is TrialStatus.RUNNING


@dataclass(frozen=True, slots=True)
class JobSnapshot:
    """Everything a policy may read about one job on one hardware configuration."""

    spec: JobSpec
    hardware: Hardware
    trials: tuple[TrialSnapshot, ...] = ()
    """Trials of this hardware key, in trial-number order."""
    rng_state: Mapping[str, Any] | None = field(default=None, compare=False)

    @property
    def max_power_w(self) -> float:
        return self.hardware.total_max_power_w

    def cost(self, energy_j: float, time_s: float) -> float:
        eta = self.spec.eta_knob
        return eta * energy_j + (1.0 - eta) * self.max_power_w * time_s

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

    def mean_costs(self) -> dict[int, float]:
        """Mean converged cost per batch size (only sizes that converged at least once)."""
        per_size: dict[int, list[float]] = {}
        for t in self.trials:
            if t.converged:
                per_size.setdefault(t.batch_size, []).append(t.cost)
        return {b: statistics.fmean(c) for b, c in per_size.items()}

    def best_batch_size(self) -> int | None:
        """The size with the lowest mean converged cost, if any converged."""
        means = self.mean_costs()
        return min(means, key=lambda b: (means[b], b)) if means else None
