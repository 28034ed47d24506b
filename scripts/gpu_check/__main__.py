"""Check the client's GPU-facing parts on a real NVIDIA GPU, and print what they measure.

The test suite checks these parts against fakes (:mod:`bso_client.testing`);
this runs them on the real thing::

    python3 scripts/gpu_check                       # from the repository root
    python3 scripts/gpu_check --only energy probe   # some sections

Sections (each prints its figures and PASS/FAIL lines; a section that raises
counts as a failure and the next one still runs):

* ``hardware``: :func:`bso_client.energy.nvml.discover_hardware`, :class:`NvmlMonitor`
  and :func:`detect_monitor` against ``nvidia-smi`` and torch.
* ``energy``: a sustained bf16 matmul load and an idle stretch, each inside
  windows of (1) an ``NvmlMonitor`` on the energy counter, (2) an
  ``NvmlMonitor`` forced onto its power-sampling path (the counter hidden),
  (3) an independent 10 Hz ``nvmlDeviceGetPowerUsage`` integration and
  (4) raw ``nvmlDeviceGetTotalEnergyConsumption`` deltas.
* ``oom``: a real ``torch.OutOfMemoryError`` (one oversized allocation, then a
  training step of a trial whose batch size does not fit) through
  ``is_accelerator_out_of_memory``, ``is_allocation_failure``, ``end_reason_for``
  and ``BatchSizeOptimizer`` against
  the in-process :class:`bso.service.BsoService`.
* ``probe``: :func:`find_max_batch_size` on raw allocations and
  :func:`probe_model` on an MLP that fills the GPU below the search limit;
  state and memory before and after.
* ``heartbeat``: a whole trial with the default (NVML) monitor and heartbeats
  every 0.5 s under load: heartbeats, reported energy, throughput, threads.
* ``memprobe``: :func:`probe_memory` (predict, then confirm) on an MLP with
  budgets of 4 GiB, 16 GiB, the free memory and twice the card; ``bso probe
  --device cuda --json`` in process; :func:`bso_client.discovery.probe_plan`
  and its cache.
* ``microbatch``: the micro-batch exploration's pick against exhaustive timing
  of every micro-batch (an MLP and a small convnet), and two runs that explore
  inside themselves with NVML energy against the in-process service.

Exit status: 0 all checks passed, 1 some check failed, 2 no CUDA GPU (skipped).
Needs torch with CUDA, nvidia-ml-py (``pynvml``) and bso's own dependencies
(pydantic, numpy); no Redis, Celery or other service.
"""

# The repository's roots (and scripts/, for this package) go on sys.path
# before the project's imports, so that a plain python3 runs it from a checkout.
# ruff: noqa: E402

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for _path in (ROOT / "scripts", ROOT / "client", ROOT):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

try:
    import torch
except ImportError:  # a machine without torch has no GPU to check either
    print("SKIP: torch is not installed; nothing checked")
    raise SystemExit(2) from None

from bso.spec import Hardware
from bso_client.energy.nvml import discover_hardware
from gpu_check.batch_probe import section_probe
from gpu_check.hardware_energy import section_energy, section_environment, section_hardware
from gpu_check.memory_probe_check import section_memory_probe
from gpu_check.micro_batch_check import section_micro_batch
from gpu_check.out_of_memory import section_oom
from gpu_check.report import Checks, heading
from gpu_check.trial import section_heartbeat
from gpu_check.workloads import free_cuda

SECTIONS = ("hardware", "energy", "oom", "probe", "heartbeat", "memprobe", "microbatch")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument(
        "--only", nargs="+", choices=SECTIONS, default=list(SECTIONS), help="sections to run"
    )
    parser.add_argument("--load-s", type=float, default=25.0, help="seconds of load (energy)")
    args = parser.parse_args(argv)

    if not torch.cuda.is_available():
        print(
            f"SKIP: no CUDA GPU visible to torch {torch.__version__} "
            f"(CUDA build {torch.version.cuda}); nothing checked"
        )
        return 2
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stdout,
        format="  log %(relativeCreated)8.0f ms %(name)s %(levelname)s: %(message)s",
    )
    try:
        nvml = importlib.import_module("pynvml")
    except ImportError:
        print("FAIL: a CUDA GPU is visible but pynvml (nvidia-ml-py) is not installed")
        return 1

    checks = Checks()
    started = time.perf_counter()
    section_environment(nvml)
    # What one section hands a later one; a later section run alone finds its own.
    hardware: Hardware | None = None
    baseline_tflops: float | None = None

    def known_hardware() -> Hardware:
        return hardware if hardware is not None else discover_hardware()

    def run_hardware() -> None:
        nonlocal hardware
        hardware = section_hardware(nvml, checks)

    def run_energy() -> None:
        nonlocal baseline_tflops
        baseline_tflops = section_energy(nvml, known_hardware(), checks, args.load_s)

    steps: dict[str, Callable[[], None]] = {
        "hardware": run_hardware,
        "energy": run_energy,
        "oom": lambda: section_oom(known_hardware(), checks),
        "probe": lambda: section_probe(checks),
        "heartbeat": lambda: section_heartbeat(nvml, known_hardware(), checks, baseline_tflops),
        "memprobe": lambda: section_memory_probe(checks),
        "microbatch": lambda: section_micro_batch(checks),
    }
    for name, run in steps.items():
        if name not in args.only:
            continue
        section_start = time.perf_counter()
        try:
            run()
        except Exception:
            traceback.print_exc(file=sys.stdout)
            checks.check(False, f"section {name} ran to its end")
        finally:
            free_cuda()
        print(f"  ({name}: {time.perf_counter() - section_start:.1f} s)", flush=True)

    heading("summary")
    print(
        f"  {checks.passed} checks passed, {len(checks.failures)} failed, "
        f"{time.perf_counter() - started:.1f} s"
    )
    for what in checks.failures:
        print(f"  FAILED: {what}")
    return 1 if checks.failures else 0


if __name__ == "__main__":
    sys.exit(main())
