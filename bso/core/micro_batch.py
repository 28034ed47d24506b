"""Micro-batch exploration: the fastest way to run a given global batch.

Cerebras's automatic batch exploration (the seeds) and DeepSpeed's autotuner keep
the global batch the user chose and look for the micro-batch, the samples each
device runs per forward/backward pass, that trains it cheapest.  Accumulating
``batch_size / (devices x micro_batch)`` passes per optimizer step keeps the
update the same whatever the micro-batch, so every step of the exploration is a
real training step: nothing is thrown away, and the only price is the steps run
at a slower micro-batch than the best.  The largest micro-batch that fits is not
always the fastest (memory-bound kernels at large passes, allocator pressure
near the limit, power rising faster than throughput), which is why it is
measured, not assumed.

This module is the rule, pure and light (no numpy: the training client imports
it): the candidates, the order they are timed in, when to stop, and the
recommendation with its confidence.  The client times the steps.

* **Candidates**: the divisors of the per-device batch up to the largest that
  fits in memory.
* **Order**: from the largest down, each candidate's steps alternating with
  the best so far's.  Per-sample throughput rises with the
  micro-batch until the device saturates, so once two smaller candidates in a
  row are clearly slower than the best so far, smaller ones are not timed at
  all (they are also the slowest steps to spend the budget on).
* **Evidence**: the cost per sample of each timed optimizer step (bso's one
  cost function, :func:`bso.core.cost.cost`, at the job's eta; time alone where
  energy is not measured), in logs.  The first step at each candidate warms up
  kernels and the allocator and is not counted.
* **Model**: per candidate, its mean log cost per sample is Normal around the
  steps' mean, with one timing noise pooled over candidates (prior
  :data:`TIMING_NOISE`).  The confidence is the probability that the
  recommendation is within :data:`bso.core.cost.COST_TOLERANCE` of the fastest
  measured candidate, as for bso's batch sizes.
* **Stop**: once the confidence reaches :data:`STOP_CONFIDENCE`, or the step
  budget (:func:`step_budget`, by default 2% of the run's expected steps) is
  spent.
* **Across recurrences**: a run's counted steps, as :class:`Timings` (count,
  mean, spread: all the model reads), go to the service with the trial; a later
  run of the same lane and global batch starts from their sum (``known``), so
  it times only what is still uncertain, and nothing once the recommendation
  is :data:`STOP_CONFIDENCE` likely right.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from statistics import NormalDist, fmean

from bso.core.cost import COST_TOLERANCE, cost
from bso.spec import BatchSplit
from bso.status import percent

DEFAULT_SHARE = 0.02
"""Share of a run's expected optimizer steps the exploration may take."""
WARMUP_STEPS = 1
"""Steps at each candidate that are run but not counted (kernel selection, allocator)."""
MIN_TIMED_STEPS = 3
"""Counted steps at each candidate timed before it is compared."""
TIMING_NOISE = (0.05, 2.0)
"""Prior standard deviation of a step's log cost per sample around its candidate's
mean, and its weight in pseudo-degrees of freedom: steps of one training loop vary
by a few percent (data loading, other processes); a lane's own steps soon decide."""
CUTOFF_AFTER = 2
"""Consecutive hopeless candidates below the best after which smaller ones are not
timed: throughput mostly rises with the micro-batch, but one size can dip on its
own (a pass that just misses a cache, an awkward kernel shape)."""
STOP_CONFIDENCE = 0.95
"""The exploration ends once the recommendation is this likely right."""
DROP_BELOW = 0.01
"""A candidate this unlikely to be within the tolerance of the fastest is not timed again."""
KEPT_RUNS = 20
"""Runs of a lane and global batch whose timings a new run starts from (the latest):
a lane's machines, drivers and libraries change over months, and old timings
should not outweigh what the hardware does now.  It also bounds what a service
sums (a tenant's own reports cannot grow a sum past its bounds)."""
GRID_POINTS = 401
NORMAL = NormalDist()


def candidates(batch_size: int, devices: int = 1, largest_fitting: int | None = None) -> list[int]:
    """The micro-batches that run ``batch_size`` on ``devices`` in whole passes: the
    divisors of the per-device batch, up to ``largest_fitting`` (None: all)."""
    if batch_size < 1 or devices < 1:
        raise ValueError(f"batch_size and devices must be positive, got {batch_size}, {devices}")
    if batch_size % devices:
        raise ValueError(f"batch_size {batch_size} does not split evenly over {devices} devices")
    per_device = batch_size // devices
    limit = per_device if largest_fitting is None else min(per_device, largest_fitting)
    return [m for m in range(1, limit + 1) if per_device % m == 0]


def split_candidates(split: BatchSplit, largest_fitting: int | None = None) -> list[int]:
    """The candidates of one global batch as a lane runs it: the divisors of its batch
    per device up to ``largest_fitting``, by default the lane's pass (what its
    sizes were probed to fit).  Exploring, adopting a settled choice and ``bso
    status`` all judge among these."""
    return candidates(split.per_device, 1, largest_fitting or split.micro_batch_size)


def accumulation_steps(batch_size: int, devices: int, micro_batch: int) -> int:
    """Passes per optimizer step: ``batch_size / (devices x micro_batch)``."""
    per_device, rest = divmod(batch_size, devices)
    passes, remainder = divmod(per_device, micro_batch)
    if rest or remainder:
        raise ValueError(
            f"micro-batch {micro_batch} x {devices} devices does not divide batch {batch_size}"
        )
    return passes


def step_budget(expected_steps: int, share: float = DEFAULT_SHARE) -> int:
    """Optimizer steps the exploration may take in a run of ``expected_steps``."""
    if not 0 <= share <= 1:
        raise ValueError(f"share must be a fraction from 0 to 1, got {share}")
    return int(expected_steps * share)


@dataclass(frozen=True, slots=True)
class Timings:
    """A candidate's counted steps as the model reads them: how many, the mean of
    their log cost per sample, and the sum of squared deviations from it.  Two
    runs' timings add up exactly (:meth:`merged`), so a service keeps and sends
    these, never the steps."""

    steps: int
    mean: float
    squares: float = 0.0

    @classmethod
    def of(cls, log_costs: Sequence[float]) -> Timings:
        mean = fmean(log_costs)
        return cls(len(log_costs), mean, sum((v - mean) ** 2 for v in log_costs))

    def merged(self, other: Timings) -> Timings:
        """The timings of both sets of steps together (Chan et al.'s pairwise update)."""
        steps = self.steps + other.steps
        delta = other.mean - self.mean
        mean = self.mean + delta * other.steps / steps
        squares = self.squares + other.squares + delta**2 * self.steps * other.steps / steps
        return Timings(steps, mean, squares)


def merge_timings(*runs: Mapping[int, Timings]) -> dict[int, Timings]:
    """Per candidate, the timings of several runs together."""
    total: dict[int, Timings] = {}
    for run in runs:
        for micro, timings in run.items():
            total[micro] = total[micro].merged(timings) if micro in total else timings
    return total


@dataclass(frozen=True, slots=True)
class MicroBatchChoice:
    """The current recommendation, as the interim log line gives it."""

    micro_batch: int
    performance: float
    """Cost per sample of the base micro-batch over the recommendation's (1.20: 20%
    more samples for the same cost); 1.0 when the base is not measured yet."""
    confidence: float
    """Probability (0-1) that it is within the tolerance of the fastest measured."""
    probability: Mapping[int, float]
    """Per contending candidate, the same probability for it."""

    @property
    def score(self) -> int:
        """The confidence as ``bso status`` gives one: 0-100, rounded down."""
        return percent(self.confidence) or 0

    def log_line(self) -> str:
        return (
            f"current recommended micro_batch_size: {self.micro_batch}, estimated "
            f"performance: {self.performance:.2f}x base, confidence score: "
            f"{self.score} (out of 100)"
        )


@dataclass
class MicroBatchExploration:
    """The exploration of one run: which micro-batch each step uses, and what was learnt.

    ``base`` is the micro-batch the performance is quoted against (the user's,
    or the largest that fits); it is timed first, then the others from the
    largest down.  ``known``: the timings earlier runs of the same lane and
    global batch left (candidates no longer among ``candidates`` are ignored).
    """

    candidates: Sequence[int]
    base: int
    budget: int
    eta_knob: float = 0.5
    max_power_w: float = 1.0
    known: Mapping[int, Timings] = field(default_factory=dict)
    steps: dict[int, list[float]] = field(default_factory=dict)
    """Log cost per sample of every step this run took at each candidate, warm-up included."""
    dropped: set[int] = field(default_factory=set)
    unmeasured: int = 0
    """Steps that cost nothing measurable (energy only, a counter that had not
    ticked): taken, so they count against the budget, but they say nothing."""
    last: int | None = None
    """The micro-batch of the latest step."""

    def __post_init__(self) -> None:
        if not self.candidates or self.base not in self.candidates:
            raise ValueError(f"base {self.base} is not among the candidates {self.candidates}")
        self.candidates = sorted(set(self.candidates), reverse=True)
        self.known = {m: t for m, t in self.known.items() if m in self.candidates}
        self._drop_hopeless()

    @property
    def steps_taken(self) -> int:
        return sum(len(v) for v in self.steps.values()) + self.unmeasured

    def record(self, micro_batch: int, samples: int, time_s: float, energy_j: float = 0.0) -> None:
        """One optimizer step at ``micro_batch``: ``samples`` trained in ``time_s``."""
        if micro_batch not in self.candidates:
            raise ValueError(f"micro-batch {micro_batch} is not a candidate")
        if samples < 1 or not time_s > 0:
            raise ValueError(f"a step trains samples in time: got {samples} in {time_s} s")
        if energy_j < 0:
            raise ValueError(f"a step's energy cannot be negative: got {energy_j} J")
        per_sample = cost(energy_j, time_s, self.eta_knob, self.max_power_w) / samples
        if per_sample <= 0:
            self.unmeasured += 1
            return
        self.steps.setdefault(micro_batch, []).append(math.log(per_sample))
        self.last = micro_batch
        if self.timed(micro_batch) >= MIN_TIMED_STEPS:
            self._drop_hopeless()

    def next_micro_batch(self) -> int | None:
        """The micro-batch of the next step, or None: the exploration is over.

        A candidate being timed alternates with the best so far, step by step
        (after its warm-up): a machine whose load drifts then slows both alike,
        instead of whichever candidate happened to run in the slow minute.  A
        run whose earlier runs' timings already make the recommendation
        :data:`STOP_CONFIDENCE` likely right takes no step at all (the choice
        is settled: :func:`learned_choice` says the same).
        """
        if self.steps_taken >= self.budget or len(self.candidates) == 1:
            return None
        current = self.choice()
        if self.known and not self.steps and current.confidence >= STOP_CONFIDENCE:
            return None
        best = current.micro_batch
        order = [self.base] + [m for m in self.candidates if m != self.base]  # then descending
        hopeless_below = 0
        for m in order:
            if m in self.dropped:
                hopeless_below += m != self.base and m < best
                if hopeless_below >= CUTOFF_AFTER:
                    break  # smaller than hopeless candidates below the best: slower still
                continue
            hopeless_below = 0
            if self.timed(m) < MIN_TIMED_STEPS:
                return self._paired(m, best)
        if current.confidence >= STOP_CONFIDENCE:
            return None
        live = [m for m in current.probability if m not in self.dropped]
        if len(live) < 2:
            return None
        challenger = min(live, key=lambda m: (self.timed(m), -m))  # the least measured
        return self._paired(challenger, best)

    def _paired(self, challenger: int, best: int) -> int:
        """``challenger``, or its partner when the challenger ran the step before
        (past its warm-up): the best so far, or, when the challenger is the best,
        the candidate timed that comes closest to it."""
        warming = len(self.steps.get(challenger, [])) < WARMUP_STEPS
        if warming or self.last != challenger:
            return challenger
        partner = best
        if challenger == best:
            others = [m for m in self._contenders() if m != challenger and m not in self.dropped]
            if not others:
                return challenger
            means, _ = self._posterior([challenger, *others])
            partner = min(others, key=lambda m: (means[m], -m))
        return partner

    def choice(self) -> MicroBatchChoice:
        """The recommendation from the candidates timed :data:`MIN_TIMED_STEPS` times
        (the base, at confidence 0, before any is)."""
        contenders = self._contenders()
        if not contenders:
            return MicroBatchChoice(self.base, 1.0, 0.0, {})
        means, spreads = self._posterior(contenders)
        best = min(contenders, key=lambda m: (means[m], -m))
        if len(contenders) == 1:
            # Nothing to compare with yet: any candidate may be the fastest.
            chance = {best: 1 / len(self.candidates)}
        else:
            chance = {m: _within_tolerance(m, means, spreads) for m in contenders}
        performance = math.exp(means[self.base] - means[best]) if self.base in means else 1.0
        return MicroBatchChoice(best, performance, chance[best], chance)

    def timed(self, micro_batch: int) -> int:
        """Steps counted at ``micro_batch`` (warm-ups left out), earlier runs' included."""
        timings = self.timings(micro_batch)
        return timings.steps if timings else 0

    def timings(self, micro_batch: int) -> Timings | None:
        """What is known of ``micro_batch``: earlier runs' timings and this run's
        counted steps together; None before any is counted."""
        mine = self.steps.get(micro_batch, [])[WARMUP_STEPS:]
        known = self.known.get(micro_batch)
        if not mine:
            return known
        return known.merged(Timings.of(mine)) if known else Timings.of(mine)

    def run_timings(self) -> dict[int, Timings]:
        """This run's counted steps per candidate: what it sends the service."""
        return {
            m: Timings.of(steps[WARMUP_STEPS:])
            for m, steps in self.steps.items()
            if len(steps) > WARMUP_STEPS
        }

    def cost_per_sample(self, micro_batch: int) -> float | None:
        """The geometric mean of its counted steps' cost per sample (what the
        model compares: the performance is a ratio of two of these); None
        before one is counted."""
        timings = self.timings(micro_batch)
        return math.exp(timings.mean) if timings else None

    def _contenders(self) -> list[int]:
        return [m for m in self.candidates if self.timed(m) >= MIN_TIMED_STEPS]

    def _drop_hopeless(self) -> None:
        ready = self._contenders()
        if len(ready) < 2:
            return
        means, spreads = self._posterior(ready)
        for m in ready:
            if _within_tolerance(m, means, spreads) < DROP_BELOW:
                self.dropped.add(m)

    def _posterior(self, sizes: Sequence[int]) -> tuple[dict[int, float], dict[int, float]]:
        """Each candidate's posterior mean and spread of its mean log cost per sample."""
        counted = {m: t for m in sizes if (t := self.timings(m)) is not None}
        squares = sum(t.squares for t in counted.values())
        freedom = sum(t.steps - 1 for t in counted.values())
        prior_sd, prior_weight = TIMING_NOISE
        noise = math.sqrt((prior_weight * prior_sd**2 + squares) / (prior_weight + freedom))
        means = {m: t.mean for m, t in counted.items()}
        spreads = {m: noise / math.sqrt(t.steps) for m, t in counted.items()}
        return means, spreads


def _within_tolerance(
    candidate: int, means: Mapping[int, float], spreads: Mapping[int, float]
) -> float:
    """P(candidate's mean <= every other's + log(1 + tolerance)), the means
    independent Normals: integrated over the candidate's mean on a grid."""
    others = [m for m in means if m != candidate]
    if not others:
        return 1.0
    slack = math.log1p(COST_TOLERANCE)
    centre, spread = means[candidate], spreads[candidate]
    total = 0.0
    step = 16 / (GRID_POINTS - 1)
    for k in range(GRID_POINTS):
        z = -8 + k * step
        x = centre + z * spread
        beaten = 1.0
        for m in others:
            beaten *= 1 - NORMAL.cdf((x - slack - means[m]) / spreads[m])
        weight = 0.5 if k in (0, GRID_POINTS - 1) else 1.0
        total += weight * NORMAL.pdf(z) * beaten * step
    return min(max(total, 0.0), 1.0)


def learned_choice(
    known: Mapping[int, Timings], options: Sequence[int] | None = None
) -> MicroBatchChoice | None:
    """The recommendation from earlier runs' timings alone among ``options`` (the
    candidates; None: the divisors of the largest timed), its performance quoted
    against the largest candidate: what a run adopts without exploring once its
    confidence reaches :data:`STOP_CONFIDENCE`, and what ``bso status`` shows per
    lane and global batch.  None without timings of any candidate."""
    if options is None and known:
        options = candidates(max(known))
    timed = {m: t for m, t in known.items() if options and m in options}
    if not timed or not options:
        return None
    return MicroBatchExploration(options, max(options), budget=0, known=timed).choice()
