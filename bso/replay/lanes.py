"""Lane pairs: one job on one GPU, then on another, for replaying transfer.

Only V100 traces are public, so the second GPU is made from the first by
changing what differs between real GPUs and keeping what does not:

* per-epoch time and power per batch size move (a newer GPU gains more at
  large sizes, where it is less starved; a lower-power one draws relatively
  less at small sizes), tilted along log2 of the batch size;
* the epochs each size needs to reach the target stay: they belong to the
  optimisation, not to the hardware (the same recorded runs are drawn from);
* the GPU model and its power limit change, so the pair are two lanes of one
  job (``Hardware.key``).

A tilt moves the cost optimum by zero, one or two sizes, as the issue that
asked for transfer describes real GPU pairs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from bso.replay.simulate import make_world, replay_fixed, replay_policy, run_recurrence
from bso.replay.workloads import SizeProfile, Workload
from bso.service import BsoService
from bso.storage.memory import MemoryStore


@dataclass(frozen=True, slots=True)
class Tilt:
    """How a second GPU differs from the first, per doubling of the batch size."""

    name: str
    time: float
    """Epoch time changes by ``2 ** -time`` per doubling above the default (faster at
    large sizes when positive)."""
    power: float
    """Power changes by ``2 ** power`` per doubling above the default (lower at small
    sizes when positive)."""
    speed: float = 1.0
    """Epoch time divided by this at every size."""
    max_power_w: float = 400.0


TILTS: tuple[Tilt, ...] = (
    Tilt("faster-large", time=0.15, power=0.0, speed=2.0),
    Tilt("low-power-small", time=0.0, power=0.15, speed=1.3, max_power_w=300.0),
    Tilt("faster-large-2", time=0.3, power=0.05, speed=2.5),
    Tilt("slower-large", time=-0.15, power=-0.05, speed=1.2, max_power_w=350.0),
)
"""The second GPUs every workload is paired with."""


def on_other_gpu(workload: Workload, tilt: Tilt) -> Workload:
    """``workload`` as it would run on the GPU ``tilt`` describes."""
    default = workload.default_batch_size
    profiles = {}
    for b, p in workload.profiles.items():
        doublings = math.log2(b / default)
        profiles[b] = SizeProfile(
            epoch_time_s=p.epoch_time_s * 2 ** (-tilt.time * doublings) / tilt.speed,
            avg_power_w=min(p.avg_power_w * 2 ** (tilt.power * doublings), tilt.max_power_w),
        )
    return dataclasses.replace(
        workload,
        name=f"{workload.name}.{tilt.name}",
        profiles=profiles,
        gpu_model=f"{workload.gpu_model}-{tilt.name}",
        max_power_w=tilt.max_power_w,
    )


@dataclass(frozen=True, slots=True)
class PairResult:
    """Lane B's cumulative cost after lane A's recurrences, and alone."""

    workload: str
    tilt: str
    eta_knob: float
    optimum_move: int
    """Sizes between lane A's oracle and lane B's (signed: up is positive)."""
    oracle: float
    cold: float
    """Lane B as a job of its own: learning from nothing."""
    transferred: float
    """Lane B of a job that first ran its recurrences on lane A."""

    @property
    def cold_excess(self) -> float:
        return self.cold / self.oracle - 1

    @property
    def transferred_excess(self) -> float:
        return self.transferred / self.oracle - 1


def replay_pair(
    first: Workload, second: Workload, *, eta_knob: float, seed: int, recurrences: int
) -> PairResult:
    """``recurrences`` on ``first``'s lane, then as many on ``second``'s, in one job;
    against ``second`` replayed cold and with its oracle size, in the same world."""
    world_a = make_world(first, recurrences, seed)
    world_b = make_world(second, recurrences, seed + 1)
    service = BsoService(MemoryStore())
    service.register(first.job_spec(job_id="pair", eta_knob=eta_knob, seed=seed))
    for index, attempts in enumerate(world_a.draws):
        run_recurrence(
            service, workload=first, job_id="pair", index=index, attempts=attempts,
            eta_knob=eta_knob,
        )  # fmt: skip
    transferred = sum(
        run_recurrence(
            service, workload=second, job_id="pair", index=index, attempts=attempts,
            eta_knob=eta_knob,
        ).cost
        for index, attempts in enumerate(world_b.draws)
    )  # fmt: skip
    cold = replay_policy(world_b, "bso", eta_knob=eta_knob, beta_knob=2.0, seed=seed)
    oracle_b, _ = second.oracle(eta_knob)
    oracle_a, _ = first.oracle(eta_knob)
    sizes = first.batch_sizes
    return PairResult(
        workload=first.name,
        tilt=second.name.rsplit(".", 1)[-1],
        eta_knob=eta_knob,
        optimum_move=sizes.index(oracle_b) - sizes.index(oracle_a),
        oracle=replay_fixed(world_b, oracle_b, eta_knob, "oracle").total_cost,
        cold=cold.total_cost,
        transferred=transferred,
    )


def replay_pairs(
    workloads: Sequence[Workload],
    tilts: Sequence[Tilt],
    *,
    etas: Sequence[float],
    seeds: Sequence[int],
    recurrences: int,
) -> list[PairResult]:
    """Every workload with every tilt, eta and seed."""
    return [
        replay_pair(w, on_other_gpu(w, tilt), eta_knob=eta, seed=seed, recurrences=recurrences)
        for w in workloads
        for tilt in tilts
        for eta in etas
        for seed in seeds
    ]
