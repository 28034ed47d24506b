"""The ``environment``, ``hardware`` and ``energy`` sections: what the client sees and measures.

``hardware`` holds :func:`discover_hardware`, :class:`NvmlMonitor` and
:func:`detect_monitor` against torch and ``nvidia-smi``.  ``energy`` measures
one load window and one idle window four ways at once (the monitor on the
energy counter, the monitor on its power-sampling path, an independent 10 Hz
power integration, raw counter deltas), so that a monitor error shows as a
disagreement with three other readings.
"""

from __future__ import annotations

import importlib.metadata
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from bso.spec import Hardware
from bso_client.energy.detect import detect_monitor
from bso_client.energy.nvml import NvmlMonitor, discover_hardware
from gpu_check.nvml_tools import (
    CounterlessNvml,
    PowerSampler,
    counter_mj,
    nvidia_smi,
    nvml_handles,
)
from gpu_check.report import Checks, gib, heading, rel
from gpu_check.workloads import MatmulLoad, free_cuda

ENERGY_TOLERANCE = 0.10
"""How far the sampling monitor and the independent integration may be from the counter."""
COUNTER_STEP_S = 0.125
"""Longest time between updates of the energy counter (about 0.1 s on the H100s
seen, 125 ms at most: docs/gpu.md)."""


def section_environment(nvml: Any) -> None:
    heading("environment")
    print(f"  python {platform.python_version()} on {platform.machine()}, {platform.platform()}")
    cudnn = torch.backends.cudnn.version()  # type: ignore[no-untyped-call]
    print(f"  torch {torch.__version__} (CUDA {torch.version.cuda}), cuDNN {cudnn}")
    try:
        nvml_version = importlib.metadata.version("nvidia-ml-py")
    except importlib.metadata.PackageNotFoundError:
        nvml_version = "unknown"
    nvml.nvmlInit()
    try:
        driver = nvml.nvmlSystemGetDriverVersion()
        cuda_driver = nvml.nvmlSystemGetCudaDriverVersion()
    finally:
        nvml.nvmlShutdown()
    print(f"  nvidia-ml-py {nvml_version}, driver {driver}, driver CUDA {cuda_driver}")
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        print(
            f"  cuda:{i} {props.name}, {gib(props.total_memory)}, "
            f"{props.multi_processor_count} SMs, capability {props.major}.{props.minor}"
        )
    rows = nvidia_smi("name,driver_version,power.limit,power.max_limit,memory.total")
    print(f"  nvidia-smi: {rows}")


def _print_power_limits(nvml: Any) -> None:
    """The current, enforced and settable limits: ``max_power_w`` must be the settable top."""
    nvml.nvmlInit()
    try:
        for i, handle in enumerate(nvml_handles(nvml)):
            current_mw = nvml.nvmlDeviceGetPowerManagementLimit(handle)
            enforced_mw = nvml.nvmlDeviceGetEnforcedPowerLimit(handle)
            low_mw, high_mw = nvml.nvmlDeviceGetPowerManagementLimitConstraints(handle)
            print(
                f"  NVML GPU {i}: power limit {current_mw / 1000:g} W (enforced "
                f"{enforced_mw / 1000:g} W), settable {low_mw / 1000:g}..{high_mw / 1000:g} W"
            )
    finally:
        nvml.nvmlShutdown()


def section_hardware(nvml: Any, checks: Checks) -> Hardware:
    heading("a. hardware: discover_hardware / NvmlMonitor / detect_monitor")
    start = time.perf_counter()
    hardware = discover_hardware()
    took_ms = (time.perf_counter() - start) * 1000
    print(
        f"  discover_hardware(): model={hardware.gpu_model!r} count={hardware.gpu_count} "
        f"max_power_w={hardware.max_power_w:g} key={hardware.key!r} ({took_ms:.1f} ms)"
    )
    _print_power_limits(nvml)
    checks.check(
        hardware.gpu_count == torch.cuda.device_count(),
        "GPU count matches torch.cuda.device_count()",
        f"{hardware.gpu_count} vs {torch.cuda.device_count()}",
    )
    torch_name = torch.cuda.get_device_name(0)
    checks.check(
        hardware.gpu_model == torch_name,
        "GPU model matches torch.cuda.get_device_name(0)",
        f"{hardware.gpu_model!r} vs {torch_name!r}",
    )
    rows = nvidia_smi("name,power.limit,power.max_limit")
    if rows is None:
        print("  nvidia-smi not found: no comparison with it")
    else:
        checks.check(
            len(rows) == hardware.gpu_count, "GPU count matches nvidia-smi", f"{len(rows)} rows"
        )
        names = {row[0] for row in rows}
        checks.check(
            names == {hardware.gpu_model},
            "GPU model matches nvidia-smi",
            f"nvidia-smi {sorted(names)}",
        )
        max_limits = [float(row[2]) for row in rows]
        checks.check(
            abs(max(max_limits) - hardware.max_power_w) < 0.5,
            "max_power_w equals nvidia-smi power.max_limit",
            f"client {hardware.max_power_w:g} W, nvidia-smi power.limit {rows[0][1]} W, "
            f"power.max_limit {rows[0][2]} W",
        )
    with NvmlMonitor() as monitor:
        print(f"  NvmlMonitor: {monitor.description}")
        checks.check(
            monitor.counter_gpus == list(range(hardware.gpu_count)) and not monitor.sampled_gpus,
            "NvmlMonitor reads every GPU through its energy counter",
            f"counter {monitor.counter_gpus}, sampled {monitor.sampled_gpus}, "
            f"unmeasured {monitor.unmeasured_gpus}",
        )
        checks.check(not monitor.sampling_thread_alive, "no sampling thread when counters exist")
        checks.check(monitor.hardware == hardware, "NvmlMonitor.hardware == discover_hardware()")
    detected = detect_monitor()
    try:
        checks.check(
            detected.kind == "nvml" and detected.hardware == hardware,
            "detect_monitor() picks NVML with the same hardware",
            f"kind {detected.kind!r}",
        )
    finally:
        detected.close()
    counterless = NvmlMonitor(nvml=CounterlessNvml(nvml))
    try:
        print(f"  NvmlMonitor with the counter hidden: {counterless.description}")
        checks.check(
            counterless.sampled_gpus == list(range(hardware.gpu_count))
            and counterless.sampling_thread_alive,
            "with the counter hidden, NvmlMonitor samples power on a thread",
        )
    finally:
        counterless.close()
    checks.check(not counterless.sampling_thread_alive, "closing it stops the sampling thread")
    return hardware


@dataclass
class WindowFigures:
    """One window's energy as each of the four readings saw it."""

    label: str
    seconds: float
    raw_j: float
    monitor_j: float
    sampled_monitor_j: float
    own_j: float
    own_instant_j: float | None
    own_samples: int
    tflops: float | None

    def report(self, checks: Checks) -> None:
        s = self.seconds
        print(f"  window {self.label!r}: {s:.2f} s, {self.own_samples} own power samples")
        if self.tflops is not None:
            print(f"    load: {self.tflops:.1f} TFLOP/s (bf16 8192^3 matmul)")
        rows: list[tuple[str, float]] = [
            ("raw TotalEnergyConsumption delta", self.raw_j),
            ("NvmlMonitor (energy counter)", self.monitor_j),
            ("NvmlMonitor (counter hidden: 10 Hz sampling)", self.sampled_monitor_j),
            ("own 10 Hz nvmlDeviceGetPowerUsage integral", self.own_j),
        ]
        if self.own_instant_j is not None:
            rows.append(("own 10 Hz instant-power field integral", self.own_instant_j))
        for name, joules in rows:
            print(
                f"    {name:<46} {joules:10.1f} J  {joules / s:7.1f} W mean  "
                f"{100 * rel(joules, self.raw_j):+6.2f}% vs raw counter"
            )
        tolerance = f"{100 * ENERGY_TOLERANCE:g}%"
        # The monitor and the raw reads are a few ms apart, and the counter moves in
        # steps of about 0.1 s of power: each end of the window may be one step off.
        step_share = 2 * COUNTER_STEP_S / s
        checks.check(
            abs(rel(self.monitor_j, self.raw_j)) < step_share,
            f"{self.label}: NvmlMonitor energy within one counter step at each end "
            f"({100 * step_share:.1f}%) of the raw counter",
            f"{100 * rel(self.monitor_j, self.raw_j):+.3f}%",
        )
        checks.check(
            abs(rel(self.monitor_j, self.own_j)) < ENERGY_TOLERANCE,
            f"{self.label}: NvmlMonitor energy within {tolerance} of own power integral",
            f"{100 * rel(self.monitor_j, self.own_j):+.2f}%",
        )
        checks.check(
            abs(rel(self.sampled_monitor_j, self.raw_j)) < ENERGY_TOLERANCE,
            f"{self.label}: sampling NvmlMonitor within {tolerance} of the raw counter",
            f"{100 * rel(self.sampled_monitor_j, self.raw_j):+.2f}%",
        )


@dataclass
class EnergyMeters:
    """The four readings, open together for the whole section."""

    nvml: Any
    handles: list[Any]
    sampler: PowerSampler
    counter_monitor: NvmlMonitor
    sampled_monitor: NvmlMonitor

    def measure(self, label: str, work: Callable[[], float | None]) -> WindowFigures:
        """Runs ``work`` (returning its TFLOP/s, if a load) inside one window of every reading.

        The raw counter is read just outside the monitors' windows.
        """
        raw0 = counter_mj(self.nvml, self.handles)
        self.counter_monitor.begin_window(label)
        self.sampled_monitor.begin_window(label)
        t0 = time.monotonic()
        tflops = work()
        torch.cuda.synchronize()
        t1 = time.monotonic()
        counter_m = self.counter_monitor.end_window(label)
        sampled_m = self.sampled_monitor.end_window(label)
        raw1 = counter_mj(self.nvml, self.handles)
        sampler = self.sampler
        return WindowFigures(
            label=label,
            seconds=t1 - t0,
            raw_j=(raw1 - raw0) / 1000.0,
            monitor_j=counter_m.energy_j,
            sampled_monitor_j=sampled_m.energy_j,
            own_j=sampler.energy_j(t0, t1),
            own_instant_j=sampler.energy_j(t0, t1, instant=True) if sampler.has_instant else None,
            own_samples=sampler.count_between(t0, t1),
            tflops=tflops,
        )


def print_update_intervals(nvml: Any, handle: Any, load: MatmulLoad, seconds: float = 2.0) -> None:
    """How often the energy counter and the power reading change under load (informational).

    Their step sets how stale a monitor's read can be, hence a window's
    uncertainty at each end.  Queues about ``seconds`` of matrix products
    without waiting, then polls both readings in a tight loop while the GPU
    works through them.
    """
    products = int(seconds * load.rate_per_s)
    torch.cuda.synchronize()
    for _ in range(products):
        torch.matmul(load.a, load.b, out=load.out)
    polls = 0
    read = {
        "energy counter": nvml.nvmlDeviceGetTotalEnergyConsumption,
        "power reading": nvml.nvmlDeviceGetPowerUsage,
    }
    changes: dict[str, list[float]] = {name: [] for name in read}
    last = dict.fromkeys(read, -1)
    start = time.monotonic()
    while time.monotonic() - start < 0.9 * seconds:
        polls += 1
        for name, call in read.items():
            value = int(call(handle))
            if value != last[name]:
                changes[name].append(time.monotonic())
                last[name] = value
    torch.cuda.synchronize()
    for name, times in changes.items():
        gaps = np.diff(np.array(times[1:]))  # the first change is the first read
        if len(gaps):
            print(
                f"  {name} changed {len(times) - 1} times in {0.9 * seconds:.1f} s under load "
                f"({polls} polls): median {1000 * float(np.median(gaps)):.1f} ms apart, "
                f"max {1000 * float(gaps.max()):.1f} ms"
            )
        else:
            print(f"  {name} changed {len(times) - 1} times in {0.9 * seconds:.1f} s")


def section_energy(nvml: Any, hardware: Hardware, checks: Checks, load_s: float) -> float:
    """Returns the TFLOP/s of the load with no extra thread running (the trial's baseline)."""
    heading("b. energy: NvmlMonitor vs own power integration vs raw counter")
    load = MatmulLoad()
    baseline = load.baseline_tflops()
    print(f"  baseline load, no monitor or sampler thread: {baseline:.1f} TFLOP/s")
    nvml.nvmlInit()
    handles = nvml_handles(nvml)
    meters = EnergyMeters(
        nvml=nvml,
        handles=handles,
        sampler=PowerSampler(nvml, handles),
        counter_monitor=NvmlMonitor(),
        sampled_monitor=NvmlMonitor(nvml=CounterlessNvml(nvml), sample_interval_s=0.1),
    )
    meters.sampler.start()
    print(f"  own sampler reads the instant-power field too: {meters.sampler.has_instant}")
    try:
        loaded = meters.measure("load", lambda: load.run(load_s))
        loaded.report(checks)
        print_update_intervals(nvml, handles[0], load)
        load.release()
        free_cuda()
        time.sleep(5.0)  # let the power reading settle after the load
        idle = meters.measure("idle", lambda: time.sleep(10.0))
        idle.report(checks)
        limit_w = hardware.max_power_w * hardware.gpu_count
        load_w, idle_w = loaded.raw_j / loaded.seconds, idle.raw_j / idle.seconds
        checks.check(
            idle_w < load_w <= 1.05 * limit_w,
            "load draws more than idle and no more than the power limit",
            f"idle {idle_w:.1f} W, load {load_w:.1f} W, max limit {limit_w:g} W",
        )
        checks.check(
            loaded.own_samples >= 8 * loaded.seconds,
            "own sampler kept up (>= 8 samples/s)",
            f"{loaded.own_samples / loaded.seconds:.1f} samples/s",
        )
        if loaded.tflops is not None:
            print(
                f"  load TFLOP/s with the sampling monitor and own sampler running: "
                f"{loaded.tflops:.1f} ({100 * rel(loaded.tflops, baseline):+.1f}% vs baseline)"
            )
    finally:
        meters.sampler.stop()
        meters.sampled_monitor.close()
        meters.counter_monitor.close()
        nvml.nvmlShutdown()
    return baseline
