"""The recommendation of a lane and how sure bso is of it.

``confidence`` is the posterior probability that the recommended size costs at
most :data:`TOLERANCE` (1%) more than the cheapest of *all* the lane's candidate
sizes, not only of those measured, so that it can be checked against replays
(``scripts/bench_calibration.py``).  The recommendation is the converged size
most likely to be the cheapest outright (not merely the lowest mean: a size
measured once can be likelier the cheapest than one with a lower mean whose
neighbours disagree), and the gain over the default
is the ratio of the two sizes' costs under the same model (the exponential of
the weighted mean of each draw's log cost ratio).

The model splits a run's cost into what is known and what is noisy:

    cost = (cost of one epoch at this size) x (epochs to reach the target)

* The cost of an epoch is, for a size on given hardware, close to fixed, and one
  epoch measures it: every run with an epoch counts (converged, stopped by bso,
  failed).  Its log is nearly exact for a measured size; for a size never run, a
  smooth curve in log2 batch size through the measured ones says it (falling
  with the batch until the accelerator saturates: prior slope
  :data:`EPOCH_COST_SLOPE`).
* The epochs to target are noisy from run to run: log-normal around a per-size
  mean ``f(b)``, with one noise level pooled over the lane's sizes (prior
  :data:`EPOCH_NOISE`).  ``f`` is a smooth function of ``log2 b``: a line (level
  and slope, the slope weakly positive, :data:`EPOCH_SLOPE`: past the critical
  batch size more epochs are needed, before it about as many) plus an
  integrated random walk (a cubic-smoothing-spline prior) whose curvature scale
  is averaged over :data:`CURVATURES`, weighted by how well each explains the
  lane's measurements (Bayesian model averaging).  Sizes thus inform each other,
  jointly, instead of each unmeasured size wandering on its own.
* A converged run observes its epochs.  A run that bso stopped (cost bound,
  projection) or that hit ``max_epochs`` at a size that converged elsewhere says
  only "more epochs than it ran": a censored observation, whose likelihood
  ``P(epochs > ran)`` reweights the posterior draws (importance sampling).
* Both factors are log-convex in the batch size (see ``shape.shape_log_prior``):
  past the outermost measured sizes each draw of each factor bends only upward
  (``shape.convex_tails``), so a size far outside them does not inherit a falling
  cost all the way to the edge of the range.
* The shape is an assumption, and a lane can break it where nothing was
  measured: a second, cheaper valley beyond a dearer size (a learning rate
  tuned for some sizes, an accelerator that prefers some batch shapes).  So the
  draws are a fixed mixture: with weight :data:`SHAPE_DOUBT` the lane's curve is
  the same Gaussian process with neither the shape prior nor the bent tails,
  under which an unmeasured size beyond a dearer one keeps the chance its
  distance from the measurements leaves it.  The weight is not updated by the
  lane's runs (a Bayesian model average would be): runs show how well each
  model fits where sizes were measured, which says nothing about a valley where
  none were.  The model cannot then be all but certain of a size while sizes
  that could hide a valley are unmeasured.
* A size that failed and never converged (``max_epochs``, a crash, divergence),
  one dropped for failing repeatedly, a size on the far side of a ``max_epochs``
  failure from every converged size (it would need even more epochs), and a
  size that does not fit in memory: not the cheapest.

The probability is counted over :data:`DRAWS` Monte Carlo draws of all sizes'
expected costs with a fixed :data:`SEED`, so a status read is repeatable.
Ranking by expected cost ``exp(log epoch cost + f + noise**2 / 2)`` is ranking by
``log epoch cost + f``, the pooled noise being the same for every size.

With one converged size, its untried neighbours may each be cheaper, so the
confidence stays far from certainty, and below :data:`MAX_WITH_ONE_CONVERGED`
whatever the model says.  A lane with one size left (a single candidate, or every
other ruled out) is sure of it: no other size can be cheaper, so its confidence is
the probability of being within the tolerance of itself, 1.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

from bso.core import bandit, gaussian, shape
from bso.core.cost import COST_TOLERANCE
from bso.core.outcomes import CENSORING_REASONS
from bso.core.policy import drop_repeatedly_failing
from bso.core.state import JobSnapshot
from bso.core.vocabulary import StopReason

Array = NDArray[np.float64]

EPOCH_SLOPE = (0.25, 0.5)
"""Prior mean and standard deviation of the change of log epochs to target per
doubling of the batch: 0 while the batch is below the critical batch size (steps
halve, epochs stay), up to 1 far above it (steps stay, epochs double); the wide
spread lets the epochs fall as well."""
EPOCH_COST_SLOPE = (-0.5, 0.5)
"""Prior mean and standard deviation of the change of log cost of an epoch per
doubling: from -1 (per-step overhead bound: half the steps) to 0 (saturated)."""
LEVEL_SD = 5.0
"""Prior standard deviation of a curve's level: uninformative on a log scale."""
CURVATURES = (0.03, 0.1, 0.3)
"""Scales of the integrated random walk (change of slope per unit of log2 batch),
equally likely a priori: from nearly straight to a slope that swings by its
whole plausible range (about 1, see the slopes) over a few doublings."""
QUIRKS = (0.02, 0.07, 0.2)
"""Standard deviations, equally likely a priori, of a size's own departure from
the smooth curve (a nugget): the learning rate tuned for the default, a size
that happens to suit the hardware, integer epochs.  Without it, sizes measured
once each would pin the curve, and a size's single run would say its mean."""
EPOCH_NOISE = (bandit.PRIOR_COST_CV, 1.0)
"""Prior run-to-run standard deviation of log epochs, and its weight in
pseudo-degrees of freedom.  The centre is the run-to-run cost noise the policy's
Thompson sampling assumes before a lane has repeats (the cost of an epoch is
close to fixed, so a run's cost noise is its epochs' noise; a relative 8% is a
log 0.077): one prior for one quantity in the core.  At 0.15, the confidence's
own earlier guess, lanes were under-confident wherever converged sizes competed
(``scripts/bench_calibration.py --no-landscapes``: hit rate 0.927 at a mean
confidence of 0.849) and the ECE was 0.055 and 0.048 on the two trace sets,
against 0.041 and 0.034 now (docs/benchmarks.md).  One pseudo-degree of
freedom: enough to keep a lane with a repeat or two from trusting a lucky zero
spread, little enough that its own spread decides soon after (at three, lanes
whose runs vary by 5-10% kept the prior's noise for tens of recurrences)."""
EPOCH_COST_NOISE = (0.03, 3.0)
"""The same for the log cost of an epoch (timing jitter, shared machines)."""
EPOCH_COST_QUIRKS = (QUIRKS[0], 1.0)
"""Standard deviations, equally likely a priori, of a size's own departure from the
smooth curve of the cost of an epoch: the epochs' smallest (an epoch's cost is
smooth in the batch size), and one of a factor of e (2.7x).  One run's epoch says
what an epoch of that size cost, and the curve only fills in sizes never run; a
run on a slow node, a cold cache or a shared machine can cost many times the
curve, and with no room to depart from it (0.02 alone, as before) that one run
bent the curve through every size: a default run 20x slower than the rest made a
size measured at twice the cost of another the recommendation, at confidence 100.
Weighted by how well each explains the lane's runs, as the epochs' are, the wide
one matters only where a size is that far off the curve (docs/benchmarks.md,
"Confidence calibration": one run far off the curve)."""
SHAPE_DOUBT = 0.05
"""Weight of the unshaped model in the mixture: the probability, fixed, that a
lane's cost is not log-convex where it was not measured; one lane in twenty, a
stated belief (the smallest of 0.05, 0.1 and 0.2 tried on the held-out kinds'
second draw, each of which ended the misses below).  Without it a
cheaper valley beyond a dearer size had no chance at all: on the held-out
``two-valleys`` landscapes 73% of the recommendations given at >= 99 were wrong
(``scripts/bench_calibration.py --no-traces --held-out-kinds --landscape-seed
12 --by-kind``: 13.8% of the set's, 0.0% with it); the traces' ECE went from
0.028 to 0.035 (docs/benchmarks.md, "Confidence calibration")."""
NOISE_POINTS = 5
"""Quantiles of the noise's posterior the mixture is built on."""
MAX_WITH_ONE_CONVERGED = 0.89
"""Below 0.90: one measured size cannot make bso sure it is the cheapest."""
MODEL_SIZES = 48
HUGE_GRID_STEP = 0.5
"""Doublings between the untried sizes modelled for a lane of more than
:data:`MODEL_SIZES` candidates (see :func:`_modelled_sizes`)."""
"""At most this many sizes enter the model (all of them below that): its time and
memory grow with the square of the sizes (a grid of 256: 0.9 s, 270 MB; a job
may declare 4,096: minutes and tens of GB in a worker).  Past it the model keeps
every size that has runs and the default, and spreads the rest evenly over log2
batch size: neighbours on a dense grid cost alike, and a size left out gets no
chance of its own."""
TOLERANCE = COST_TOLERANCE
"""The confidence is the probability that the recommendation is within this of
the cheapest (:data:`bso.core.cost.COST_TOLERANCE`)."""
DRAWS = 4000
SEED = 20240601
"""Fixed: a status read is repeatable and never touches the job's own generator."""
JITTER = 1e-9


@dataclass(frozen=True, slots=True)
class Recommendation:
    batch_size: int
    confidence: float
    """Posterior probability (0-1) that ``batch_size`` costs at most
    :data:`TOLERANCE` more than the cheapest candidate."""
    expected_cost: float
    gain_over_default: float | None
    """Expected cost of the default over the recommendation's; None when the
    default cannot run (out of memory, failed) on this hardware."""
    probability_best: dict[int, float]
    """Per candidate size that could be the cheapest: the probability that it is
    (strictly, no tolerance)."""
    converged_sizes: int


def recommend(snapshot: JobSnapshot) -> Recommendation | None:
    """The lane's recommendation from its learning view; None before anything converged."""
    means = snapshot.mean_costs()
    eligible = drop_repeatedly_failing(snapshot, sorted(means))
    if not eligible:
        return None
    cheapest_measured = min(eligible, key=lambda b: (means[b], snapshot.default_distance(b), b))
    if means[cheapest_measured] <= 0:
        # Zero costs (eta_knob=1 with no energy measured) tell the sizes apart in
        # nothing: a uniform guess among the candidates, and no gain.
        guess = 1 / len(snapshot.candidate_sizes)
        return Recommendation(
            cheapest_measured, guess, 0.0, None, {cheapest_measured: guess}, len(eligible)
        )
    evidence = _evidence(snapshot, eligible)
    modelled = _modelled_sizes(snapshot, evidence, cheapest_measured)
    sizes = [b for b in modelled if b not in evidence.ruled_out]
    rng = np.random.default_rng(SEED)
    log_cost, weights = _draw_log_costs(snapshot, evidence, rng, modelled)
    contending = log_cost[[modelled.index(b) for b in sizes]]
    winners = np.argmin(contending, axis=0)
    shares = np.bincount(winners, weights=weights, minlength=len(sizes))
    chances = {b: float(shares[i]) for i, b in enumerate(sizes)}
    best = _most_likely_cheapest(snapshot, eligible, means, chances, weights)
    confidence = _chance_within_tolerance(contending, sizes, best, weights)
    # A lone candidate is the cheapest there is; ``sizes`` is not the test, as the
    # model leaves out untried sizes within a step of a kept one (64 beside 68).
    left = [b for b in snapshot.candidate_sizes if b not in evidence.ruled_out]
    if len(eligible) < 2 and len(left) > 1:
        confidence = min(confidence, MAX_WITH_ONE_CONVERGED)
    gain = None
    default = snapshot.spec.default_batch_size
    if default in sizes and best in modelled:
        # Under the model, so the gain agrees with the choice it explains: the
        # weighted mean of each draw's log cost ratio (the pooled noise, the same
        # for both sizes in a draw, cancels; a ratio of the two expected costs
        # would let the few draws with the widest noise decide it).
        log_ratio = log_cost[modelled.index(default)] - log_cost[modelled.index(best)]
        gain = math.exp(float(log_ratio @ weights))
    return Recommendation(best, confidence, means[best], gain, chances, len(eligible))


def _most_likely_cheapest(
    snapshot: JobSnapshot,
    eligible: Sequence[int],
    means: Mapping[int, float],
    chances: Mapping[int, float],
    weights: Array,
) -> int:
    """The converged size most likely to be the cheapest.

    With few runs the smooth model can tell that a size measured once beats one
    whose mean is lower but whose neighbours say otherwise.  A chance within two
    Monte Carlo standard errors of the top (of their difference, from the
    draws' effective number) is a tie the draws cannot resolve: the lower mean
    cost wins, then the size nearer the default, and so do sizes whose measured
    means are equal (the model gives sizes at the edge of the range more
    spread, not more merit).
    Without usable chances the lowest mean wins.
    """

    def measured_order(b: int) -> tuple[float, float, int]:
        return means[b], snapshot.default_distance(b), b

    known = [chances.get(b, 0.0) for b in eligible]
    top = max(known)
    squares = float(np.sum(weights**2))  # 1 / the effective number of draws

    def within_draw_noise(chance: float) -> bool:
        # Variance of a difference of two shares of the same weighted draws.
        gap = top - chance
        return gap <= 2 * math.sqrt(max(top + chance - gap**2, 0.0) * squares)

    tied = [b for b, chance in zip(eligible, known, strict=True) if within_draw_noise(chance)]
    if not tied:  # NaN chances or margin
        return min(eligible, key=measured_order)
    likeliest = min(tied, key=measured_order)
    return min((b for b in eligible if means[b] == means[likeliest]), key=measured_order)


def _chance_within_tolerance(
    contending: Array, sizes: Sequence[int], best: int, weights: Array
) -> float:
    """The weighted share of draws in which ``best`` costs at most :data:`TOLERANCE`
    more than the cheapest of ``sizes`` (the sizes that can be the cheapest, whose
    draws are ``contending``'s rows; 0 where ``best`` is not among them)."""
    if best not in sizes:
        return 0.0
    within = contending[sizes.index(best)] <= contending.min(axis=0) + math.log1p(TOLERANCE)
    return float(weights @ within)


@dataclass
class _Evidence:
    """What the lane's trials say, per candidate size."""

    log_epochs: dict[int, list[float]] = field(default_factory=lambda: defaultdict(list))
    """Log epochs of converged runs."""
    censored: list[tuple[int, float]] = field(default_factory=list)
    """(size, log epochs run) of runs that needed more epochs than they ran."""
    log_epoch_cost: dict[int, list[float]] = field(default_factory=lambda: defaultdict(list))
    ruled_out: set[int] = field(default_factory=set)


def _evidence(snapshot: JobSnapshot, eligible: Sequence[int]) -> _Evidence:
    found = _Evidence()
    candidates = set(snapshot.candidate_sizes)
    failed: set[int] = set()
    too_slow: set[int] = set()
    for t in snapshot.trials:
        b = t.batch_size
        if b not in candidates:
            continue
        if t.epochs > 0 and t.cost > 0:
            found.log_epoch_cost[b].append(math.log(t.cost / t.epochs))
        if t.running:
            continue
        if t.converged:
            if t.epochs > 0:
                found.log_epochs[b].append(math.log(t.epochs))
            continue
        censoring = t.stop_reason in CENSORING_REASONS or t.stop_reason is StopReason.MAX_EPOCHS
        if censoring and t.epochs > 0:
            found.censored.append((b, math.log(t.epochs)))
        if t.stop_reason not in CENSORING_REASONS:
            failed.add(b)
            if t.stop_reason is StopReason.MAX_EPOCHS:
                too_slow.add(b)
    converged = set(eligible)
    found.ruled_out = {b for b in failed if b not in found.log_epochs}
    found.ruled_out |= set(found.log_epochs) - converged  # dropped for failing repeatedly
    for wall in too_slow - set(found.log_epochs):
        # Past a size that could not reach the target in max_epochs, away from every
        # converged size, the epochs needed only grow.
        if all(c < wall for c in converged):
            found.ruled_out |= {b for b in candidates if b > wall}
        elif all(c > wall for c in converged):
            found.ruled_out |= {b for b in candidates if b < wall}
    return found


def _modelled_sizes(snapshot: JobSnapshot, evidence: _Evidence, cheapest: int) -> list[int]:
    """The candidate sizes the model is drawn over.

    Every size with runs (past :data:`MODEL_SIZES`, those nearest the cheapest
    measured one) and the default; then the untried sizes at least
    :data:`shape.MIN_STEP` (on a grid of more than :data:`MODEL_SIZES`,
    :data:`HUGE_GRID_STEP`) from every size already kept, and spread evenly if
    they are more than the room left.  On a grid no denser than that and no
    larger, that is every candidate.
    """
    candidates = snapshot.candidate_sizes
    default = snapshot.spec.default_batch_size
    measured = set(evidence.log_epochs) | set(evidence.log_epoch_cost)
    measured |= {b for b, _ in evidence.censored}

    def distance(b: int) -> float:
        return abs(math.log2(b / cheapest))

    keep = {default} if default in candidates else set()
    keep |= set(sorted(measured & set(candidates), key=distance)[: MODEL_SIZES - len(keep)])
    # Past MODEL_SIZES the untried sizes are kept half a doubling apart: each
    # untried size between two measured ones adds shape constraints, and a few
    # dozen of them leave one draw in 4,000 carrying the answer.
    step = shape.MIN_STEP if len(candidates) <= MODEL_SIZES else HUGE_GRID_STEP
    untried: list[int] = []
    for b in candidates:
        near = [k for k in (*keep, *untried[-1:]) if abs(math.log2(b / k)) < step]
        if b not in keep and not near:
            untried.append(b)
    room = MODEL_SIZES - len(keep)
    if len(untried) > room > 0:
        picks = np.rint(np.linspace(0, len(untried) - 1, num=room))
        untried = [untried[i] for i in picks.astype(int).tolist()]
    return sorted(keep | set(untried[: max(room, 0)]))


def _draw_log_costs(
    snapshot: JobSnapshot, evidence: _Evidence, rng: np.random.Generator, sizes: list[int]
) -> tuple[Array, Array]:
    """Draws (size x draw) of the log expected cost of each of ``sizes``, less the
    ``noise**2 / 2`` common to all sizes in a draw; the draws' normalised weights.
    Runs of sizes not in ``sizes`` are left out.

    The same Gaussian-process draws serve both parts of the mixture:
    shaped (weighted by the shape prior, tails bent) with weight
    ``1 - SHAPE_DOUBT``, and as drawn (weighted by the censored runs alone) with
    weight :data:`SHAPE_DOUBT`; so there are twice :data:`DRAWS` columns."""
    x = np.log2(np.asarray(sizes, dtype=np.float64))
    reference = math.log2(snapshot.spec.default_batch_size)
    index = {b: i for i, b in enumerate(sizes)}
    epochs = {index[b]: v for b, v in evidence.log_epochs.items() if v and b in index}
    epoch_cost = {index[b]: v for b, v in evidence.log_epoch_cost.items() if v and b in index}
    censored: dict[int, list[float]] = defaultdict(list)
    for b, ran in evidence.censored:
        if b in index:
            censored[index[b]].append(ran)
    f, noise, proposal = _draw_curve(
        x,
        reference=reference,
        slope=EPOCH_SLOPE,
        observed=epochs,
        noise_prior=EPOCH_NOISE,
        quirks=QUIRKS,
        rng=rng,
        censored=censored,
    )
    cost, _, _ = _draw_curve(
        x,
        reference=reference,
        slope=EPOCH_COST_SLOPE,
        observed=epoch_cost,
        noise_prior=EPOCH_COST_NOISE,
        quirks=EPOCH_COST_QUIRKS,
        rng=rng,
    )
    measured = np.array([i in epochs for i in range(len(sizes))])
    timed = np.array([i in epoch_cost for i in range(len(sizes))])
    loose = -proposal
    for i, runs in censored.items():
        for ran in runs:
            loose += gaussian.log_normal_cdf((f[i] - ran) / noise)
    shaped = loose + shape.shape_log_prior(x, f, cost, measured, timed)
    bent = shape.convex_tails(x, f, measured) + shape.convex_tails(x, cost, timed)
    log_cost = np.concatenate([bent, f + cost], axis=1)
    weights = np.concatenate(
        [(1 - SHAPE_DOUBT) * _normalised(shaped), SHAPE_DOUBT * _normalised(loose)]
    )
    return log_cost, weights


def _normalised(log_weight: Array) -> Array:
    weights = np.exp(log_weight - log_weight.max())
    return np.asarray(weights / weights.sum(), dtype=np.float64)


def _draw_curve(
    x: Array,
    *,
    reference: float,
    slope: tuple[float, float],
    observed: Mapping[int, Sequence[float]],
    noise_prior: tuple[float, float],
    quirks: Sequence[float],
    rng: np.random.Generator,
    censored: Mapping[int, Sequence[float]] | None = None,
) -> tuple[Array, Array, Array]:
    """Posterior draws (point x draw) of a smooth curve's mean at ``x`` from noisy
    repeated observations at some of the points, and each draw's noise level.

    The curve is ``level + slope * (x - reference)`` plus an integrated random walk
    leaving ``reference`` on either side, whose scale (one of :data:`CURVATURES`)
    and the noise (quantiles of its posterior from the within-point spread) form a
    mixture weighted by the marginal likelihood of the per-point means.  Also the
    log density, per draw, of the censored runs' Gaussian stand-ins, which the
    caller's importance weights divide out.
    """
    points = sorted(observed)
    means = np.array([statistics.fmean(observed[i]) for i in points])
    counts = np.array([len(observed[i]) for i in points], dtype=np.float64)
    squares = sum(sum((v - statistics.fmean(vs)) ** 2 for v in vs) for vs in observed.values())
    freedom = sum(len(vs) - 1 for vs in observed.values())
    noise_levels = gaussian.noise_quantiles(noise_prior, squares, freedom, NOISE_POINTS)
    distance = x - reference
    prior_mean = float(np.mean(means - slope[0] * distance[points])) + slope[0] * distance
    linear = LEVEL_SD**2 + slope[1] ** 2 * np.outer(distance, distance)
    walk = gaussian.integrated_walk(distance)
    eye = np.eye(len(x))
    # Censored runs enter the Gaussian proposal as moment-matched pseudo-observations
    # (one expectation-propagation sweep, at the middle hyperparameters), so that
    # the importance weights that correct for them stay even.
    middle = linear + CURVATURES[1] ** 2 * walk + quirks[len(quirks) // 2] ** 2 * eye
    typical = noise_levels[len(noise_levels) // 2]
    pseudo = gaussian.pseudo_observations(
        *gaussian.condition(middle, prior_mean, points, means, typical**2 / counts)[:2],
        censored or {},
        typical,
    )
    every = points + sorted(pseudo)
    values = np.concatenate([means, [pseudo[i][0] for i in sorted(pseudo)]])
    fixed = np.array([pseudo[i][1] for i in sorted(pseudo)])
    parts: list[tuple[Array, Array, float]] = []
    log_evidence: list[float] = []
    for curvature, quirk, sd in itertools.product(CURVATURES, quirks, noise_levels):
        prior = linear + curvature**2 * walk + quirk**2 * eye
        variance = np.concatenate([sd**2 / counts, fixed])
        mean, cov, evidence = gaussian.condition(prior, prior_mean, every, values, variance)
        parts.append((mean, gaussian.safe_cholesky(cov + JITTER * eye), sd))
        log_evidence.append(evidence)
    evidences = np.asarray(log_evidence)
    probability = np.exp(evidences - evidences.max())
    counts_per_part = rng.multinomial(DRAWS, probability / probability.sum())
    draws, noise = [], []
    for (mean, factor, sd), n in zip(parts, counts_per_part, strict=True):
        if n:
            draws.append(mean[:, None] + factor @ rng.standard_normal((len(x), n)))
            noise.append(np.full(n, sd))
    curve = np.concatenate(draws, axis=1)
    proposal = np.zeros(DRAWS)
    for i, (centre, spread) in pseudo.items():
        proposal += -0.5 * (curve[i] - centre) ** 2 / spread
    return curve, np.concatenate(noise), proposal
