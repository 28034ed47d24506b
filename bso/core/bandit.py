"""Gaussian Thompson sampling over batch sizes (costs are minimized).

Two flavours share this module:

* :func:`zeus_thompson_pick` follows Zeus: each arm's reward variance is
  estimated from that arm's own few samples, with the job's prior mean and
  precision, and every arm is pulled ``mab_num_explorations`` times first.
* :func:`pooled_thompson_pick` is bso's: cost noise is modelled as relative
  (a coefficient of variation shared by all sizes of the job), so one noisy
  arm does not get a wide posterior just because it has two samples.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

# Prior belief on run-to-run cost noise when the job has too few repeats to say.
PRIOR_COST_CV = 0.08
PRIOR_COST_CV_WEIGHT = 4.0


def windowed(costs: Sequence[float], window_size: int) -> list[float]:
    """The most recent ``window_size`` observations (all of them when 0)."""
    return list(costs[-window_size:]) if window_size > 0 else list(costs)


def zeus_thompson_pick(
    observations: Mapping[int, Sequence[float]],
    *,
    prior_mean: float,
    prior_precision: float,
    num_explorations: int,
    rng: np.random.Generator,
) -> int:
    """Zeus-style Gaussian TS on rewards ``-cost``; returns the chosen batch size."""
    arms = sorted(observations)
    for arm in arms:
        if len(observations[arm]) < num_explorations:
            return arm
    best_arm, best_sample = arms[0], -math.inf
    for arm in arms:
        rewards = -np.asarray(observations[arm], dtype=float)
        if rewards.size == 0:
            mean, precision = prior_mean, prior_precision
        else:
            variance = float(np.var(rewards))
            if variance <= 0:
                # One sample (or identical ones) says nothing about the spread:
                # assume Zeus-like 10% noise rather than infinite confidence.
                variance = (0.1 * float(np.mean(rewards))) ** 2 or 1.0
            reward_precision = 1.0 / variance
            precision = prior_precision + rewards.size * reward_precision
            weighted_sum = prior_precision * prior_mean + reward_precision * float(rewards.sum())
            mean = weighted_sum / precision
        sample = float(rng.normal(mean, 1.0 / math.sqrt(precision))) if precision > 0 else math.inf
        if sample > best_sample:
            best_arm, best_sample = arm, sample
    return best_arm


def pooled_cost_cv(observations: Mapping[int, Sequence[float]]) -> float:
    """Relative cost noise pooled over all sizes, shrunk toward a prior."""
    squares, count = 0.0, 0
    for costs in observations.values():
        mean = float(np.mean(costs)) if len(costs) else 0.0
        # Relative noise of zero costs (eta_knob=1 without energy) is undefined: skip.
        if len(costs) >= 2 and mean > 0:
            squares += float(np.sum(((np.asarray(costs) - mean) / mean) ** 2))
            count += len(costs) - 1
    prior_squares = PRIOR_COST_CV**2 * PRIOR_COST_CV_WEIGHT
    return math.sqrt((squares + prior_squares) / (count + PRIOR_COST_CV_WEIGHT))


def posterior(costs: Sequence[float], cv: float) -> tuple[float, float]:
    """Mean and standard deviation of the expected cost of one size."""
    mean = float(np.mean(costs))
    return mean, cv * mean / math.sqrt(len(costs))


@dataclass(frozen=True, slots=True)
class Prediction:
    """A size with no converged run, as a log-normal guess of its expected cost."""

    log_median: float
    log_sd: float
    log_floor: float
    """What its stopped runs proved, or the bound that stopped them: it costs at
    least this much."""


def pooled_thompson_pick(
    observations: Mapping[int, Sequence[float]],
    rng: np.random.Generator,
    tie_break: Callable[[int], float] = float,
    predicted: Mapping[int, Prediction] | None = None,
) -> int:
    """bso's TS: sample each size's expected cost from its posterior, take the lowest.

    ``predicted`` sizes take part with their predictive distribution, so a size
    stopped early on a projection is revisited as often as it may be the best.
    Always one of the arms: equal samples (equal or zero costs) go to the arm with
    the lowest ``tie_break`` (the caller passes the distance to the default).
    """
    cv = pooled_cost_cv(observations)
    samples: dict[int, float] = {}
    for arm in sorted(observations):
        mean, std = posterior(observations[arm], cv)
        sample = float(rng.normal(mean, std))
        samples[arm] = sample if math.isfinite(sample) else math.inf
    for arm, guess in sorted((predicted or {}).items()):
        if arm not in samples:
            draw = max(float(rng.normal(guess.log_median, guess.log_sd)), guess.log_floor)
            samples[arm] = math.exp(draw)
    return min(samples, key=lambda arm: (samples[arm], tie_break(arm), arm))
