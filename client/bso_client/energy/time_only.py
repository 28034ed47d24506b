"""The last resort when nothing on this machine reports energy: measure time only.

RAPL is root-only since Linux 5.10 and absent from most containers, so a
machine without an NVML GPU often has no energy counter at all.  Energy is then
reported as 0, so the cost reduces to its time term ``(1 - eta) * MaxPower *
time`` with ``MaxPower = default_max_power_w``: any constant works since it
scales every cost of the job alike, but ``eta_knob`` must be below 1, as at 1
every cost is 0 and bso cannot tell batch sizes apart.

Its hardware is the distinct ``gpu_model`` "cpu-time-only", so that costs
measured this way are never learned together with measured energy.
"""

from __future__ import annotations

import time

from bso.spec import Hardware
from bso_client.energy.base import DEFAULT_MAX_POWER_W, Clock, EnergyMonitor

TIME_ONLY_MODEL = "cpu-time-only"


class TimeOnlyMonitor(EnergyMonitor):
    """Measures time only and reports 0 J: the last resort, see the module docstring."""

    kind = "time"
    measures_energy = False

    def __init__(
        self, *, max_power_w: float = DEFAULT_MAX_POWER_W, clock: Clock = time.monotonic
    ) -> None:
        super().__init__(
            Hardware(gpu_model=TIME_ONLY_MODEL, gpu_count=1, max_power_w=max_power_w), clock
        )

    @property
    def description(self) -> str:
        return (
            f"time only (energy reported as 0 J, MaxPower {self.hardware.max_power_w:g} W): "
            "keep eta_knob below 1"
        )

    def _energy_j(self) -> float:
        return 0.0

    def _release(self) -> None:
        """Nothing to free: no thread, no library."""
