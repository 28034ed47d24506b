"""A fake NVML that behaves like ``pynvml`` for the calls bso_client makes.

Not a mock returning constants: each simulated GPU draws power that follows a
load curve over (injectable) time, its total-energy counter is the exact
integral of that power, and the failure modes are the real library's, raised
as real ``pynvml.NVMLError`` subclasses: ``UNINITIALIZED`` before
``nvmlInit`` or after the last ``nvmlShutdown``, ``INVALID_ARGUMENT`` for a bad
index or a foreign handle, ``NOT_SUPPORTED`` for the energy counter of a
pre-Volta GPU (or for power readings and limits where a GPU lacks them), and
``LIBRARY_NOT_FOUND`` / ``DRIVER_NOT_LOADED`` from ``nvmlInit`` on a machine
without a driver, and ``GPU_IS_LOST`` from every call on a GPU that fell off
the bus.  Hand an instance to any ``nvml=`` parameter::

    clock = FakeClock()
    nvml = FakeNvml([FakeGpu(load=ConstantLoad(1.0))] * 2, clock=clock)
    monitor = NvmlMonitor(nvml=nvml, clock=clock)

Power is instantaneous here; a real GPU's reading is an average over a short
window (up to a second on recent boards), which the trapezoid rule smooths out.
"""

# NVML's camelCase function names are kept: this class stands in for the module.
# ruff: noqa: N802

from __future__ import annotations

import itertools
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import pynvml


class LoadCurve(Protocol):
    """Utilisation over time, 0 (idle) to 1 (flat out); ``t`` counts from when it was set."""

    def load(self, t: float) -> float: ...

    def integral(self, t0: float, t1: float) -> float:
        """Exact integral of :meth:`load` over ``[t0, t1]``, so counters stay consistent."""
        ...


def _check_fraction(value: float, what: str) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{what} must be within [0, 1], got {value}")


@dataclass(frozen=True, slots=True)
class ConstantLoad:
    fraction: float = 1.0

    def __post_init__(self) -> None:
        _check_fraction(self.fraction, "fraction")

    def load(self, t: float) -> float:
        return self.fraction

    def integral(self, t0: float, t1: float) -> float:
        return self.fraction * (t1 - t0)


@dataclass(frozen=True, slots=True)
class SineLoad:
    """``mean + amplitude * sin(2 pi t / period_s)``: a curve that trapezoids only approximate."""

    mean: float = 0.5
    amplitude: float = 0.5
    period_s: float = 1.0

    def __post_init__(self) -> None:
        _check_fraction(self.mean - self.amplitude, "mean - amplitude")
        _check_fraction(self.mean + self.amplitude, "mean + amplitude")
        if not self.period_s > 0:
            raise ValueError(f"period_s must be positive, got {self.period_s}")

    def load(self, t: float) -> float:
        return self.mean + self.amplitude * math.sin(2 * math.pi * t / self.period_s)

    def integral(self, t0: float, t1: float) -> float:
        omega = 2 * math.pi / self.period_s
        return self.mean * (t1 - t0) + self.amplitude / omega * (
            math.cos(omega * t0) - math.cos(omega * t1)
        )


@dataclass(frozen=True, slots=True)
class PiecewiseLinearLoad:
    """Straight lines between ``(t, load)`` points, flat before the first and after the last."""

    points: tuple[tuple[float, float], ...]

    def __post_init__(self) -> None:
        if not self.points:
            raise ValueError("give at least one (t, load) point")
        times = [t for t, _ in self.points]
        if times != sorted(times):
            raise ValueError("points must be sorted by time")
        for _, fraction in self.points:
            _check_fraction(fraction, "load")

    def load(self, t: float) -> float:
        first_t, first = self.points[0]
        if t <= first_t:
            return first
        for (t0, y0), (t1, y1) in itertools.pairwise(self.points):
            if t <= t1:
                return y0 + (y1 - y0) * (t - t0) / (t1 - t0) if t1 > t0 else y1
        return self.points[-1][1]

    def integral(self, t0: float, t1: float) -> float:
        # Linear between consecutive breakpoints, so the trapezoid rule is exact there.
        cuts = [t0, *(t for t, _ in self.points if t0 < t < t1), t1]
        return sum(
            0.5 * (self.load(a) + self.load(b)) * (b - a) for a, b in itertools.pairwise(cuts)
        )


class FakeClock:
    """Time that moves only when told to, for deterministic tests."""

    def __init__(self, start_s: float = 1000.0) -> None:
        self.now_s = start_s

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("a monotonic clock cannot go back")
        self.now_s += seconds


@dataclass(frozen=True, slots=True)
class FakeGpu:
    """One simulated GPU: power = idle + (peak - idle) * load."""

    name: str = "NVIDIA A100-SXM4-40GB"
    idle_power_w: float = 60.0
    peak_power_w: float = 400.0
    power_limits_w: tuple[float, float] | None = (100.0, 400.0)
    """(min, max) power limit; None: the GPU does not report them (NOT_SUPPORTED)."""
    load: LoadCurve = ConstantLoad(0.5)
    energy_counter: bool = True
    """False for pre-Volta GPUs: the total-energy counter raises NOT_SUPPORTED."""
    power_sensor: bool = True
    """False for GPUs without a power reading: power usage raises NOT_SUPPORTED."""
    uuid: str | None = None
    """Defaults to a UUID made from the device index."""
    initial_energy_mj: int = 987_654_321
    """Counter value at start: real counters count from the driver's load, not from 0."""


@dataclass(frozen=True, slots=True)
class FakeHandle:
    """What ``nvmlDeviceGetHandleByIndex`` returns: opaque to callers, like the real handle."""

    owner: int
    index: int


class _Device:
    """A GPU's history of load curves, from which power and energy follow."""

    def __init__(self, gpu: FakeGpu, index: int, start_s: float) -> None:
        self.gpu = gpu
        self.uuid = gpu.uuid or f"GPU-{index:08x}-fake-4000-8000-{index:012x}"
        self.segments: list[tuple[float, LoadCurve]] = [(start_s, gpu.load)]
        self.start_s = start_s
        self.lost = False

    def power_w(self, t: float) -> float:
        start, curve = self.segments[0]
        for seg_start, seg_curve in self.segments:
            if seg_start <= t:
                start, curve = seg_start, seg_curve
        gpu = self.gpu
        return gpu.idle_power_w + (gpu.peak_power_w - gpu.idle_power_w) * curve.load(t - start)

    def energy_j(self, t0: float, t1: float) -> float:
        """Exact energy over ``[t0, t1]`` (time before the device's start counts nothing)."""
        gpu = self.gpu
        ends = [s for s, _ in self.segments[1:]] + [math.inf]
        total = 0.0
        for (start, curve), end in zip(self.segments, ends, strict=True):
            a, b = max(t0, start), min(t1, end)
            if b > a:
                total += gpu.idle_power_w * (b - a) + (
                    gpu.peak_power_w - gpu.idle_power_w
                ) * curve.integral(a - start, b - start)
        return total


class FakeNvml:
    """Stands in for the ``pynvml`` module: same function names, arguments and errors."""

    NVMLError = pynvml.NVMLError
    NVML_ERROR_UNINITIALIZED = pynvml.NVML_ERROR_UNINITIALIZED
    NVML_ERROR_INVALID_ARGUMENT = pynvml.NVML_ERROR_INVALID_ARGUMENT
    NVML_ERROR_NOT_SUPPORTED = pynvml.NVML_ERROR_NOT_SUPPORTED
    NVML_ERROR_FUNCTION_NOT_FOUND = pynvml.NVML_ERROR_FUNCTION_NOT_FOUND
    NVML_ERROR_LIBRARY_NOT_FOUND = pynvml.NVML_ERROR_LIBRARY_NOT_FOUND
    NVML_ERROR_DRIVER_NOT_LOADED = pynvml.NVML_ERROR_DRIVER_NOT_LOADED

    def __init__(
        self,
        gpus: Sequence[FakeGpu] = (),
        *,
        clock: Callable[[], float] = time.monotonic,
        init_error: int | None = None,
        names_as_bytes: bool = False,
    ) -> None:
        """``init_error`` makes every ``nvmlInit`` fail with that code (no driver, say);
        ``names_as_bytes`` returns names and UUIDs as bytes, like older pynvml releases.
        """
        self._clock = clock
        self._init_error = init_error
        self._names_as_bytes = names_as_bytes
        self._lock = threading.Lock()
        self._refcount = 0
        now = clock()
        self._devices = [_Device(gpu, i, now) for i, gpu in enumerate(gpus)]
        self.calls: Counter[str] = Counter()
        """How often each NVML function was called, to check what a monitor costs."""

    @classmethod
    def without_driver(cls, code: int = pynvml.NVML_ERROR_LIBRARY_NOT_FOUND) -> FakeNvml:
        """A machine without a GPU driver: ``nvmlInit`` fails as the real one does."""
        return cls(init_error=code)

    # --- controls and ground truth for tests ------------------------------

    @property
    def initialized(self) -> bool:
        """Whether some ``nvmlInit`` is still not matched by an ``nvmlShutdown``."""
        return self._refcount > 0

    def set_load(self, index: int, load: LoadCurve) -> None:
        """From now on GPU ``index`` follows ``load`` (its time counting from now)."""
        with self._lock:
            self._devices[index].segments.append((self._clock(), load))

    def lose_gpu(self, index: int) -> None:
        """GPU ``index`` falls off the bus: every call on it now raises GPU_IS_LOST."""
        with self._lock:
            self._devices[index].lost = True

    def power_w(self, index: int, at_s: float) -> float:
        """The true power of GPU ``index`` at time ``at_s``."""
        return self._devices[index].power_w(at_s)

    def energy_j(self, index: int, start_s: float, end_s: float) -> float:
        """The true energy of GPU ``index`` between two clock readings."""
        return self._devices[index].energy_j(start_s, end_s)

    # --- the pynvml API ----------------------------------------------------

    def _enter(self, name: str) -> None:
        self.calls[name] += 1
        if self._refcount == 0:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)

    def _device(self, name: str, handle: object) -> _Device:
        self._enter(name)
        if not isinstance(handle, FakeHandle) or handle.owner != id(self):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        device = self._devices[handle.index]
        if device.lost:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        return device

    def _text(self, value: str) -> str | bytes:
        return value.encode() if self._names_as_bytes else value

    def nvmlInit(self) -> None:
        with self._lock:
            self.calls["nvmlInit"] += 1
            if self._init_error is not None:
                raise pynvml.NVMLError(self._init_error)
            self._refcount += 1

    def nvmlShutdown(self) -> None:
        with self._lock:
            self._enter("nvmlShutdown")
            self._refcount -= 1

    def nvmlDeviceGetCount(self) -> int:
        with self._lock:
            self._enter("nvmlDeviceGetCount")
            return len(self._devices)

    def nvmlDeviceGetHandleByIndex(self, index: int, /) -> object:
        with self._lock:
            self._enter("nvmlDeviceGetHandleByIndex")
            if not 0 <= index < len(self._devices):
                raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            return FakeHandle(id(self), index)

    def nvmlDeviceGetName(self, handle: object, /) -> str | bytes:
        with self._lock:
            return self._text(self._device("nvmlDeviceGetName", handle).gpu.name)

    def nvmlDeviceGetUUID(self, handle: object, /) -> str | bytes:
        with self._lock:
            return self._text(self._device("nvmlDeviceGetUUID", handle).uuid)

    def nvmlDeviceGetPowerUsage(self, handle: object, /) -> int:
        """Milliwatts, as an integer like the real call."""
        with self._lock:
            device = self._device("nvmlDeviceGetPowerUsage", handle)
            if not device.gpu.power_sensor:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
            return round(device.power_w(self._clock()) * 1000)

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: object, /) -> int:
        """Millijoules since the (simulated) driver load, as an integer like the real call."""
        with self._lock:
            device = self._device("nvmlDeviceGetTotalEnergyConsumption", handle)
            if not device.gpu.energy_counter:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
            joules = device.energy_j(device.start_s, self._clock())
            return device.gpu.initial_energy_mj + math.floor(joules * 1000)

    def nvmlDeviceGetPowerManagementLimitConstraints(self, handle: object, /) -> list[int]:
        """``[min, max]`` in milliwatts."""
        with self._lock:
            device = self._device("nvmlDeviceGetPowerManagementLimitConstraints", handle)
            if device.gpu.power_limits_w is None:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
            low, high = device.gpu.power_limits_w
            return [round(low * 1000), round(high * 1000)]
