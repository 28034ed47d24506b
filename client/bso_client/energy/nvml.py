"""GPU energy and hardware through NVML (the ``pynvml`` module of nvidia-ml-py).

The NVML module is an argument everywhere (``nvml=None`` imports ``pynvml``
then), so tests hand in :class:`bso_client.testing.FakeNvml` instead of
patching globals, and importing this module needs neither pynvml nor a GPU.

Energy per GPU comes from the driver's total-energy counter
(``nvmlDeviceGetTotalEnergyConsumption``, millijoules, Volta and newer): exact
and two reads per window.  GPUs without it get their power
(``nvmlDeviceGetPowerUsage``, milliwatts) sampled by one background thread and
integrated with the trapezoid rule; the reads at window boundaries add a sample
too, so a window's edges are exact in time.  A job may mix both kinds.
"""

# NVML's camelCase function names are kept so that pynvml itself fits NvmlModule.
# ruff: noqa: N802

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from bso.spec import Hardware
from bso_client.energy.base import (
    DEFAULT_MAX_POWER_W,
    Clock,
    EnergyMonitor,
    PeriodicThread,
    warn_fallback,
)
from bso_client.errors import MixedGpuModels, NvmlUnavailableError


class NvmlModule(Protocol):
    """The part of ``pynvml`` this client uses; the real module and the fake both fit."""

    NVMLError: type[Exception]
    NVML_ERROR_NOT_SUPPORTED: int
    NVML_ERROR_FUNCTION_NOT_FOUND: int

    def nvmlInit(self) -> None: ...
    def nvmlShutdown(self) -> None: ...
    def nvmlDeviceGetCount(self) -> int: ...
    def nvmlDeviceGetHandleByIndex(self, index: int, /) -> object: ...
    def nvmlDeviceGetName(self, handle: object, /) -> str | bytes: ...
    def nvmlDeviceGetUUID(self, handle: object, /) -> str | bytes: ...
    def nvmlDeviceGetPowerUsage(self, handle: object, /) -> int: ...
    def nvmlDeviceGetTotalEnergyConsumption(self, handle: object, /) -> int: ...
    def nvmlDeviceGetPowerManagementLimitConstraints(self, handle: object, /) -> list[int]: ...


def load_pynvml() -> NvmlModule:
    """The real ``pynvml`` module, imported now rather than at client import."""
    try:
        import pynvml
    except ImportError as err:
        raise NvmlUnavailableError(
            "pynvml is not installed (it comes with `pip install bso-batch-optimizer-client`)"
        ) from err
    module: NvmlModule = pynvml
    return module


def _text(value: str | bytes) -> str:
    """NVML strings: ``str`` from current pynvml, ``bytes`` from older ones."""
    return (value.decode() if isinstance(value, bytes) else value).strip()


def _unsupported(nvml: NvmlModule, err: Exception) -> bool:
    """The GPU (NOT_SUPPORTED) or the driver (FUNCTION_NOT_FOUND) lacks the call."""
    code = getattr(err, "value", None)
    return code in (nvml.NVML_ERROR_NOT_SUPPORTED, nvml.NVML_ERROR_FUNCTION_NOT_FOUND)


def visible_gpus(nvml: NvmlModule, environ: Mapping[str, str] | None = None) -> list[int]:
    """NVML indices of the GPUs CUDA shows this process, in CUDA's order.

    Follows CUDA's reading of ``CUDA_VISIBLE_DEVICES``: unset means every GPU;
    entries are indices or ``GPU-`` UUIDs (unique prefixes allowed), and the
    list ends at the first entry that names no GPU, so ``-1`` or an empty value
    hide them all.  MIG instances (``MIG-``) raise :class:`NvmlUnavailableError`:
    NVML only measures whole GPUs, which other tenants share.
    """
    env = os.environ if environ is None else environ
    count = nvml.nvmlDeviceGetCount()
    spec = env.get("CUDA_VISIBLE_DEVICES")
    if spec is None:
        return list(range(count))
    uuids: list[str] | None = None
    chosen: list[int] = []
    for raw in spec.split(","):
        entry = raw.strip()
        if entry.startswith("MIG-"):
            raise NvmlUnavailableError(
                f"CUDA_VISIBLE_DEVICES names a MIG instance ({entry}); NVML measures "
                "whole GPUs only, so a MIG slice's energy cannot be told apart"
            )
        if entry.startswith("GPU-"):
            if uuids is None:
                uuids = [
                    _text(nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(i)))
                    for i in range(count)
                ]
            matches = [i for i, uuid in enumerate(uuids) if uuid.startswith(entry)]
            if len(matches) != 1:
                break
            index = matches[0]
        elif entry.isdigit() and int(entry) < count:
            index = int(entry)
        else:
            break
        if index not in chosen:
            chosen.append(index)
    return chosen


def select_gpus(
    nvml: NvmlModule,
    gpu_indices: Sequence[int] | None = None,
    environ: Mapping[str, str] | None = None,
) -> list[int]:
    """NVML indices of the job's GPUs; ``gpu_indices`` are CUDA ordinals (``cuda:N``).

    CUDA numbers GPUs fastest first unless ``CUDA_DEVICE_ORDER=PCI_BUS_ID``,
    while NVML numbers them by PCI bus; the two agree when all GPUs are alike.
    On a machine with unlike GPUs, a subset picked by number may therefore be
    the wrong one: that case warns, as the energy would belong to other GPUs.
    """
    env = os.environ if environ is None else environ
    visible = visible_gpus(nvml, env)
    if gpu_indices is None:
        chosen = visible
    else:
        bad = [i for i in gpu_indices if not 0 <= i < len(visible)]
        if bad:
            raise ValueError(
                f"GPU ordinals {bad} are out of range: {len(visible)} GPU(s) are visible"
            )
        chosen = list(dict.fromkeys(visible[i] for i in gpu_indices))
    count = nvml.nvmlDeviceGetCount()
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    by_number = (
        any(entry.strip().isdigit() for entry in cvd.split(","))
        if cvd is not None
        else gpu_indices is not None
    )
    if len(chosen) < count and by_number and env.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID":
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        names = {_text(nvml.nvmlDeviceGetName(h)) for h in handles}
        if len(names) > 1:
            warn_fallback(
                f"this machine has unlike GPUs ({', '.join(sorted(names))}) and GPUs are "
                "picked by number without CUDA_DEVICE_ORDER=PCI_BUS_ID: CUDA's numbering may "
                "differ from NVML's, so energy may be read from the wrong GPUs"
            )
    return chosen


def _max_power_w(nvml: NvmlModule, handle: object, default_w: float) -> float:
    """The highest power limit the GPU accepts, in watts (``MaxPower`` per GPU)."""
    try:
        _, max_mw = nvml.nvmlDeviceGetPowerManagementLimitConstraints(handle)
    except nvml.NVMLError as err:
        if not _unsupported(nvml, err):
            raise
        warn_fallback(f"a GPU does not report its power limits; using {default_w:g} W as MaxPower")
        return default_w
    return max_mw / 1000.0


def _hardware(
    nvml: NvmlModule, indices: Sequence[int], handles: Sequence[object], default_w: float
) -> Hardware:
    names = [_text(nvml.nvmlDeviceGetName(h)) for h in handles]
    if len(set(names)) > 1:
        found = ", ".join(f"GPU {i}: {name}" for i, name in zip(indices, names, strict=True))
        raise MixedGpuModels(
            f"the job's GPUs are of different models ({found}); bso learns per GPU model, "
            "so run the job on GPUs of one model (see CUDA_VISIBLE_DEVICES)"
        )
    limits = [_max_power_w(nvml, h, default_w) for h in handles]
    # Boards of one model may ship different limits: the highest bounds them all.
    return Hardware(gpu_model=names[0], gpu_count=len(handles), max_power_w=max(limits))


def _open(nvml: NvmlModule | None) -> NvmlModule:
    """Load and initialise NVML; any failure becomes :class:`NvmlUnavailableError`."""
    module = load_pynvml() if nvml is None else nvml
    try:
        module.nvmlInit()
    except module.NVMLError as err:
        raise NvmlUnavailableError(f"NVML did not initialise: {err}") from err
    return module


def _pick(
    nvml: NvmlModule, gpu_indices: Sequence[int] | None, environ: Mapping[str, str] | None
) -> tuple[list[int], list[object]]:
    indices = select_gpus(nvml, gpu_indices, environ)
    if not indices:
        raise NvmlUnavailableError("no GPU is visible to this process (see CUDA_VISIBLE_DEVICES)")
    return indices, [nvml.nvmlDeviceGetHandleByIndex(i) for i in indices]


def discover_hardware(
    gpu_indices: Sequence[int] | None = None,
    *,
    nvml: NvmlModule | None = None,
    environ: Mapping[str, str] | None = None,
    default_max_power_w: float = DEFAULT_MAX_POWER_W,
) -> Hardware:
    """Model, count and per-GPU maximum power limit of the job's GPUs.

    Raises :class:`NvmlUnavailableError` when NVML or a visible GPU is missing and
    :class:`MixedGpuModels` when the GPUs differ.  ``default_max_power_w``
    stands in (with a warning) for a GPU that does not report its limits.
    """
    module = _open(nvml)
    try:
        indices, handles = _pick(module, gpu_indices, environ)
        return _hardware(module, indices, handles, default_max_power_w)
    finally:
        module.nvmlShutdown()


@dataclass(slots=True)
class _SampledGpu:
    """Trapezoid integral of one GPU's power samples."""

    handle: object
    last_s: float
    last_w: float
    joules: float = 0.0

    def add(self, now_s: float, watts: float) -> None:
        self.joules += 0.5 * (watts + self.last_w) * (now_s - self.last_s)
        self.last_s, self.last_w = now_s, watts


class NvmlMonitor(EnergyMonitor):
    """Energy of the job's GPUs, summed: counters where the GPU has one, else sampling.

    Holds an NVML reference (``nvmlInit``) until :meth:`close`, which also stops
    the sampling thread; the thread only exists when some GPU needs sampling.
    A GPU that reports neither energy nor power is left out with a warning;
    when no GPU reports either, :class:`NvmlUnavailableError` lets
    :func:`~bso_client.energy.detect.detect_monitor` fall back.
    """

    kind = "nvml"

    counter_gpus: list[int]
    """NVML indices of the GPUs read through their energy counter."""
    sampled_gpus: list[int]
    """NVML indices of the GPUs whose power is sampled."""
    unmeasured_gpus: list[int]
    """NVML indices of the GPUs that report neither energy nor power (left out)."""

    def __init__(
        self,
        gpu_indices: Sequence[int] | None = None,
        *,
        nvml: NvmlModule | None = None,
        environ: Mapping[str, str] | None = None,
        sample_interval_s: float = 0.1,
        default_max_power_w: float = DEFAULT_MAX_POWER_W,
        clock: Clock = time.monotonic,
    ) -> None:
        module = _open(nvml)
        try:
            indices, handles = _pick(module, gpu_indices, environ)
            super().__init__(_hardware(module, indices, handles, default_max_power_w), clock)
            self._nvml = module
            self._lock = threading.Lock()
            self._interval_s = sample_interval_s
            self._classify(indices, handles)
            self._poller = (
                PeriodicThread(self._sample, sample_interval_s, "bso-nvml-power")
                if self._sampled
                else None
            )
        except BaseException:
            module.nvmlShutdown()
            raise

    def _classify(self, indices: Sequence[int], handles: Sequence[object]) -> None:
        """Read each GPU by counter if it has one, else by power samples, else not at all."""
        nvml = self._nvml
        self._counted: list[tuple[object, int]] = []
        self._sampled: list[_SampledGpu] = []
        self.counter_gpus, self.sampled_gpus, self.unmeasured_gpus = [], [], []
        for index, handle in zip(indices, handles, strict=True):
            try:
                self._counted.append((handle, nvml.nvmlDeviceGetTotalEnergyConsumption(handle)))
                self.counter_gpus.append(index)
                continue
            except nvml.NVMLError as err:
                if not _unsupported(nvml, err):
                    raise
            try:
                watts = nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0
            except nvml.NVMLError as err:
                if not _unsupported(nvml, err):
                    raise
                self.unmeasured_gpus.append(index)
                continue
            self._sampled.append(_SampledGpu(handle, self._clock(), watts))
            self.sampled_gpus.append(index)
        if not self.counter_gpus and not self.sampled_gpus:
            raise NvmlUnavailableError(
                f"GPUs {self.unmeasured_gpus} report neither energy nor power"
            )
        if self.unmeasured_gpus:
            warn_fallback(
                f"GPUs {self.unmeasured_gpus} report neither energy nor power: "
                "their energy is left out"
            )

    @property
    def description(self) -> str:
        parts = []
        if self.counter_gpus:
            parts.append(f"energy counter on GPUs {self.counter_gpus}")
        if self.sampled_gpus:
            parts.append(f"power sampled every {self._interval_s:g} s on GPUs {self.sampled_gpus}")
        if self.unmeasured_gpus:
            parts.append(f"nothing readable on GPUs {self.unmeasured_gpus}")
        hw = self.hardware
        return f"NVML on {hw.gpu_count} x {hw.gpu_model} ({'; '.join(parts)})"

    def _sample(self) -> float:
        """Add a power sample of each sampled GPU; returns their energy so far, in joules."""
        with self._lock:
            for gpu in self._sampled:
                watts = self._nvml.nvmlDeviceGetPowerUsage(gpu.handle) / 1000.0
                gpu.add(self._clock(), watts)
            return sum(gpu.joules for gpu in self._sampled)

    def _energy_j(self) -> float:
        millijoules = sum(
            self._nvml.nvmlDeviceGetTotalEnergyConsumption(handle) - start
            for handle, start in self._counted
        )
        if self._poller is None:
            return millijoules / 1000.0
        self._poller.raise_error()
        return millijoules / 1000.0 + self._sample()

    @property
    def sampling_thread_alive(self) -> bool:
        """Whether the power sampling thread runs (False once closed, or when none is needed)."""
        return self._poller is not None and self._poller.alive

    def _release(self) -> None:
        if self._poller is not None:
            self._poller.stop()
        self._nvml.nvmlShutdown()
