"""Workloads to replay: per batch size, the cost of an epoch and how many epochs
recorded runs needed to reach the target metric.

A workload comes either from Zeus's public traces (``summary_train.csv`` and
``summary_power_<gpu>.csv``, see :mod:`bso.replay.traces`) or from
:func:`synthetic_workloads`, which needs no files at all.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from bso.core.cost import cost
from bso.spec import Hardware, JobSpec, PolicyName


@dataclass(frozen=True, slots=True)
class SizeProfile:
    """Deterministic per-epoch behaviour of one batch size."""

    epoch_time_s: float
    avg_power_w: float
    """Average power of one GPU while training."""


class EpochResult(NamedTuple):
    epoch: int
    time_s: float
    """Cumulative over the run."""
    energy_j: float
    """Cumulative over the run, all GPUs."""
    metric: float


@dataclass(frozen=True)
class Workload:
    name: str
    default_batch_size: int
    target_metric: float
    higher_is_better_metric: bool
    max_epochs: int
    profiles: Mapping[int, SizeProfile]
    runs: Mapping[int, tuple[int | None, ...]]
    """Epochs each recorded run needed to reach the target (None: never reached it)."""
    gpu_model: str
    max_power_w: float
    gpu_count: int = 1

    @property
    def batch_sizes(self) -> list[int]:
        return sorted(self.profiles)

    @property
    def hardware(self) -> Hardware:
        return Hardware(
            gpu_model=self.gpu_model, gpu_count=self.gpu_count, max_power_w=self.max_power_w
        )

    def job_spec(
        self,
        *,
        job_id: str,
        eta_knob: float = 0.5,
        beta_knob: float | None = 2.0,
        seed: int | None = None,
        policy: PolicyName = "bso",
        **overrides: Any,
    ) -> JobSpec:
        return JobSpec(
            job_id=job_id,
            batch_sizes=self.batch_sizes,
            default_batch_size=self.default_batch_size,
            eta_knob=eta_knob,
            beta_knob=beta_knob,
            target_metric=self.target_metric,
            higher_is_better_metric=self.higher_is_better_metric,
            max_epochs=self.max_epochs,
            mab_seed=seed,
            policy=policy,
            hardware=self.hardware,
            **overrides,
        )

    def draw_epochs(self, batch_size: int, rng: np.random.Generator) -> int | None:
        """Epochs a fresh run of ``batch_size`` needs: one recorded run, at random."""
        runs = self.runs[batch_size]
        return runs[int(rng.integers(len(runs)))]

    def epoch_cost(self, batch_size: int, eta_knob: float) -> float:
        profile = self.profiles[batch_size]
        energy = profile.epoch_time_s * profile.avg_power_w * self.gpu_count
        return cost(energy, profile.epoch_time_s, eta_knob, self.max_power_w * self.gpu_count)

    def epoch_reports(self, batch_size: int, epochs_needed: int | None) -> Iterator[EpochResult]:
        """What a training run reports after each epoch, up to ``max_epochs``.

        The traces only say when the target was reached, so the metric is the
        target from that epoch on and one unit short of it before.
        """
        profile = self.profiles[batch_size]
        short = -1.0 if self.higher_is_better_metric else 1.0
        for epoch in range(1, self.max_epochs + 1):
            time_s = epoch * profile.epoch_time_s
            reached = epochs_needed is not None and epoch >= epochs_needed
            yield EpochResult(
                epoch,
                time_s,
                time_s * profile.avg_power_w * self.gpu_count,
                self.target_metric if reached else self.target_metric + short,
            )

    def expected_cost(self, batch_size: int, eta_knob: float) -> float:
        """Mean cost of a run of ``batch_size``; inf if any recorded run misses the target."""
        runs = self.runs[batch_size]
        if any(e is None or e > self.max_epochs for e in runs):
            return math.inf
        epochs = statistics.fmean(e for e in runs if e is not None)
        return epochs * self.epoch_cost(batch_size, eta_knob)

    def oracle(self, eta_knob: float) -> tuple[int, float]:
        """The best fixed batch size in expectation, and its expected cost."""
        costs = {b: self.expected_cost(b, eta_knob) for b in self.batch_sizes}
        best = min(costs, key=lambda b: (costs[b], b))
        return best, costs[best]


def synthetic_workloads(seed: int = 7, runs_per_size: int = 8) -> list[Workload]:
    """Three made-up jobs with different optima, for replays without trace files.

    The model follows the usual shape of measured jobs: an epoch gets cheaper
    with larger batches until the GPU saturates, while the epochs needed to
    reach the target grow past a critical batch size, and very small batches
    are too noisy to converge at all.
    """
    rng = np.random.default_rng(seed)
    shapes = [
        # name, sizes, default, samples, step time (s) = a + c * b, critical batch, min epochs
        (
            "synthetic-vision",
            [16, 32, 64, 128, 256, 512, 1024, 2048],
            1024,
            50_000,
            4e-3,
            9e-5,
            256,
            12,
        ),
        ("synthetic-language", [8, 12, 16, 24, 32, 48, 64], 32, 80_000, 2.5e-2, 2.2e-3, 24, 3),
        (
            "synthetic-recsys",
            [256, 512, 1024, 2048, 4096, 8192, 16384],
            1024,
            1_000_000,
            1.2e-2,
            1e-6,
            8192,
            3,
        ),
    ]
    workloads = []
    for name, sizes, default, samples, step_a, step_c, critical, min_epochs in shapes:
        profiles: dict[int, SizeProfile] = {}
        runs: dict[int, tuple[int | None, ...]] = {}
        for b in sizes:
            epoch_time = samples / b * (step_a + step_c * b)
            utilisation = (step_c * b) / (step_a + step_c * b)
            profiles[b] = SizeProfile(epoch_time, 70.0 + 180.0 * utilisation)
            mean_epochs = min_epochs * (1.0 + b / critical)
            unstable = b == sizes[0]
            runs[b] = tuple(
                None if unstable else max(1, round(mean_epochs * float(rng.lognormal(0.0, 0.08))))
                for _ in range(runs_per_size)
            )
        max_epochs = max(e for r in runs.values() for e in r if e is not None) + 5
        workloads.append(
            Workload(
                name=name,
                default_batch_size=default,
                target_metric=0.9,
                higher_is_better_metric=True,
                max_epochs=max_epochs,
                profiles=profiles,
                runs=runs,
                gpu_model="Synthetic GPU",
                max_power_w=250.0,
            )
        )
    return workloads
