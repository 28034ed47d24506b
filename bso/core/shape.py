"""The shape both factors of a run's cost have in the batch size, imposed on the
confidence model's draws (``bso.core.confidence``).

Epochs to target ~ B + B_crit and the cost of an epoch ~ overhead / B + work
(McCandlish et al. 2018; a per-step overhead) are both log-convex in B: their
log slopes per doubling lie in [0, 1] and [-1, 0] and only grow with the batch.
Past the outermost measured sizes each draw is bent to that shape
(:func:`convex_tails`); between and beyond them, draws that break it lose weight
(:func:`shape_log_prior`).
"""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import NDArray

from bso.core import gaussian

Array = NDArray[np.float64]

SHAPE_TOLERANCE = 0.15
"""Softness, in slope per doubling, of the monotone shape prior: epochs to target
do not fall, and an epoch does not get dearer, as the batch grows (beyond this
much, such draws lose weight as a normal tail)."""
MIN_STEP = 0.1
"""Doublings (7% in batch size) below which two sizes are too close for the shape
priors' slopes, which are per doubling: over a smaller step a slope is a
size's own departure from the curve divided by almost nothing.  An untried size
that close to a kept one is left out of the model (its twin speaks for it), and
steps narrower than this are not held to the shape priors (a user's grid in
steps of 8 around 1024 had one draw in 4,000 carry the answer: 100 for the
dearer of two sizes measured once each)."""


def convex_tails(x: Array, curve: Array, known: NDArray[np.bool_]) -> Array:
    """Each draw of a log-convex factor, bent upward past its outermost known points.

    Both factors of the cost are log-convex in the batch size (see
    :func:`shape_log_prior`): going outward from the known points, a slope can
    only grow to the right and only fall to the left.  So past the edge each
    draw's slope starts from its own chord through the last two known points and,
    step by step, keeps the steeper of that and the draw's own step; the draw is
    rebuilt from the edge with those slopes.  Below the measured sizes an epoch
    thus gets dearer at least as fast as at the edge while epochs fall no
    faster, so a size far away does not inherit a falling cost all the way
    down.  (Weights would enforce this through too few draws: the Gaussian
    curves extrapolate toward their prior slopes, and soft penalties on every
    step leave a handful of the 4,000 draws carrying the answer.)
    """
    points = np.flatnonzero(known)
    if len(points) < 2:
        return curve
    bent = curve.copy()
    edge, inner = points[-1], _chord_end(x, points, points[-1])
    slope = _chord(x, curve, inner, edge, -np.inf)
    for i in range(edge + 1, len(x)):
        width = x[i] - x[i - 1]
        slope = np.maximum(slope, (curve[i] - curve[i - 1]) / width)
        bent[i] = bent[i - 1] + slope * width
    edge, inner = points[0], _chord_end(x, points, points[0])
    slope = _chord(x, curve, edge, inner, np.inf)
    for i in range(edge - 1, -1, -1):
        width = x[i + 1] - x[i]
        slope = np.minimum(slope, (curve[i + 1] - curve[i]) / width)
        bent[i] = bent[i + 1] - slope * width
    return bent


def _chord_end(x: Array, points: NDArray[np.intp], edge: int) -> int | None:
    """The known point nearest ``edge`` and at least :data:`MIN_STEP` inside it."""
    inside = [p for p in points if abs(x[p] - x[edge]) >= MIN_STEP]
    return min(inside, key=lambda p: abs(x[p] - x[edge])) if inside else None


def _chord(x: Array, curve: Array, left: int | None, right: int | None, missing: float) -> Array:
    """Each draw's slope between two points; ``missing`` (no bound) without both."""
    if left is None or right is None:
        return np.full(curve.shape[1], missing)
    return np.asarray((curve[right] - curve[left]) / (x[right] - x[left]), dtype=np.float64)


def shape_log_prior(
    x: Array, f: Array, cost: Array, measured: NDArray[np.bool_], timed: NDArray[np.bool_]
) -> Array:
    """Soft shape constraints on draws, from the usual model of both factors
    (McCandlish et al. 2018 for epochs, a per-step overhead for an epoch's cost):
    epochs ~ B + B_crit, so log epochs rise with a slope between 0 and 1 per
    doubling; epoch cost ~ overhead / B + work, so its log falls with a slope
    between -1 and 0; both slopes grow with the batch (``B / (B + B_crit)``, and
    toward 0 as the accelerator saturates), so each factor and their product are
    log-convex in B: the log cost's slope only grows with the batch.  Violations by more than
    :data:`SHAPE_TOLERANCE` cost weight as a normal tail.

    The prior speaks only where measurements do not: a step (or bend) between
    sizes whose epochs (``measured``) or epoch cost (``timed``) are all observed
    is left to the data, so a lane that breaks the model (a learning rate tuned
    for one size) does not drag its measured sizes toward it."""
    steps = np.diff(x)[:, None]
    epoch_slope = np.diff(f, axis=0) / steps
    cost_slope = np.diff(cost, axis=0) / steps
    shut_epochs = measured[1:] & measured[:-1]
    shut_cost = timed[1:] & timed[:-1]
    # How far (below 0, above 1) the rises are; bends: how much the slope falls.
    epoch_gaps = np.stack([epoch_slope, 1 - epoch_slope])
    cost_gaps = np.stack([-cost_slope, 1 + cost_slope])
    bends = np.diff(epoch_slope + cost_slope, axis=0)[None]
    both = measured & timed
    shut_bends = both[2:] & both[1:-1] & both[:-2]
    wide = np.diff(x) >= MIN_STEP  # narrower steps say nothing about a slope
    log_weight = np.zeros(f.shape[1])
    for gaps, shut, counted in (
        (epoch_gaps, shut_epochs, wide),
        (cost_gaps, shut_cost, wide),
        (bends, shut_bends, wide[1:] & wide[:-1]),
    ):
        tolerance = _tolerance(gaps[:, shut & counted])
        judged = gaps[:, ~shut & counted]
        log_weight += np.sum(gaussian.log_normal_cdf(judged / tolerance), axis=(0, 1))
    return log_weight


def _tolerance(measured_gaps: Array) -> float:
    """:data:`SHAPE_TOLERANCE`, widened by how far the lane's measured steps break
    the shape (their mean over the draws), with the prior worth two steps: a lane
    whose measurements defy the model is not held to it where it has none."""
    misses = np.minimum(np.mean(measured_gaps, axis=-1), 0.0)
    weight = 2.0
    squares = weight * SHAPE_TOLERANCE**2 + float(np.sum(misses**2))
    return math.sqrt(squares / (weight + misses.shape[-1]))
