"""The ``heartbeat`` section: one whole trial under a real load, as a training job would run it.

``BatchSizeOptimizer`` with its default monitor (NVML) and heartbeats every
0.5 s, three epochs of matmul load: the energy and time the service records
must be the raw counter's over the epochs, and the heartbeats must come while
training and stop after it; the load's speed against the baseline is printed
for information (clocks vary with power and heat, so it is not a check).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from bso.core.vocabulary import StopReason, TrialStatus
from bso.spec import Hardware, JobSpec
from bso.wire.events import Heartbeat, HeartbeatAck
from bso_client.errors import TrainFailError
from bso_client.optimizer import BatchSizeOptimizer
from gpu_check.nvml_tools import counter_mj, nvml_handles
from gpu_check.recording_service import RecordingService
from gpu_check.report import Checks, heading, rel
from gpu_check.workloads import MatmulLoad, free_cuda

JOB_ID = "gpu-check-heartbeat"
HEARTBEAT_S = 0.5
EPOCH_S = 4.0


def section_heartbeat(
    nvml: Any, hardware: Hardware, checks: Checks, baseline_tflops: float | None
) -> None:
    """``baseline_tflops``: the energy section's, or None to measure it here."""
    heading("e. a whole trial under load: heartbeats, reported energy, threads")
    load = MatmulLoad()
    if baseline_tflops is None:  # the energy section did not run
        baseline_tflops = load.baseline_tflops()
    else:
        load.run(2.0)  # warm up
    nvml.nvmlInit()
    handles = nvml_handles(nvml)
    service = RecordingService()
    spec = JobSpec(
        job_id=JOB_ID,
        batch_sizes=[8, 16, 32],
        default_batch_size=16,
        target_metric=0.9,
        max_epochs=3,
        mab_seed=1,
    )
    raw_j = 0.0
    raw_s = 0.0
    rates: list[float] = []
    threads_during: list[str] = []
    try:
        with BatchSizeOptimizer(
            spec, service=service, environ={}, heartbeat_interval_s=HEARTBEAT_S
        ) as bso:
            bso.get_batch_size()
            c0, t0 = counter_mj(nvml, handles), time.monotonic()
            bso.on_train_begin()
            for metric in (0.1, 0.5, 0.95):
                rates.append(load.run(EPOCH_S))
                if not threads_during:  # listed while training: the trial stops its heartbeats
                    threads_during = sorted(t.name for t in threading.enumerate())
                c1, t1 = counter_mj(nvml, handles), time.monotonic()
                raw_j += (c1 - c0) / 1000.0
                raw_s += t1 - t0
                try:
                    bso.on_evaluate(metric)
                except TrainFailError as err:
                    print(f"  the service stopped the trial: {err}")
                    break
                c0, t0 = counter_mj(nvml, handles), time.monotonic()
                if bso.training_finished:
                    break
    finally:
        load.release()
        nvml.nvmlShutdown()
    time.sleep(1.0)
    free_cuda()
    beats = service.events(Heartbeat)
    acks = [r for _, r in beats if isinstance(r, HeartbeatAck)]
    trial = service.trial(JOB_ID, 1)
    print(f"  threads during the first epoch: {threads_during}")
    print(
        f"  trial 1: {trial.epochs} epochs, status {trial.status}, reason {trial.stop_reason}, "
        f"time {trial.time_s:.2f} s, energy {trial.energy_j:.1f} J"
    )
    print(
        f"  raw counter over the same epochs: {raw_s:.2f} s, {raw_j:.1f} J "
        f"({100 * rel(trial.energy_j, raw_j):+.2f}% reported vs raw)"
    )
    print(
        f"  {len(beats)} heartbeats over {raw_s:.1f} s of training; load "
        f"{', '.join(f'{r:.1f}' for r in rates)} TFLOP/s per epoch vs baseline "
        f"{baseline_tflops:.1f}"
    )
    checks.check(trial.epochs == 3, "three epochs reported", f"{trial.epochs}")
    checks.check(
        trial.status is TrialStatus.CONVERGED and trial.stop_reason is StopReason.TARGET_REACHED,
        "the trial converged on reaching the target",
        f"{trial.status}, {trial.stop_reason}",
    )
    checks.check(
        abs(rel(trial.energy_j, raw_j)) < 0.02,
        "energy reported to the service within 2% of the raw counter over the epochs",
    )
    checks.check(abs(rel(trial.time_s, raw_s)) < 0.02, "time reported within 2% of the epochs'")
    checks.check(
        len(beats) >= 0.6 * raw_s / HEARTBEAT_S
        and all(a.status is TrialStatus.RUNNING for a in acks),
        "heartbeats every ~0.5 s while training, each acknowledged as running",
        f"{len(beats)} heartbeats, {len(acks)} acks",
    )
    checks.check(
        any(n.startswith("bso-heartbeat") for n in threads_during),
        "the heartbeat thread ran during training",
    )
    left = [t.name for t in threading.enumerate() if t.name.startswith("bso-")]
    checks.check(not left, "no bso thread left after the trial", f"{left}")
    if rates:
        print(
            f"  throughput with heartbeats: {100 * rel(min(rates), baseline_tflops):+.1f}% "
            "(worst epoch) vs baseline (informational: clocks vary with power and heat)"
        )
    checks.check(
        trial.hardware_key == hardware.key, "the trial ran on discover_hardware()'s hardware key"
    )
