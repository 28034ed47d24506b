"""The one cost function: what every size, run and bound in bso is measured in.

Zeus's cost, ``eta * ETA + (1 - eta) * MaxPower * TTA`` (ETA, TTA: energy and
time to reach the target; MaxPower: the power limit times the GPU count).
:mod:`bso.spec` bounds every input so that it stays finite.
"""

from __future__ import annotations

COST_TOLERANCE = 0.01
"""How much dearer than the cheapest option a choice may be and still count as
right: bso's confidences (a batch size's, a micro-batch's) are the probability
of that.  Options within a percent of each other are a tie no user would pay to
resolve, and a strict "the cheapest" made the confidence of such near-ties a coin
toss between options that are both right (docs/benchmarks.md, "Confidence
calibration")."""


def cost(energy_j: float, time_s: float, eta_knob: float, max_power_w: float) -> float:
    """``eta * ETA + (1 - eta) * MaxPower * TTA``, in joules.

    At most :data:`MAX_COST` for any validated spec and report (module docstring),
    so never infinite.
    """
    return eta_knob * energy_j + (1.0 - eta_knob) * max_power_w * time_s
