"""CPU package energy from RAPL, against a fake powercap tree (bso_client.energy.rapl)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bso_client.energy.base import EnergyFallbackWarning
from bso_client.energy.detect import detect_monitor
from bso_client.energy.rapl import RAPL_MODEL, RaplMonitor, find_rapl_packages
from bso_client.errors import RaplUnavailableError
from bso_client.testing import FakeClock, FakeNvml
from tests.fixtures.energy import NO_ENV, bso_threads, write_rapl


def test_rapl_sums_packages_and_handles_wrap_around(tmp_path: Path) -> None:
    pkg0 = write_rapl(
        tmp_path,
        "intel-rapl:0",
        "package-0",
        900,
        max_range=1000,
        constraint_0_max_power_uw=0,
        constraint_0_power_limit_uw=125_000_000,
    )
    pkg1 = write_rapl(
        tmp_path, "intel-rapl:1", "package-1", 10, constraint_0_max_power_uw=150_000_000
    )
    write_rapl(tmp_path, "intel-rapl:0:0", "core", 0)  # part of package-0
    write_rapl(tmp_path, "intel-rapl:2", "psys", 0)  # the whole platform: would count twice
    clock = FakeClock()
    with pytest.warns(EnergyFallbackWarning, match="RAPL instead"):
        monitor = detect_monitor(nvml=FakeNvml([]), environ=NO_ENV, rapl_root=tmp_path, clock=clock)
    assert isinstance(monitor, RaplMonitor)
    with monitor:
        assert (monitor.hardware.gpu_model, monitor.hardware.gpu_count) == (RAPL_MODEL, 2)
        assert monitor.hardware.max_power_w == 150.0
        monitor.begin_window()
        pkg0.write_text("400\n")  # wrapped once: +500
        pkg1.write_text("20\n")
        monitor.begin_window("probe")  # any read accumulates, as the poll thread does
        pkg0.write_text("300\n")  # wrapped again: +900
        clock.advance(2.0)
        measured = monitor.end_window()
    assert measured.elapsed_s == 2.0
    assert measured.energy_j == pytest.approx((500 + 900 + 10) / 1e6)


def test_rapl_without_limits_uses_the_default_max_power(tmp_path: Path) -> None:
    write_rapl(tmp_path, "intel-rapl:0", "package-0", 1)
    with RaplMonitor(tmp_path, default_max_power_w=80.0) as monitor:
        assert monitor.hardware.max_power_w == 80.0


def test_unreadable_rapl_falls_back_to_time_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_rapl(tmp_path, "intel-rapl:0", "package-0", 1)
    real_read_text = Path.read_text

    def kernel_read_text(path: Path, encoding: str | None = None, errors: str | None = None) -> str:
        # energy_uj is 0400 root-only since Linux 5.10; root ignores file modes, so say it.
        if path.name == "energy_uj":
            raise PermissionError(13, "Permission denied", str(path))
        return real_read_text(path, encoding, errors)

    monkeypatch.setattr(Path, "read_text", kernel_read_text)
    with pytest.raises(RaplUnavailableError, match="Permission denied"):
        find_rapl_packages(tmp_path)
    with pytest.warns(EnergyFallbackWarning, match=r"RAPL: intel-rapl:0: .*Permission denied"):
        monitor = detect_monitor(nvml=FakeNvml([]), environ=NO_ENV, rapl_root=tmp_path)
    assert monitor.kind == "time"
    with pytest.raises(RaplUnavailableError, match="no CPU package domain"):
        find_rapl_packages(tmp_path / "absent")


def test_rapl_poll_thread_stops_on_close(tmp_path: Path) -> None:
    write_rapl(tmp_path, "intel-rapl:0", "package-0", 1)
    before = bso_threads()
    with RaplMonitor(tmp_path, poll_interval_s=0.001):
        assert len(bso_threads()) == len(before) + 1
    assert bso_threads() == before
