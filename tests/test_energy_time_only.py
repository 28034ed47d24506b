"""The last resort: a monitor that measures time only (bso_client.energy.time_only)."""

from __future__ import annotations

import pytest

from bso_client.energy.base import Measurement
from bso_client.energy.time_only import TIME_ONLY_MODEL, TimeOnlyMonitor
from bso_client.testing import FakeClock


def test_time_only_measures_time_reports_no_energy_and_its_own_hardware() -> None:
    clock = FakeClock()
    with TimeOnlyMonitor(max_power_w=250.0, clock=clock) as monitor:
        assert (monitor.kind, monitor.measures_energy) == ("time", False)
        hardware = monitor.hardware
        assert (hardware.gpu_model, hardware.gpu_count) == (TIME_ONLY_MODEL, 1)
        assert hardware.max_power_w == 250.0
        assert "keep eta_knob below 1" in monitor.description
        monitor.begin_window()
        clock.advance(3.0)
        assert monitor.end_window() == Measurement(3.0, 0.0)
    with pytest.raises(RuntimeError, match="closed"):
        monitor.begin_window()
