"""The one cost function: what every size, run and bound in bso is measured in.

Zeus's cost, ``eta * ETA + (1 - eta) * MaxPower * TTA`` (ETA, TTA: energy and
time to reach the target; MaxPower: the power limit times the GPU count).
:mod:`bso.spec` bounds every input so that it stays finite.
"""

from __future__ import annotations


def cost(energy_j: float, time_s: float, eta_knob: float, max_power_w: float) -> float:
    """``eta * ETA + (1 - eta) * MaxPower * TTA``, in joules.

    At most :data:`MAX_COST` for any validated spec and report (module docstring),
    so never infinite.
    """
    return eta_knob * energy_j + (1.0 - eta_knob) * max_power_w * time_s
