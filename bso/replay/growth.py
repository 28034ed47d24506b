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

So each unit of work at ``b`` costs what a whole fixed run of ``b`` costs,
and a grown run pays a work-weighted mean of the fixed costs of the sizes it
trains at (plus the last epoch's round-up): it can beat a poor start, or
rescue one that never converges alone, but not the cheapest size it visits,
except by the luck of the draws.  What makes growth pay in practice, a small
batch being worth more early in training than late, is just what a per-size
epoch count cannot show.  Nor does the model see the learning rate, which a
real grown run rescales at each growth.

Expectations follow the replays' world (:meth:`Workload.draw_epochs`): the
epochs a size needs are one of its recorded runs, drawn independently per
size, and a grown run's expected cost is the exact mean over every
combination of the recorded runs of the sizes it trains at.  As in
:meth:`Workload.expected_cost`, a start that misses the target within
``max_epochs`` in any combination costs inf: bso does not recommend a size
that sometimes fails.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter, defaultdict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from fractions import Fraction
from typing import Any, Literal

from bso.core.cost import cost
from bso.core.growth import BatchGrowth
from bso.replay.workloads import Workload

Reach = Literal["always", "sometimes", "never"]


@dataclass(frozen=True)
class GrownRun:
    """A run that starts at ``start`` and grows by the schedule, over the recorded draws."""

    start: int
    sizes: tuple[int, ...]
    """The sizes it trains at, in order, up to the last epoch its slowest draw runs."""
    reaches: Reach
    """Whether its draws reach the target within ``max_epochs``: all, some or none."""
    epochs: float | None
    """Expected epochs to the target; None unless it ``always`` reaches it."""
    time_s: float | None
    energy_j: float | None


@dataclass(frozen=True)
class GrowthRow:
    """One starting size: its fixed-size cost and its cost under the schedule."""

    start: int
    fixed_cost: float
    grown_cost: float
    run: GrownRun

    @property
    def ratio(self) -> float:
        """Grown over fixed cost of the same start: nan where the fixed size can fail."""
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
        """Strictly cheaper: a grown start that never grows costs the fixed size, to rounding."""
        return self.ratio < 1.0 and not math.isclose(self.ratio, 1.0, rel_tol=1e-9)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: non-finite figures (a start that can fail) become null."""
        return {
            "workload": self.workload,
            "eta_knob": self.eta_knob,
            "growth": asdict(self.growth),
            "best_fixed": {"batch_size": self.best_fixed, "cost": _finite(self.best_fixed_cost)},
            "best_grown": {"start": self.best_start, "cost": _finite(self.best_grown_cost)},
            "ratio": _finite(self.ratio),
            "pays": self.pays,
            "rows": [
                {
                    **asdict(r.run),
                    "fixed_cost": _finite(r.fixed_cost),
                    "grown_cost": _finite(r.grown_cost),
                    "ratio": _finite(r.ratio),
                }
                for r in self.rows
            ],
        }


def grown_run(workload: Workload, growth: BatchGrowth, start: int) -> GrownRun:
    """Replay the schedule from ``start`` under the progress-fraction model (module doc).

    The epochs to the target only grow with the epochs any size needs, so the
    slowest draw of every size decides whether all draws reach the target and
    the fastest whether any does; only a start that always reaches it has an
    expected cost, and only then are the draws enumerated.
    """
    w = workload
    schedule = growth.schedule(start, w.batch_sizes, w.max_epochs)
    slowest = {
        b: Counter([None if None in runs else max(e for e in runs if e is not None)])
        for b, runs in w.runs.items()
    }
    if not (worst := _outcomes(schedule, slowest)):
        fastest = {
            b: Counter([min((e for e in r if e is not None), default=None)])
            for b, r in w.runs.items()
        }
        reaches: Reach = "sometimes" if _outcomes(schedule, fastest) else "never"
        sizes = tuple(size for size, _, _ in _segments(schedule))
        return GrownRun(start, sizes, reaches, None, None, None)
    (last,) = worst
    reached = _outcomes(schedule, {b: Counter(runs) for b, runs in w.runs.items()})
    time_by_epoch, energy_by_epoch = [0.0], [0.0]  # cumulative, after k epochs
    for size in schedule[:last]:
        profile = w.profiles[size]
        time_by_epoch.append(time_by_epoch[-1] + profile.epoch_time_s)
        energy_by_epoch.append(
            energy_by_epoch[-1] + profile.epoch_time_s * profile.avg_power_w * w.gpu_count
        )
    return GrownRun(
        start=start,
        sizes=tuple(size for size, _, _ in _segments(schedule[:last])),
        reaches="always",
        epochs=float(sum(k * p for k, p in reached.items())),
        time_s=sum(float(p) * time_by_epoch[k] for k, p in reached.items()),
        energy_j=sum(float(p) * energy_by_epoch[k] for k, p in reached.items()),
    )


def _outcomes(
    schedule: Sequence[int], draws: Mapping[int, Counter[int | None]]
) -> dict[int, Fraction]:
    """The chance of reaching the target after each count of epochs (the rest fail).

    ``draws[b]`` counts the epochs size ``b`` needs (None: never), each an
    equally likely recorded run.  Exact: the work done is a
    :class:`~fractions.Fraction`, so a run that needs exactly the epochs left is
    never an epoch off by rounding, and draws that leave the same work done
    merge.
    """
    working: dict[Fraction, Fraction] = {Fraction(0): Fraction(1)}  # work done -> chance
    reached: dict[int, Fraction] = defaultdict(Fraction)  # epochs run -> chance
    for size, before, length in _segments(schedule):
        n = sum(draws[size].values())
        after: dict[Fraction, Fraction] = defaultdict(Fraction)
        for done, chance in working.items():
            for needed, count in draws[size].items():
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
    return dict(reached)


def grown_cost(workload: Workload, run: GrownRun, eta_knob: float) -> float:
    """Expected cost of ``run``; inf if it can miss the target, as for a fixed size."""
    if run.time_s is None or run.energy_j is None:
        return math.inf
    w = workload
    return cost(run.energy_j, run.time_s, eta_knob, w.max_power_w * w.gpu_count)


def compare_growth(workload: Workload, growth: BatchGrowth, eta_knob: float) -> GrowthComparison:
    """Every starting size under the schedule against the best fixed size (the oracle)."""
    runs = [grown_run(workload, growth, start) for start in workload.batch_sizes]
    rows = tuple(
        GrowthRow(
            r.start, workload.expected_cost(r.start, eta_knob), grown_cost(workload, r, eta_knob), r
        )
        for r in runs
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
        rows=rows,
    )


def _segments(schedule: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """``(size, epochs before it, epochs at it)`` for each run of equal sizes."""
    before = 0
    for size, epochs in itertools.groupby(schedule):
        length = sum(1 for _ in epochs)
        yield size, before, length
        before += length


def _ratio(grown: float, fixed: float) -> float:
    """``grown / fixed``; nan where the fixed cost is no yardstick (inf or zero)."""
    if not math.isfinite(fixed) or fixed <= 0.0:
        return math.nan
    return grown / fixed


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None
