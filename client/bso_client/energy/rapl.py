"""CPU package energy from Linux RAPL, for machines without a GPU NVML can read.

The powercap tree (``/sys/class/powercap/intel-rapl:*``) has one cumulative
``energy_uj`` counter per CPU package.  ``MaxPower`` is then the packages' RAPL
power limit (else ``default_max_power_w``), and the hardware's ``gpu_model`` is
"cpu", so that CPU energy is never learned together with GPU energy.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

from bso.spec import Hardware
from bso_client.energy.base import DEFAULT_MAX_POWER_W, Clock, EnergyMonitor, PeriodicThread
from bso_client.errors import RaplUnavailableError

DEFAULT_RAPL_ROOT = Path("/sys/class/powercap")

RAPL_MODEL = "cpu"


@dataclass(frozen=True, slots=True)
class RaplPackage:
    """One CPU package's RAPL energy counter."""

    name: str
    energy_path: Path
    max_energy_range_uj: int
    """The counter wraps back to 0 past this value."""
    max_power_w: float | None
    """The package's long-term power limit, when readable."""


def _read_int(path: Path) -> int:
    return int(path.read_text().strip())


def _package_max_power_w(domain: Path) -> float | None:
    """The long-term constraint's hardware maximum, else its current limit (PL1)."""
    for name in ("constraint_0_max_power_uw", "constraint_0_power_limit_uw"):
        try:
            microwatts = _read_int(domain / name)
        except (OSError, ValueError):
            continue
        if microwatts > 0:
            return microwatts / 1e6
    return None


def find_rapl_packages(root: Path = DEFAULT_RAPL_ROOT) -> list[RaplPackage]:
    """The readable CPU package domains under ``root``, or :class:`RaplUnavailableError`.

    Only top-level ``package-*`` domains are kept: sub-domains (core, uncore,
    dram) are parts of a package's energy or outside it, and ``psys`` (the
    whole platform) would count the packages twice.
    """
    packages: list[RaplPackage] = []
    problems: list[str] = []
    for domain in sorted(root.glob("intel-rapl:*")):
        if domain.name.count(":") != 1:
            continue
        try:
            name = (domain / "name").read_text().strip()
            if not name.startswith("package"):
                continue
            _read_int(domain / "energy_uj")
            max_range = _read_int(domain / "max_energy_range_uj")
        except (OSError, ValueError) as err:
            problems.append(f"{domain.name}: {err}")
            continue
        packages.append(
            RaplPackage(name, domain / "energy_uj", max_range, _package_max_power_w(domain))
        )
    if not packages:
        why = "; ".join(problems) if problems else f"no CPU package domain under {root}"
        raise RaplUnavailableError(why)
    return packages


class RaplMonitor(EnergyMonitor):
    """CPU package energy from Linux RAPL (powercap ``energy_uj`` counters).

    The counters wrap around at ``max_energy_range_uj`` (about 262 kJ, or 4.3 kJ
    on some CPUs: minutes to half an hour at full power), so a window longer
    than one wrap would lose energy.  Every read adds the wrap-corrected delta
    since the previous read, and a background thread reads every
    ``poll_interval_s`` so that no counter can wrap twice between two reads.
    """

    kind = "rapl"

    def __init__(
        self,
        root: Path = DEFAULT_RAPL_ROOT,
        *,
        poll_interval_s: float = 5.0,
        default_max_power_w: float = DEFAULT_MAX_POWER_W,
        clock: Clock = time.monotonic,
    ) -> None:
        self._packages = find_rapl_packages(root)
        limits = [p.max_power_w for p in self._packages if p.max_power_w is not None]
        max_power_w = max(limits) if limits else default_max_power_w
        super().__init__(
            Hardware(gpu_model=RAPL_MODEL, gpu_count=len(self._packages), max_power_w=max_power_w),
            clock,
        )
        self._lock = threading.Lock()
        self._last_uj = [_read_int(p.energy_path) for p in self._packages]
        self._total_uj = 0
        self._poller = PeriodicThread(self._accumulate, poll_interval_s, "bso-rapl-poll")

    @property
    def description(self) -> str:
        names = ", ".join(p.name for p in self._packages)
        return f"RAPL CPU package energy ({names}), MaxPower {self.hardware.max_power_w:g} W each"

    def _accumulate(self) -> None:
        with self._lock:
            for i, package in enumerate(self._packages):
                now = _read_int(package.energy_path)
                last = self._last_uj[i]
                # Wrapped: the counter ran up to max_energy_range_uj and restarted at 0.
                delta = now - last if now >= last else now + package.max_energy_range_uj - last
                self._total_uj += delta
                self._last_uj[i] = now

    def _energy_j(self) -> float:
        self._poller.raise_error()
        self._accumulate()
        return self._total_uj / 1e6

    def _release(self) -> None:
        self._poller.stop()
