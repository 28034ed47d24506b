"""Which energy source measures this job: NVML, else RAPL, else time only.

The order is the order of quality: the GPUs' own counters measure what the
training spends; RAPL measures the CPU packages, which is all there is without
a GPU; time only is what is left.  Each fallback is announced with an
:class:`~bso_client.energy.base.EnergyFallbackWarning` (attributed to the
caller's code, one line; the INFO log names the monitor only when nothing fell
back), since it changes what the job's costs mean.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from bso_client.energy.base import DEFAULT_MAX_POWER_W, Clock, EnergyMonitor, warn_fallback
from bso_client.energy.nvml import NvmlModule, NvmlMonitor
from bso_client.energy.rapl import DEFAULT_RAPL_ROOT, RaplMonitor
from bso_client.energy.time_only import TimeOnlyMonitor
from bso_client.errors import NvmlUnavailableError, RaplUnavailableError

logger = logging.getLogger(__name__)


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
    ``None`` means every visible GPU.  Naming GPUs makes NVML mandatory: if it
    cannot measure them, :class:`~bso_client.errors.NvmlUnavailableError` is
    raised instead of falling back, since the caller plainly expects GPUs.  GPUs
    of different models raise :class:`~bso_client.errors.MixedGpuModels` either
    way.  The choice is logged at INFO level and is in the monitor's ``kind``
    and ``description``; every fallback also warns with
    :class:`~bso_client.energy.base.EnergyFallbackWarning`.
    """
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
    warn_fallback(message)  # the one line a fallback gets: no INFO repeating it
    return monitor
