"""Replay an online batch-growth schedule on the traces, against fixed sizes.

The traces say, per batch size, how long an epoch takes, at what power, and
how many epochs each seeded run needed to reach the target: there is no
accuracy curve.  Replaying a run whose size changes part-way therefore needs a
model of progress across a change, and this module uses the *progress-fraction
model*, an assumption rather than a measurement:

* ``e`` epochs at size ``b``, which needs ``E_b`` epochs to reach the target,
  do ``e / E_b`` of the work; after a switch to ``b'`` the run needs
  ``(1 - done) * E_b'`` more epochs, rounded up to a whole epoch (a real run
  reports whole epochs, and stops after the one that reached the target);
* a size whose run never reached the target (``E_b`` None) makes no progress:
  a run that cannot get past it fails at ``max_epochs``;
* an epoch costs the time and the energy (time x power) of the size it ran at.

What it leaves out: a real grown run rescales its learning rate (and the
optimizer's state sees a new gradient noise) at each growth, which may help
or hurt convergence in ways no per-size epoch count can tell.

Expectations follow the replays' world (:meth:`Workload.draw_epochs`): the
epochs a size needs are one of its recorded runs, drawn independently per
size, and a grown run's expected cost is the exact mean over every
combination of the recorded runs of the sizes it trains at.  As in
:meth:`Workload.expected_cost`, a start that misses the target within
``max_epochs`` in any combination costs inf: bso does not recommend a size
that sometimes fails.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from bso.core.cost import cost
from bso.core.growth import BatchGrowth
from bso.replay.workloads import Workload


@dataclass(frozen=True)
class GrownRun:
    """A run that starts at ``start`` and grows by the schedule, in expectation."""

    start: int
    sizes: tuple[int, ...]
    """The sizes it trains at, in order, up to the last epoch any of its draws ran."""
    reach_chance: float
    """Share of the draws that reach the target within ``max_epochs``."""
    epochs: float
    """Expected epochs run (a failed run counts ``max_epochs``)."""
    time_s: float
    energy_j: float


@dataclass(frozen=True)
class GrowthRow:
    """One starting size: its fixed-size cost and its cost under the schedule."""

    start: int
    fixed_cost: float
    grown_cost: float
    run: GrownRun

    @property
    def ratio(self) -> float:
        return _ratio(self.grown_cost, self.fixed_cost)


@dataclass(frozen=True)
class GrowthComparison:
    """Whether growing beats the best fixed size, for one workload and eta."""

    workload: str
    eta_knob: float
    growth: BatchGrowth
    best_fixed: int
    best_fixed_cost: float
    best_start: int
    best_grown_cost: float
    rows: tuple[GrowthRow, ...]

    @property
    def ratio(self) -> float:
        """Best grown cost over best fixed cost: below 1, growth pays."""
        return _ratio(self.best_grown_cost, self.best_fixed_cost)

    @property
    def pays(self) -> bool:
        return self.ratio < 1.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: non-finite figures (a start that can fail) become null."""
        return {
            "workload": self.workload,
            "eta_knob": self.eta_knob,
            "growth": {
                "every_epochs": self.growth.every_epochs,
                "factor": self.growth.factor,
                "max_batch_size": self.growth.max_batch_size,
            },
            "best_fixed": {"batch_size": self.best_fixed, "cost": _finite(self.best_fixed_cost)},
            "best_grown": {"start": self.best_start, "cost": _finite(self.best_grown_cost)},
            "ratio": _finite(self.ratio),
            "pays": self.pays,
            "rows": [
                {
                    "start": r.start,
                    "fixed_cost": _finite(r.fixed_cost),
                    "grown_cost": _finite(r.grown_cost),
                    "ratio": _finite(r.ratio),
                    "reach_chance": r.run.reach_chance,
                    "epochs": r.run.epochs,
                    "time_s": r.run.time_s,
                    "energy_j": r.run.energy_j,
                    "sizes": list(r.run.sizes),
                }
                for r in self.rows
            ],
        }


def grown_run(workload: Workload, growth: BatchGrowth, start: int) -> GrownRun:
    """Replay the schedule from ``start`` under the progress-fraction model (module doc).

    Exact: the work done so far is a :class:`~fractions.Fraction`, so a run
    that needs exactly the epochs left is never an epoch off by rounding, and
    draws that leave the same work done are merged, which keeps the
    enumeration small.
    """
    w = workload
    schedule = growth.schedule(start, w.batch_sizes, w.max_epochs)
    time_by_epoch, energy_by_epoch = [0.0], [0.0]  # cumulative, after k epochs
    for size in schedule:
        profile = w.profiles[size]
        time_by_epoch.append(time_by_epoch[-1] + profile.epoch_time_s)
        energy_by_epoch.append(
            energy_by_epoch[-1] + profile.epoch_time_s * profile.avg_power_w * w.gpu_count
        )
    working: dict[Fraction, Fraction] = {Fraction(0): Fraction(1)}  # work done -> chance
    reached: dict[int, Fraction] = defaultdict(Fraction)  # epochs run -> chance
    for size, before, length in _segments(schedule):
        draws = Counter(w.runs[size])
        n = sum(draws.values())
        after: dict[Fraction, Fraction] = defaultdict(Fraction)
        for done, chance in working.items():
            for needed, count in draws.items():
                p = chance * Fraction(count, n)
                if needed is None:
                    after[done] += p  # no progress at a size that never converges
                    continue
                rest = math.ceil((1 - done) * needed)
                if rest <= length:
                    reached[before + rest] += p
                else:
                    after[done + Fraction(length, needed)] += p
        working = after
    failed = sum(working.values(), Fraction(0))
    last = w.max_epochs if failed else max(reached)
    outcomes = [*reached.items(), (w.max_epochs, failed)]
    return GrownRun(
        start=start,
        sizes=tuple(size for size, _, _ in _segments(schedule[:last])),
        reach_chance=float(1 - failed),
        epochs=float(sum(k * p for k, p in outcomes)),
        time_s=sum(float(p) * time_by_epoch[k] for k, p in outcomes),
        energy_j=sum(float(p) * energy_by_epoch[k] for k, p in outcomes),
    )


def grown_cost(workload: Workload, run: GrownRun, eta_knob: float) -> float:
    """Expected cost of ``run``; inf if it can miss the target, as for a fixed size."""
    if run.reach_chance < 1.0:
        return math.inf
    power = workload.max_power_w * workload.gpu_count
    return cost(run.energy_j, run.time_s, eta_knob, power)


def compare_growth(workload: Workload, growth: BatchGrowth, eta_knob: float) -> GrowthComparison:
    """Every starting size under the schedule against the best fixed size (the oracle)."""
    rows = []
    for start in workload.batch_sizes:
        run = grown_run(workload, growth, start)
        rows.append(
            GrowthRow(
                start=start,
                fixed_cost=workload.expected_cost(start, eta_knob),
                grown_cost=grown_cost(workload, run, eta_knob),
                run=run,
            )
        )
    best_fixed, best_fixed_cost = workload.oracle(eta_knob)
    best = min(rows, key=lambda r: (r.grown_cost, r.start))
    return GrowthComparison(
        workload=workload.name,
        eta_knob=eta_knob,
        growth=growth,
        best_fixed=best_fixed,
        best_fixed_cost=best_fixed_cost,
        best_start=best.start,
        best_grown_cost=best.grown_cost,
        rows=tuple(rows),
    )


def _segments(schedule: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """``(size, epochs before it, epochs at it)`` for each run of equal sizes."""
    before = 0
    while before < len(schedule):
        size = schedule[before]
        length = 1
        while before + length < len(schedule) and schedule[before + length] == size:
            length += 1
        yield size, before, length
        before += length


def _ratio(grown: float, fixed: float) -> float:
    """``grown / fixed``; nan where the fixed cost is no yardstick (inf or zero)."""
    if not math.isfinite(fixed) or fixed <= 0.0:
        return math.nan
    return grown / fixed


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None
