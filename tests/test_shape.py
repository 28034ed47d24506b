"""bso.core.shape: the log-convex shape imposed on the confidence model's draws."""

from __future__ import annotations

import numpy as np
import pytest

from bso.core import shape


def test_a_draw_falling_past_the_last_known_point_is_bent_to_keep_its_chord() -> None:
    """Known at x = 0 and 1 with a chord of slope -1; the draw then rises by only
    0.1 and falls again.  Convexity keeps the slope at least -1 and growing, so
    the points to the right are raised to the chord or to the draw's steeper rise."""
    x = np.array([0.0, 1.0, 2.0, 3.0])
    curve = np.array([[2.0], [1.0], [1.1], [0.0]])
    known = np.array([True, True, False, False])
    bent = shape.convex_tails(x, curve, known)
    assert bent[:2, 0].tolist() == [2.0, 1.0]  # known points are the data's
    assert bent[2, 0] == 1.1  # its own rise beats the chord's fall
    assert bent[3, 0] == pytest.approx(1.2)  # and the slope may not fall again


def test_no_chord_is_drawn_through_two_points_a_hair_apart() -> None:
    """Two known points 0.01 doubling apart: their chord is noise over nothing,
    so the tail follows the draw's own steps only."""
    x = np.array([0.0, 0.01, 1.0])
    curve = np.array([[0.0], [0.5], [0.3]])  # a chord of slope 50
    known = np.array([True, True, False])
    bent = shape.convex_tails(x, curve, known)
    assert bent[2, 0] == 0.3


def test_a_step_narrower_than_min_step_is_not_judged_by_the_slope_priors() -> None:
    """Epochs falling by 0.1 over a hair-wide step (0.01 doubling, a slope of -10)
    cost a draw no weight; the same fall over a whole doubling does."""
    flat = np.array([[1.0], [1.0]])
    falling = np.array([[1.0], [0.9]])
    cost = np.array([[0.0], [-0.5]])
    untried = np.array([False, False])
    narrow, wide = np.array([0.0, 0.01]), np.array([0.0, 1.0])
    assert shape.MIN_STEP > 0.01
    on_narrow = shape.shape_log_prior(narrow, falling, cost, untried, untried)[0]
    assert on_narrow == shape.shape_log_prior(narrow, flat, cost, untried, untried)[0] == 0.0
    on_wide = shape.shape_log_prior(wide, falling, cost, untried, untried)[0]
    assert on_wide < shape.shape_log_prior(wide, flat, cost, untried, untried)[0]
