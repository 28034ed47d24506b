"""Direct NVML and nvidia-smi readings: the references the client's figures are held against.

Also :class:`CounterlessNvml`, which hides the energy counter so that the
client's power-sampling path (meant for pre-Volta GPUs) runs on a real GPU.
"""

# The NVML proxy keeps NVML's camelCase names.
# ruff: noqa: N802

from __future__ import annotations

import shutil
import subprocess
import threading
import time
from typing import Any

import numpy as np


class CounterlessNvml:
    """The real ``pynvml``, except that the energy counter answers NOT_SUPPORTED.

    Hands :class:`NvmlMonitor` a GPU that looks pre-Volta, so that its
    power-sampling path (thread + trapezoid rule) runs on real power readings.
    """

    def __init__(self, nvml: Any) -> None:
        self._nvml = nvml
        self.NVMLError: type[Exception] = nvml.NVMLError
        self.NVML_ERROR_NOT_SUPPORTED: int = nvml.NVML_ERROR_NOT_SUPPORTED
        self.NVML_ERROR_FUNCTION_NOT_FOUND: int = nvml.NVML_ERROR_FUNCTION_NOT_FOUND

    def nvmlInit(self) -> None:
        self._nvml.nvmlInit()

    def nvmlShutdown(self) -> None:
        self._nvml.nvmlShutdown()

    def nvmlDeviceGetCount(self) -> int:
        return int(self._nvml.nvmlDeviceGetCount())

    def nvmlDeviceGetHandleByIndex(self, index: int, /) -> object:
        handle: object = self._nvml.nvmlDeviceGetHandleByIndex(index)
        return handle

    def nvmlDeviceGetName(self, handle: object, /) -> str | bytes:
        name: str | bytes = self._nvml.nvmlDeviceGetName(handle)
        return name

    def nvmlDeviceGetUUID(self, handle: object, /) -> str | bytes:
        uuid: str | bytes = self._nvml.nvmlDeviceGetUUID(handle)
        return uuid

    def nvmlDeviceGetPowerUsage(self, handle: object, /) -> int:
        return int(self._nvml.nvmlDeviceGetPowerUsage(handle))

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: object, /) -> int:
        raise self._nvml.NVMLError(self._nvml.NVML_ERROR_NOT_SUPPORTED)

    def nvmlDeviceGetPowerManagementLimitConstraints(self, handle: object, /) -> list[int]:
        return list(self._nvml.nvmlDeviceGetPowerManagementLimitConstraints(handle))


class PowerSampler:
    """An integration of power independent of the client's: a thread reading every GPU at 10 Hz.

    Records ``nvmlDeviceGetPowerUsage`` (summed over the GPUs) and, where the
    driver has it, the instantaneous power field (``NVML_FI_DEV_POWER_INSTANT``);
    :meth:`energy_j` integrates either over a time span with the trapezoid rule,
    the span's edges interpolated.
    """

    def __init__(self, nvml: Any, handles: list[Any], interval_s: float = 0.1) -> None:
        self._nvml = nvml
        self._handles = handles
        self._interval_s = interval_s
        self._times: list[float] = []
        self._watts: list[float] = []
        self._instant: list[float] = []
        self._instant_field: int | None = getattr(nvml, "NVML_FI_DEV_POWER_INSTANT", None)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpu-check-power", daemon=True)

    @property
    def has_instant(self) -> bool:
        return self._instant_field is not None

    def _instant_w(self) -> float:
        assert self._instant_field is not None
        total = 0.0
        for handle in self._handles:
            (value,) = self._nvml.nvmlDeviceGetFieldValues(handle, [self._instant_field])
            if value.nvmlReturn != 0:
                raise RuntimeError(f"instant power field returned {value.nvmlReturn}")
            total += float(value.value.uiVal) / 1000.0
        return total

    def _read(self) -> None:
        now = time.monotonic()
        watts = sum(self._nvml.nvmlDeviceGetPowerUsage(h) for h in self._handles) / 1000.0
        instant = float("nan")
        if self._instant_field is not None:
            try:
                instant = self._instant_w()
            except Exception as err:
                print(f"  (instant power field unavailable: {err})", flush=True)
                self._instant_field = None
        with self._lock:
            self._times.append(now)
            self._watts.append(watts)
            self._instant.append(instant)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self._read()

    def start(self) -> None:
        self._read()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def energy_j(self, t0: float, t1: float, *, instant: bool = False) -> float:
        with self._lock:
            times = np.array(self._times)
            watts = np.array(self._instant if instant else self._watts)
        inside = times[(times > t0) & (times < t1)]
        grid = np.concatenate(([t0], inside, [t1]))
        return float(np.trapezoid(np.interp(grid, times, watts), grid))

    def count_between(self, t0: float, t1: float) -> int:
        with self._lock:
            return sum(1 for t in self._times if t0 <= t <= t1)


def nvml_handles(nvml: Any) -> list[Any]:
    return [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]


def counter_mj(nvml: Any, handles: list[Any]) -> int:
    """The energy counters of ``handles`` summed, in millijoules (NVML's unit)."""
    return sum(int(nvml.nvmlDeviceGetTotalEnergyConsumption(h)) for h in handles)


def nvidia_smi(query: str) -> list[list[str]] | None:
    """Rows of ``nvidia-smi --query-gpu=QUERY`` (no header, no units); None without it."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    out = subprocess.run(
        [exe, f"--query-gpu={query}", "--format=csv,noheader,nounits"],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    return [[cell.strip() for cell in line.split(",")] for line in out.strip().splitlines()]
