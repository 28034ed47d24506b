"""Gaussian building blocks of the confidence model (``bso.core.confidence``)
and of the policy's overrun prediction (``bso.core.bso_policy``).

Conditioning a Gaussian process on noisy observations, moment matching of
censored ones, the integrated-random-walk covariance, quantiles of the noise's
posterior, a vectorised log normal CDF, and the tail and residual life of a
log-normal (for the policy's prediction of a running exploration's remaining
epochs): numerics with no opinion about batch sizes, kept apart so the model
and the policy read as themselves.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from statistics import NormalDist

import numpy as np
from numpy.typing import NDArray

Array = NDArray[np.float64]


def condition(
    prior: Array, prior_mean: Array, points: list[int], values: Array, variance: Array
) -> tuple[Array, Array, float]:
    """Gaussian process posterior mean and covariance at every point given noisy
    observations (repeats allowed), and the log marginal likelihood (less its
    constant)."""
    joint = prior[np.ix_(points, points)] + np.diag(variance)
    chol = np.linalg.cholesky(joint)
    solved = np.linalg.solve(chol, values - prior_mean[points])
    gain = np.linalg.solve(chol, prior[:, points].T)  # chol^-1 (cov of observed, all)
    evidence = -0.5 * float(solved @ solved) - float(np.sum(np.log(np.diag(chol))))
    return prior_mean + gain.T @ solved, prior - gain.T @ gain, evidence


def pseudo_observations(
    mean: Array, cov: Array, censored: Mapping[int, Sequence[float]], sd: float
) -> dict[int, tuple[float, float]]:
    """Per point, the Gaussian (mean, variance) whose product with the point's
    posterior has the moments of the posterior tilted by ``P(value > ran)`` for
    each of its censored runs (numerical quadrature)."""
    found = {}
    for i, ran in censored.items():
        m0, v0 = float(mean[i]), float(cov[i, i])
        s0 = math.sqrt(v0)
        grid = np.linspace(m0 - 6 * s0, max(m0 + 6 * s0, max(ran) + 4 * sd), 400)
        log_p = -0.5 * (grid - m0) ** 2 / v0
        for r in ran:
            log_p += log_normal_cdf((grid - r) / sd)
        p = np.exp(log_p - log_p.max())
        p /= p.sum()
        mw = float(p @ grid)
        vw = float(p @ (grid - mw) ** 2)
        precision = 1 / vw - 1 / v0
        if precision > 1e-3 / v0:
            found[i] = ((mw / vw - m0 / v0) / precision, 1 / precision)
    return found


def integrated_walk(distance: Array) -> Array:
    """Covariance of an integrated Brownian motion (unit scale) started, with zero
    value and slope, at distance 0 and run outward on each side independently."""
    a, b = np.abs(distance)[:, None], np.abs(distance)[None, :]
    near, far = np.minimum(a, b), np.maximum(a, b)
    same_side = np.outer(distance, distance) > 0
    return np.where(same_side, near**2 * (3 * far - near) / 6, 0.0)


def noise_quantiles(
    prior: tuple[float, float], squares: float, freedom: int, points: int
) -> list[float]:
    """Evenly spaced quantiles of the noise's posterior (scaled inverse chi-square
    from the prior's pseudo-observations and the within-point spread)."""
    sd, weight = prior
    dof = weight + freedom
    scale = (weight * sd**2 + squares) / dof
    levels = []
    for k in range(points):
        chi = chi_square_quantile(dof, 1 - (k + 0.5) / points)
        levels.append(math.sqrt(dof * scale / max(chi, 1e-9)))
    return levels


def chi_square_quantile(dof: float, p: float) -> float:
    """The chi-square quantile of lower-tail probability ``p``: exact for one and
    two degrees of freedom (a lane with its first repeats), Wilson-Hilferty above
    (off by far more than the noise matters at one: 2.07 for 1.19 at the top
    noise level)."""
    if dof == 1:
        return NormalDist().inv_cdf((1 + p) / 2) ** 2
    if dof == 2:
        return -2 * math.log(1 - p)
    z = NormalDist().inv_cdf(p)
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def safe_cholesky(cov: Array) -> Array:
    """Cholesky factor of a covariance that rounding may have left barely indefinite."""
    values, vectors = np.linalg.eigh(cov)
    return np.asarray(vectors * np.sqrt(np.clip(values, 0.0, None)), dtype=np.float64)


def log_normal_cdf(z: Array) -> Array:
    """log Phi(z), accurate far into the lower tail (Numerical Recipes' erfc,
    relative error below 1.2e-7), vectorised without scipy."""
    u = -z / math.sqrt(2.0)
    t = 1.0 / (1.0 + 0.5 * np.abs(u))
    poly = -1.26551223 + t * (
        1.00002368
        + t
        * (
            0.37409196
            + t
            * (
                0.09678418
                + t
                * (
                    -0.18628806
                    + t
                    * (
                        0.27886807
                        + t * (-1.13520398 + t * (1.48851587 + t * (-0.82215223 + t * 0.17087277)))
                    )
                )
            )
        )
    )
    log_tail = np.log(t) - u * u + poly  # log erfc(|u|)
    upper = np.log1p(-0.5 * np.exp(log_tail))  # log(1 - erfc(|u|) / 2)
    return np.asarray(np.where(u >= 0, log_tail - math.log(2.0), upper), dtype=np.float64)


FAR_TAIL_Z = 30.0
"""Standard scores past which a normal upper tail (below 1e-197) is taken by its
asymptote: erfc keeps relative precision far beyond, but a ratio of two such
tails near the underflow at z ~ 38 does not."""


def upper_tail(z: float) -> float:
    """P(Z > z) for a standard normal Z, accurate far into the tail (erfc)."""
    return 0.5 * math.erfc(z / math.sqrt(2))


def lognormal_survival(centre: float, spread: float, epochs: float) -> float:
    """P(N > epochs) for log N ~ Normal(centre, spread); 0 past an infinite bound.
    Needs ``spread > 0`` and ``epochs > 0``."""
    if math.isinf(epochs):
        return 0.0
    return upper_tail((math.log(epochs) - centre) / spread)


def lognormal_remaining(centre: float, spread: float, ran: float, cap: float) -> float:
    """E[min(N, cap) - ran | N > ran] for log N ~ Normal(centre, spread): what a
    run that has not ended after ``ran`` still takes, counted up to ``cap``.
    Needs ``spread > 0`` and ``0 < ran <= cap`` (``cap`` may be infinite).

    From upper tails only (erfc), so that it stays accurate for a run far past
    its median."""

    def mass_above(limit: float) -> float:  # E[N; N > limit]
        if math.isinf(limit):
            return 0.0
        shifted = (math.log(limit) - centre - spread**2) / spread
        return math.exp(centre + spread**2 / 2) * upper_tail(shifted)

    z = (math.log(ran) - centre) / spread
    if z > FAR_TAIL_Z:
        # So far out that the tails lose their precision: the excess of log N
        # over log ran is then about spread / z (Mills ratio), N - ran about ran
        # times that.
        return min(ran * spread / z, max(cap - ran, 0.0))
    surviving = lognormal_survival(centre, spread, ran)
    within = mass_above(ran) - mass_above(cap)
    beyond = 0.0 if math.isinf(cap) else cap * lognormal_survival(centre, spread, cap)
    return max((within + beyond) / surviving - ran, 0.0)
