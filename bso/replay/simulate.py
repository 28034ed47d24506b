"""Replay recurring jobs epoch by epoch through the in-process API.

Every policy of a comparison sees the same *world*: for recurrence ``r`` and
attempt ``a`` of it, a pre-drawn number of epochs each batch size would need.
So bso, the Zeus baseline, always-default and the oracle differ only in the
sizes they choose, never in luck.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from bso.api import EventApi
from bso.core.cost import cost
from bso.errors import NoFeasibleBatchSize
from bso.replay.workloads import Workload
from bso.service import BsoService
from bso.spec import JobSpec, PolicyName
from bso.storage.memory import MemoryStore

LEARNING_POLICIES: tuple[PolicyName, ...] = ("bso", "zeus")
ATTEMPTS_PER_RECURRENCE = 30


@dataclass(frozen=True)
class World:
    workload: Workload
    draws: tuple[tuple[dict[int, int | None], ...], ...]
    """``draws[r][a][b]``: epochs batch size ``b`` needs in attempt ``a`` of recurrence ``r``."""

    def to_json(self, spec: JobSpec) -> dict[str, Any]:
        """The world in the JSON form ``scripts/zeus_driver.py`` replays."""
        w = self.workload
        return {
            "job": {
                **spec.model_dump(
                    mode="json",
                    include={
                        "job_id",
                        "batch_sizes",
                        "default_batch_size",
                        "eta_knob",
                        "beta_knob",
                        "target_metric",
                        "higher_is_better_metric",
                        "max_epochs",
                        "num_pruning_rounds",
                        "window_size",
                        "mab_prior_mean",
                        "mab_prior_precision",
                        "mab_num_explorations",
                        "mab_seed",
                    },
                ),
                "max_power_w": w.max_power_w,
                "gpu_count": w.gpu_count,
                "gpu_model": w.gpu_model,
            },
            "sizes": {
                str(b): {"epoch_time_s": p.epoch_time_s, "avg_power_w": p.avg_power_w}
                for b, p in w.profiles.items()
            },
            "recurrences": [
                [{str(b): e for b, e in attempt.items()} for attempt in recurrence]
                for recurrence in self.draws
            ],
        }


def make_world(
    workload: Workload, recurrences: int, seed: int, attempts: int = ATTEMPTS_PER_RECURRENCE
) -> World:
    rng = np.random.default_rng(seed)
    draws = tuple(
        tuple(
            {b: workload.draw_epochs(b, rng) for b in workload.batch_sizes} for _ in range(attempts)
        )
        for _ in range(recurrences)
    )
    return World(workload, draws)


@dataclass
class RecurrenceResult:
    index: int
    sizes: list[int] = field(default_factory=list)
    """Batch size of each attempt, in order; the last one converged if ``converged``."""
    time_s: float = 0.0
    energy_j: float = 0.0
    cost: float = 0.0
    converged: bool = False
    recommendation: int | None = None
    confidence: int | None = None
    """0-100, as ``bso status`` shows it."""

    @property
    def tries(self) -> int:
        return len(self.sizes)


@dataclass
class ReplayResult:
    workload: str
    policy: str
    eta_knob: float
    beta_knob: float | None
    recurrences: list[RecurrenceResult]

    @property
    def total_cost(self) -> float:
        return sum(r.cost for r in self.recurrences)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["total_cost"] = self.total_cost
        return data


def replay_fixed(world: World, batch_size: int, eta_knob: float, label: str) -> ReplayResult:
    """Always train with ``batch_size`` to the target (or ``max_epochs``); retry on failure."""
    return replay_schedule(world, [batch_size] * len(world.draws), eta_knob, label)


def walk_floor_schedule(workload: Workload, eta_knob: float, recurrences: int) -> list[int]:
    """The sizes of a clairvoyant walk: one recurrence per size from the default to the oracle.

    It is the least any policy can pay that moves one neighbouring size per
    recurrence and must converge every recurrence, if it knew the direction and
    where to stop: it never measures a size off the path, nor one past the
    oracle, nor any size twice.  A learning policy cannot know those things, so
    this is a floor to read its figures against, not a target it can reach.
    """
    sizes = workload.batch_sizes
    oracle, _ = workload.oracle(eta_knob)
    start, end = sizes.index(workload.default_batch_size), sizes.index(oracle)
    step = 1 if end >= start else -1
    path = [sizes[i] for i in range(start, end + step, step)]
    return (path + [oracle] * recurrences)[:recurrences]


def replay_schedule(
    world: World, schedule: Sequence[int], eta_knob: float, label: str
) -> ReplayResult:
    """Train recurrence ``r`` with ``schedule[r]`` to the target (or ``max_epochs``).

    A run that does not converge is retried with the same size on the
    recurrence's next attempt.
    """
    w = world.workload
    results = []
    for index, (recurrence, batch_size) in enumerate(zip(world.draws, schedule, strict=True)):
        result = RecurrenceResult(index, recommendation=batch_size)
        for attempt in recurrence:
            needed = attempt[batch_size]
            last = None
            for last in w.epoch_reports(batch_size, needed):
                if needed is not None and last.epoch >= needed:
                    break
            assert last is not None
            _add_run(
                result,
                w=w,
                batch_size=batch_size,
                time_s=last.time_s,
                energy_j=last.energy_j,
                eta=eta_knob,
            )
            if needed is not None and needed <= w.max_epochs:
                result.converged = True
                break
        results.append(result)
    return ReplayResult(w.name, label, eta_knob, None, results)


def replay_policy(
    world: World,
    policy: PolicyName,
    *,
    eta_knob: float,
    beta_knob: float | None,
    seed: int,
    exploration_budget: float | None = None,
    on_recurrence: Callable[[RecurrenceResult], None] | None = None,
) -> ReplayResult:
    """Replay through :class:`BsoService` exactly as a training job would drive it."""
    w = world.workload
    service = BsoService(MemoryStore())
    job_id = f"{w.name}-{policy}"
    spec = w.job_spec(
        job_id=job_id,
        eta_knob=eta_knob,
        beta_knob=beta_knob,
        seed=seed,
        policy=policy,
        exploration_budget=exploration_budget,
    )
    service.register(spec)
    results = []
    for index, attempts in enumerate(world.draws):
        result = run_recurrence(
            service, workload=w, job_id=job_id, index=index, attempts=attempts, eta_knob=eta_knob
        )
        results.append(result)
        if on_recurrence is not None:
            on_recurrence(result)
    return ReplayResult(w.name, policy, eta_knob, beta_knob, results)


def run_recurrence(
    api: EventApi,
    *,
    workload: Workload,
    job_id: str,
    index: int,
    attempts: Sequence[Mapping[int, int | None]],
    eta_knob: float,
) -> RecurrenceResult:
    """One recurrence as a training job lives it: relaunch until a run converges.

    Each attempt asks ``api`` (in-process service or remote client) for a
    batch size, reports every epoch of the drawn run until told to stop, and
    ends the trial.  The recommendation afterwards comes from ``api.status``.
    """
    result = RecurrenceResult(index)
    try:
        for needed_by_size in attempts:
            trial = api.next_trial(job_id, workload.hardware)
            decision = None
            needed = needed_by_size[trial.batch_size]
            for report in workload.epoch_reports(trial.batch_size, needed):
                decision = api.report_epoch(
                    job_id,
                    trial.trial_number,
                    epoch=report.epoch,
                    time_s=report.time_s,
                    energy_j=report.energy_j,
                    metric=report.metric,
                )
                if decision.stop:
                    _add_run(
                        result,
                        w=workload,
                        batch_size=trial.batch_size,
                        time_s=report.time_s,
                        energy_j=report.energy_j,
                        eta=eta_knob,
                    )
                    break
            api.end_trial(job_id, trial.trial_number)
            if decision is not None and decision.converged:
                result.converged = True
                break
    except NoFeasibleBatchSize:
        pass  # recorded as a recurrence that did not converge
    lanes = api.status(job_id).lanes
    if lanes:
        result.recommendation, result.confidence = (
            lanes[0].recommended_batch_size,
            lanes[0].confidence,
        )
    return result


def _add_run(
    result: RecurrenceResult,
    *,
    w: Workload,
    batch_size: int,
    time_s: float,
    energy_j: float,
    eta: float,
) -> None:
    result.sizes.append(batch_size)
    result.time_s += time_s
    result.energy_j += energy_j
    result.cost += cost(energy_j, time_s, eta, w.max_power_w * w.gpu_count)


@dataclass
class Comparison:
    """All policies replayed on one world."""

    workload: str
    eta_knob: float
    oracle_batch_size: int
    results: dict[str, ReplayResult]

    def ratio(self, policy: str, baseline: str = "oracle") -> float:
        base = self.results[baseline].total_cost
        return self.results[policy].total_cost / base if base > 0 else math.nan


def budgeted_label(budget: float) -> str:
    """The column of bso replayed with ``exploration_budget=budget``."""
    return f"bso@{budget:g}"


def compare(
    workload: Workload,
    policies: Sequence[PolicyName],
    *,
    eta_knob: float,
    beta_knob: float | None,
    recurrences: int,
    seed: int,
    budgets: Sequence[float] = (),
    on_recurrence: Callable[[RecurrenceResult], None] | None = None,
) -> Comparison:
    """Every policy, and bso once more per exploration budget (as ``bso@0.02``), on one
    world, with the oracle and always-default."""
    world = make_world(workload, recurrences, seed)
    oracle_size, _ = workload.oracle(eta_knob)
    results = {
        "oracle": replay_fixed(world, oracle_size, eta_knob, "oracle"),
        "default": replay_fixed(world, workload.default_batch_size, eta_knob, "default"),
    }
    for policy in policies:
        results[policy] = replay_policy(
            world,
            policy,
            eta_knob=eta_knob,
            beta_knob=beta_knob,
            seed=seed,
            on_recurrence=on_recurrence,
        )
    for budget in budgets:
        results[budgeted_label(budget)] = replay_policy(
            world,
            "bso",
            eta_knob=eta_knob,
            beta_knob=beta_knob,
            seed=seed,
            exploration_budget=budget,
            on_recurrence=on_recurrence,
        )
    return Comparison(workload.name, eta_knob, oracle_size, results)
