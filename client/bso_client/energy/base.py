"""What every energy source measures, and the interface the optimizer reads it through.

An :class:`EnergyMonitor` measures elapsed time and energy over *windows*::

    monitor.begin_window()
    train_one_epoch()
    elapsed_s, energy_j = monitor.end_window()

Every monitor keeps a cumulative energy reading and a window is the difference
of two readings, so opening or closing one costs a few sensor reads (well under
a millisecond) and any number of named windows may overlap (one per epoch and
one for the whole trial, say).  A source only has to say how much energy it
counted since it was built (:meth:`EnergyMonitor._energy_j`); the windows are
the same for all of them.

Sources whose counters must be read regularly (RAPL's wrap around, NVML's power
is sampled) read them on a :class:`PeriodicThread`.
"""

from __future__ import annotations

import os
import sys
import threading
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import ClassVar, Literal, NamedTuple, Self

import bso.spec as spec_module
from bso.spec import Hardware

Clock = Callable[[], float]
"""A monotonic clock in seconds (``time.monotonic``; tests inject a fake)."""

MonitorKind = Literal["nvml", "rapl", "time"]

DEFAULT_MAX_POWER_W = 100.0
"""``MaxPower`` per unit when the hardware does not tell its own limit."""

DEFAULT_WINDOW = "epoch"


class EnergyFallbackWarning(UserWarning):
    """Energy is measured less well than it could be: no GPU, no NVML, no RAPL.

    A warning, not an error: the trial still runs and its time is still exact,
    but the user should know that its energy term is degraded or absent.
    """


_LIBRARY_DIRS = tuple(
    str(folder) + os.sep
    for folder in (Path(__file__).resolve().parents[1], Path(spec_module.__file__).resolve().parent)
)
"""Where bso's own frames live: a warning is attributed to the first frame outside."""


def warn_fallback(message: str) -> None:
    """Warn with :class:`EnergyFallbackWarning`, attributed to the caller's own code.

    A fixed ``stacklevel`` pointed at bso's own lines (``optimizer.py:210``),
    which tell the user nothing; the warning is attributed to the first frame
    outside ``bso_client`` and ``bso`` instead: the training script, or the
    framework that built the optimizer.
    """
    level, frame = 1, sys._getframe(1)
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_LIBRARY_DIRS):
        level, frame = level + 1, frame.f_back
    warnings.warn(message, EnergyFallbackWarning, stacklevel=level + 1)


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
