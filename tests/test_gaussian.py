"""bso.core.gaussian: the numerics under the confidence model."""

from __future__ import annotations

import math

import numpy as np
import pytest

from bso.core import gaussian


@pytest.mark.parametrize(
    ("dof", "p", "expected"),
    [
        (1, 0.5, 0.454936),  # chi-square medians from tables
        (2, 0.5, 2 * math.log(2)),
        (1, 0.9, 2.705543),
        (2, 0.1, 0.210721),
        (10, 0.5, 9.341818),
    ],
)
def test_chi_square_quantiles(dof: int, p: float, expected: float) -> None:
    assert gaussian.chi_square_quantile(dof, p) == pytest.approx(expected, rel=2e-3)


def test_noise_quantiles_centre_on_the_pooled_spread_and_narrow_with_data() -> None:
    few = gaussian.noise_quantiles((0.15, 1.0), squares=0.0, freedom=0, points=5)
    many = gaussian.noise_quantiles((0.15, 1.0), squares=0.01 * 40, freedom=40, points=5)
    assert few == sorted(few)
    assert few[-1] < 1.5  # exact at one degree of freedom (Wilson-Hilferty: 2.07)
    assert many[0] < 0.1 < many[-1]
    assert many[-1] / many[0] < few[-1] / few[0]


def test_log_normal_cdf_matches_the_normal_distribution_far_into_the_tail() -> None:
    z = np.array([-30.0, -8.0, -2.0, 0.0, 1.5, 6.0])
    got = gaussian.log_normal_cdf(z)
    assert got[0] == pytest.approx(-454.321, rel=1e-4)  # log Phi(-30)
    for value, log_p in zip(z[1:], got[1:], strict=True):
        exact = math.log(0.5 * math.erfc(-float(value) / math.sqrt(2)))
        assert log_p == pytest.approx(exact, rel=1e-6, abs=1e-9)


def test_the_integrated_walk_is_pinned_at_the_reference_and_sides_are_independent() -> None:
    cov = gaussian.integrated_walk(np.array([-2.0, -1.0, 0.0, 1.0, 2.0]))
    assert cov[2, 2] == 0
    assert cov[0, 4] == 0
    assert cov[4, 4] == pytest.approx(8 / 3)  # t**3 / 3 for an integrated Brownian motion
    assert cov[0, 0] == cov[4, 4]


def test_conditioning_on_an_exact_observation_pins_that_point() -> None:
    prior = np.array([[1.0, 0.5], [0.5, 1.0]])
    mean, cov, _ = gaussian.condition(prior, np.zeros(2), [0], np.array([2.0]), np.array([1e-12]))
    assert mean[0] == pytest.approx(2.0)
    assert mean[1] == pytest.approx(1.0)
    assert cov[0, 0] == pytest.approx(0.0, abs=1e-9)
    assert cov[1, 1] == pytest.approx(0.75)


@pytest.mark.parametrize(
    ("ran", "cap"),
    [(5.0, math.inf), (12.0, math.inf), (12.0, 20.0), (25.0, 40.0), (30.0, math.inf)],
)
def test_lognormal_remaining_matches_monte_carlo(ran: float, cap: float) -> None:
    """E[min(N, cap) - ran | N > ran] and P(N > x), N log-normal around 10
    epochs with spread 0.4: before the median, past it, and far in the tail."""
    centre, spread = math.log(10.0), 0.4
    n = np.exp(np.random.default_rng(3).normal(centre, spread, 4_000_000))
    alive = n[n > ran]
    expected = float(np.mean(np.minimum(alive, cap) - ran))
    got = gaussian.lognormal_remaining(centre, spread, ran, cap)
    assert got == pytest.approx(expected, rel=0.02, abs=0.02)
    assert gaussian.lognormal_survival(centre, spread, ran) == pytest.approx(
        alive.size / n.size, rel=0.02, abs=1e-5
    )


def test_lognormal_tails_stay_finite_far_past_the_median() -> None:
    """A run 12 spreads past its median: 1 - cdf would be 0 and the rest 0/0."""
    surviving = gaussian.lognormal_survival(0.0, 0.1, math.exp(1.2))
    assert 0 < surviving < 1e-30
    remaining = gaussian.lognormal_remaining(0.0, 0.1, math.exp(1.2), math.inf)
    assert 0 < remaining < 0.1 * math.exp(1.2)  # about spread**2 * ran / 1.2
    assert gaussian.lognormal_survival(0.0, 0.1, math.inf) == 0.0


@pytest.mark.parametrize("z", [25.0, 29.9, 30.1, 38.3, 38.4, 45.0])
def test_lognormal_remaining_is_smooth_up_to_and_past_the_underflow(z: float) -> None:
    """Near z ~ 38 the upper tails underflow and their ratio is garbage; the
    residual life must follow its asymptote ran * spread / z instead (within
    the asymptote's own error, about 1 / z**2)."""
    ran = math.exp(0.1 * z)
    got = gaussian.lognormal_remaining(0.0, 0.1, ran, math.inf)
    assert got == pytest.approx(ran * 0.1 / z, rel=3 / z**2)
