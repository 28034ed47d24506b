"""Time and energy of a stretch of training, measured once per epoch.

bso's cost of a trial is ``eta * energy + (1 - eta) * MaxPower * time``
(:func:`bso.spec.cost`), so the training loop has to report both terms for
every epoch.  An :class:`EnergyMonitor` measures them over *windows*::

    monitor = detect_monitor()          # NVML, else RAPL, else time only
    monitor.begin_window()
    train_one_epoch()
    elapsed_s, energy_j = monitor.end_window()

Every monitor keeps a cumulative energy reading and a window is the difference
of two readings, so opening or closing one costs a few sensor reads (well under
a millisecond) and any number of named windows may overlap (one per epoch and
one for the whole trial, say).

Three monitors, best first; :func:`detect_monitor` picks the best that works
and says which:

* :class:`bso_client.nvml.NvmlMonitor`: the GPUs' own energy counters, or
  their sampled power where a GPU has no counter.
* :class:`RaplMonitor`: no usable GPU, so the CPU packages' energy from Linux
  RAPL.  ``MaxPower`` is then the packages' RAPL power limit (else
  ``default_max_power_w``).
* :class:`TimeOnlyMonitor`: nothing readable (RAPL is root-only since Linux
  5.10 and absent from most containers).  Energy is reported as 0, so the cost
  reduces to its time term ``(1 - eta) * MaxPower * time`` with
  ``MaxPower = default_max_power_w``: any constant works since it scales every
  cost of the job alike, but ``eta_knob`` must be below 1, as at 1 every cost is
  0 and bso cannot tell batch sizes apart.

Each fallback is announced with an :class:`EnergyFallbackWarning`, and the
hardware the monitor reports gets a distinct ``gpu_model`` ("cpu" for RAPL,
"cpu-time-only") so that costs measured differently are never learned together.

This module imports neither torch nor pynvml: pynvml is imported when an NVML
monitor is built.
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, ClassVar, Literal, NamedTuple, Self

from bso.spec import Hardware

if TYPE_CHECKING:
    from bso_client.nvml import NvmlModule

logger = logging.getLogger(__name__)

Clock = Callable[[], float]
"""A monotonic clock in seconds (``time.monotonic``; tests inject a fake)."""

MonitorKind = Literal["nvml", "rapl", "time"]

DEFAULT_MAX_POWER_W = 100.0
"""``MaxPower`` per unit when the hardware does not tell its own limit."""

DEFAULT_RAPL_ROOT = Path("/sys/class/powercap")

DEFAULT_WINDOW = "epoch"

TIME_ONLY_MODEL = "cpu-time-only"
RAPL_MODEL = "cpu"


class EnergyFallbackWarning(UserWarning):
    """Energy is measured less well than it could be: no GPU, no NVML, no RAPL.

    A warning, not an error: the trial still runs and its time is still exact,
    but the user should know that its energy term is degraded or absent.
    """


class Measurement(NamedTuple):
    """What one window measured."""

    elapsed_s: float
    energy_j: float
    """Energy of every device the monitor covers, summed; 0 for a time-only monitor."""


class PeriodicThread:
    """Calls ``tick`` every ``interval_s`` seconds on a daemon thread until :meth:`stop`.

    Daemon so that a script that never closes its monitor can still exit;
    :meth:`stop` joins it so that a closed monitor leaves no thread behind.  A
    failing tick ends the thread and is kept in :attr:`error` for the owner to
    raise on its next read, so a broken sensor never goes silent.
    """

    def __init__(self, tick: Callable[[], object], interval_s: float, name: str) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        self._tick = tick
        self._interval_s = interval_s
        self._stopping = threading.Event()
        self.error: Exception | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopping.wait(self._interval_s):
            try:
                self._tick()
            except Exception as err:
                self.error = err
                return

    def raise_error(self) -> None:
        """Raise the error that ended the thread, if any."""
        if self.error is not None:
            raise self.error

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        """Stop and join the thread (idempotent)."""
        self._stopping.set()
        self._thread.join()


class EnergyMonitor(ABC):
    """Measures elapsed time and energy over named, possibly overlapping, windows.

    Subclasses provide :meth:`_energy_j`, a cumulative reading in joules since
    construction; windows are differences of two readings.  A monitor is not
    meant to be shared by threads: open and close its windows from one.
    """

    kind: ClassVar[MonitorKind]
    measures_energy: ClassVar[bool] = True
    """False when :meth:`end_window` always reports 0 J (time-only)."""

    def __init__(self, hardware: Hardware, clock: Clock) -> None:
        self._hardware = hardware
        self._clock = clock
        self._windows: dict[str, tuple[float, float]] = {}
        self._closed = False

    @property
    def hardware(self) -> Hardware:
        """What a trial measured by this monitor runs on (its bso hardware key)."""
        return self._hardware

    @property
    @abstractmethod
    def description(self) -> str:
        """One line for logs: what is measured, and how."""

    @abstractmethod
    def _energy_j(self) -> float:
        """Cumulative energy in joules since construction (never decreases)."""

    @abstractmethod
    def _release(self) -> None:
        """Free threads and libraries; called once by :meth:`close`."""

    def begin_window(self, key: str = DEFAULT_WINDOW) -> None:
        """Open window ``key``; opening one that is already open restarts it.

        Restarting rather than failing lets a loop retry an epoch after an
        exception without first having to close the abandoned window.
        """
        self._check_open()
        energy = self._energy_j()
        self._windows[key] = (self._clock(), energy)

    def end_window(self, key: str = DEFAULT_WINDOW) -> Measurement:
        """Close window ``key`` and return its elapsed time and energy."""
        self._check_open()
        try:
            start_s, start_j = self._windows.pop(key)
        except KeyError:
            raise RuntimeError(f"no measurement window {key!r} is open") from None
        now_s = self._clock()
        return Measurement(now_s - start_s, self._energy_j() - start_j)

    def close(self) -> None:
        """Stop background threads and release the sensors (idempotent)."""
        if not self._closed:
            self._closed = True
            self._windows.clear()
            self._release()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the energy monitor is closed")

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


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


# --- RAPL -----------------------------------------------------------------


class RaplUnavailableError(RuntimeError):
    """No CPU package energy counter can be read under the powercap root."""


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


# --- choosing -------------------------------------------------------------


def detect_monitor(
    gpu_indices: Sequence[int] | None = None,
    *,
    nvml: NvmlModule | None = None,
    environ: Mapping[str, str] | None = None,
    rapl_root: Path = DEFAULT_RAPL_ROOT,
    sample_interval_s: float = 0.1,
    default_max_power_w: float = DEFAULT_MAX_POWER_W,
    clock: Clock = time.monotonic,
) -> EnergyMonitor:
    """The best monitor that works here: NVML, else RAPL, else time only.

    ``gpu_indices`` are CUDA device ordinals (as in ``cuda:1``), relative to
    ``CUDA_VISIBLE_DEVICES`` (read from ``environ``, default ``os.environ``);
    ``None`` means every visible GPU.  Naming GPUs
    makes NVML mandatory: if it cannot measure them, :class:`NvmlUnavailableError`
    is raised instead of falling back, since the caller plainly expects GPUs.
    GPUs of different models raise :class:`MixedGpuModels` either way.  The
    choice is logged at INFO level and is in the monitor's ``kind`` and
    ``description``; every fallback also warns with :class:`EnergyFallbackWarning`.
    """
    from bso_client.nvml import NvmlMonitor, NvmlUnavailableError

    try:
        monitor: EnergyMonitor = NvmlMonitor(
            gpu_indices,
            nvml=nvml,
            environ=environ,
            sample_interval_s=sample_interval_s,
            default_max_power_w=default_max_power_w,
            clock=clock,
        )
    except NvmlUnavailableError as err:
        if gpu_indices is not None:
            raise
        no_gpu = f"no GPU energy (NVML: {err})"
    else:
        logger.info("bso energy monitor: %s", monitor.description)
        return monitor
    try:
        monitor = RaplMonitor(rapl_root, default_max_power_w=default_max_power_w, clock=clock)
    except RaplUnavailableError as err:
        monitor = TimeOnlyMonitor(max_power_w=default_max_power_w, clock=clock)
        message = (
            f"{no_gpu}, and no CPU energy (RAPL: {err}): measuring time only. Energy is "
            f"reported as 0, so the cost is (1 - eta_knob) * {default_max_power_w:g} W * time; "
            "keep eta_knob below 1."
        )
    else:
        message = f"{no_gpu}: measuring CPU package energy with RAPL instead."
    warnings.warn(message, EnergyFallbackWarning, stacklevel=2)
    logger.info("bso energy monitor: %s", monitor.description)
    return monitor
