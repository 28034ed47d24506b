"""The recommendation of a lane and how sure bso is of it.

``confidence`` is the posterior probability that the recommended size is the
cheapest of *all* the lane's candidate sizes, not only of those measured, so
that it can be checked against replays (``scripts/bench_calibration.py``).
The model, on log cost:

* a converged size: its mean cost, with the run-to-run noise pooled over sizes
  (:func:`bso.core.bandit.pooled_cost_cv`) shrinking as ``1 / sqrt(runs)``;
* a size not measured yet (untried, or only interrupted): a random walk along
  log batch size from its converged neighbours (a Brownian bridge between two
  of them), its variance growing with the distance; beyond the measured range,
  a cost that rises toward the edge is assumed to keep rising at that rate.
  The walk's step scale is how much log cost changed between the lane's
  converged sizes, shrunk toward :data:`PRIOR_STEP_SD` per doubling while few
  pairs are measured;
* a size that bso stopped for cost: the same, but never below what the run
  proved it costs (its cost per epoch times one more epoch than it ran);
* a size that failed (``max_epochs``, a crash, divergence) and never converged,
  or that does not fit in memory: not the cheapest.

With one converged size, its untried neighbours are each as likely to be
cheaper as not, so the confidence stays far from certainty; the clamp to
:data:`MAX_WITH_ONE_CONVERGED` only matters for a job with a single candidate.
"""

from __future__ import annotations

import itertools
import math
import statistics
from dataclasses import dataclass

import numpy as np

from bso.core.bandit import pooled_cost_cv
from bso.core.outcomes import CENSORING_REASONS
from bso.core.policy import drop_repeatedly_failing
from bso.core.state import JobSnapshot

PRIOR_STEP_SD = 0.3
"""Prior standard deviation of the change of log cost per doubling of the batch
size: a third either way, the order of what one doubling does to the cost of
epochs and to the epochs needed."""
PRIOR_STEP_WEIGHT = 0.5
"""Pseudo-pairs of neighbouring converged sizes the prior is worth."""
MAX_WITH_ONE_CONVERGED = 0.89
"""Below 0.90: one measured size cannot make bso sure it is the cheapest."""
DRAWS = 4000
SEED = 20240601
"""Fixed: a status read is repeatable and never touches the job's own generator."""


@dataclass(frozen=True, slots=True)
class Recommendation:
    batch_size: int
    confidence: float
    """Posterior probability (0-1) that ``batch_size`` is the cheapest candidate."""
    expected_cost: float
    gain_over_default: float | None
    """Expected cost of the default over the recommendation's; None when the
    default cannot run (out of memory, failed) on this hardware."""
    probability_best: dict[int, float]
    """Per candidate size that could be the cheapest."""
    converged_sizes: int


def recommend(snapshot: JobSnapshot) -> Recommendation | None:
    """The lane's recommendation from its learning view; None before anything converged."""
    means = snapshot.mean_costs()
    eligible = drop_repeatedly_failing(snapshot, sorted(means))
    if not eligible:
        return None
    converged = {b: snapshot.converged_costs(b) for b in eligible}
    best = min(eligible, key=lambda b: (means[b], snapshot.default_distance(b), b))
    if means[best] <= 0:
        # Zero costs (eta_knob=1 with no energy measured) tell the sizes apart in
        # nothing: a uniform guess among the candidates, and no gain.
        guess = 1 / len(snapshot.candidate_sizes)
        return Recommendation(best, guess, 0.0, None, {best: guess}, len(converged))
    locations, scales, floors = _posteriors(snapshot, converged)
    sizes = sorted(locations)
    rng = np.random.default_rng(SEED)
    draws = np.stack(
        [
            np.maximum(rng.normal(locations[b], scales[b], size=DRAWS), floors.get(b, -np.inf))
            for b in sizes
        ]
    )
    winners = np.bincount(np.argmin(draws, axis=0), minlength=len(sizes)) / DRAWS
    chances = {b: float(winners[i]) for i, b in enumerate(sizes)}
    confidence = chances[best]
    if len(converged) < 2:
        confidence = min(confidence, MAX_WITH_ONE_CONVERGED)
    default = snapshot.spec.default_batch_size
    gain = None
    if default in converged:
        gain = means[default] / means[best]
    elif default in locations:  # not measured yet: its posterior mean
        gain = float(np.mean(np.exp(draws[sizes.index(default)]))) / means[best]
    return Recommendation(best, confidence, means[best], gain, chances, len(converged))


def _posteriors(
    snapshot: JobSnapshot, converged: dict[int, list[float]]
) -> tuple[dict[int, float], dict[int, float], dict[int, float]]:
    """Location and scale of each candidate's log expected cost, and log floors."""
    cv = pooled_cost_cv(converged)
    noise = math.log1p(cv)
    known = sorted(converged)
    location = {b: math.log(statistics.fmean(converged[b])) for b in known}
    scale = {b: noise / math.sqrt(len(converged[b])) for b in known}
    step = _step_sd(known, location)
    failed: set[int] = set()
    floors: dict[int, float] = {}
    for t in snapshot.trials:
        if t.running or t.converged or t.batch_size in converged:
            continue
        if t.stop_reason in CENSORING_REASONS and t.epochs > 0:
            floor = math.log(t.cost / t.epochs * (t.epochs + 1))
            floors[t.batch_size] = max(floors.get(t.batch_size, -math.inf), floor)
        else:
            failed.add(t.batch_size)
    for b in snapshot.candidate_sizes:
        if b in location or (b in failed and b not in floors):
            continue
        location[b], scale[b] = _bridge(b, known, location, scale, step)
    return location, scale, floors


def _step_sd(known: list[int], location: dict[int, float]) -> float:
    """Per-doubling standard deviation of the change of log cost between converged
    neighbours, shrunk toward the prior."""
    squares, pairs = 0.0, 0
    for a, b in itertools.pairwise(known):
        squares += (location[b] - location[a]) ** 2 / math.log2(b / a)
        pairs += 1
    prior = PRIOR_STEP_SD**2 * PRIOR_STEP_WEIGHT
    return math.sqrt((squares + prior) / (pairs + PRIOR_STEP_WEIGHT))


def _bridge(
    size: int, known: list[int], location: dict[int, float], scale: dict[int, float], step: float
) -> tuple[float, float]:
    """A random walk in log cost along log2 batch size, pinned at the converged sizes."""
    below = [b for b in known if b < size]
    above = [b for b in known if b > size]
    if below and above:
        lo, hi = below[-1], above[0]
        d_lo, d_hi = math.log2(size / lo), math.log2(hi / size)
        w = d_lo / (d_lo + d_hi)
        mean = (1 - w) * location[lo] + w * location[hi]
        variance = step**2 * d_lo * d_hi / (d_lo + d_hi)
        variance += ((1 - w) * scale[lo]) ** 2 + (w * scale[hi]) ** 2
        return mean, math.sqrt(variance)
    side = below if below else above[::-1]  # converged sizes, nearest last
    anchor = side[-1]
    distance = abs(math.log2(size / anchor))
    rise = 0.0
    if len(side) >= 2:
        # Cost that rises toward the edge keeps rising past it (costs are usually
        # unimodal in the batch size); a falling one is not assumed to go on falling.
        inner = side[-2]
        rise = max(0.0, (location[anchor] - location[inner]) / abs(math.log2(anchor / inner)))
    return location[anchor] + rise * distance, math.sqrt(step**2 * distance + scale[anchor] ** 2)
