"""What every energy monitor shares: windows and the polling thread (bso_client.energy.base)."""

from __future__ import annotations

import pytest

from bso_client.energy.base import PeriodicThread
from bso_client.energy.nvml import NvmlMonitor
from bso_client.testing import FakeClock, FakeNvml
from tests.fixtures.energy import NO_ENV, gpu


def test_windows_overlap_restart_and_must_be_open() -> None:
    clock = FakeClock()
    nvml = FakeNvml([gpu(0.5)], clock=clock)
    with NvmlMonitor(nvml=nvml, environ=NO_ENV, clock=clock) as monitor:
        monitor.begin_window("trial")
        monitor.begin_window()
        clock.advance(1.0)
        monitor.begin_window()  # an abandoned epoch restarts
        clock.advance(2.0)
        epoch = monitor.end_window()
        trial = monitor.end_window("trial")
        with pytest.raises(RuntimeError, match="no measurement window 'epoch'"):
            monitor.end_window()
    assert epoch.elapsed_s == 2.0
    assert epoch.energy_j == pytest.approx(460.0, abs=1e-2)
    assert trial.elapsed_s == 3.0
    assert trial.energy_j == pytest.approx(690.0, abs=1e-2)


def test_periodic_thread_needs_a_positive_interval() -> None:
    with pytest.raises(ValueError, match="positive"):
        PeriodicThread(lambda: None, 0.0, "bso-test")
