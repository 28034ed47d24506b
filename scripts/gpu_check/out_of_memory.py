"""The ``oom`` section: a real CUDA out-of-memory error through the client's OOM handling.

The tests raise exceptions that are only *named* ``OutOfMemoryError``; here
torch raises the real one, first from one oversized allocation (the
recognisers), then from a training step inside ``BatchSizeOptimizer``'s
``with`` against the in-process service (the whole trial path).
"""

from __future__ import annotations

import time

import torch

from bso.core.vocabulary import StopReason, TrialStatus
from bso.spec import Hardware, JobSpec
from bso.wire.events import EndTrial
from bso_client import batch_search, liveness
from bso_client.optimizer import BatchSizeOptimizer
from gpu_check.recording_service import RecordingService
from gpu_check.report import Checks, gib, heading
from gpu_check.workloads import MlpTask, free_cuda

JOB_ID = "gpu-check-oom"


def describe_exception(exc: BaseException) -> str:
    """The exception's class hierarchy and the first line of its message."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    mro = " > ".join(f"{c.__module__}.{c.__qualname__}" for c in type(exc).__mro__[:4])
    return f"{mro}: {first[:160]}"


def _check_oversized_allocation(checks: Checks, total_b: int) -> None:
    """One allocation twice the card's size, through the recognisers."""
    described = ""
    is_torch_oom = batch_oom = liveness_oom = False
    reason: object = None
    try:
        torch.empty(2 * total_b, dtype=torch.uint8, device="cuda")
    except Exception as exc:
        described = describe_exception(exc)
        is_torch_oom = isinstance(exc, torch.OutOfMemoryError)
        liveness_oom = liveness.is_accelerator_out_of_memory(exc)
        batch_oom = batch_search.is_allocation_failure(exc)
        reason = liveness.end_reason_for(exc)
    free_cuda()
    print(f"  oversized allocation raised {described or 'nothing'}")
    checks.check(is_torch_oom, "an oversized allocation raises torch.OutOfMemoryError")
    checks.check(liveness_oom, "bso_client.liveness.is_accelerator_out_of_memory recognises it")
    checks.check(batch_oom, "bso_client.batch_search.is_allocation_failure recognises it")
    checks.check(
        reason is StopReason.OUT_OF_MEMORY, "end_reason_for gives OUT_OF_MEMORY", f"{reason}"
    )


def section_oom(hardware: Hardware, checks: Checks) -> None:
    heading("c. CUDA out of memory: liveness, end_reason_for, BatchSizeOptimizer")
    free_cuda()
    free_b, total_b = torch.cuda.mem_get_info()
    print(f"  free {gib(free_b)} of {gib(total_b)}")
    _check_oversized_allocation(checks, total_b)

    # A trial whose batch size does not fit, through BatchSizeOptimizer's `with`.
    huge, small = 1 << 21, 1024
    spec = JobSpec(
        job_id=JOB_ID,
        batch_sizes=[small, huge],
        default_batch_size=huge,
        target_metric=0.9,
        max_epochs=3,
        mab_seed=1,
    )
    service = RecordingService()
    task = MlpTask(width=4096, depth=4)
    got_batch: int | None = None
    raised = ""
    raised_is_oom = False
    monitor_kind = ""
    start = time.perf_counter()
    try:
        with BatchSizeOptimizer(spec, service=service, environ={}, heartbeat_interval_s=1.0) as bso:
            monitor_kind = bso.monitor.kind if bso.monitor is not None else "none"
            got_batch = bso.get_batch_size()
            bso.on_train_begin()
            task.step(got_batch)
            bso.on_evaluate(0.1)
    except Exception as exc:
        raised = describe_exception(exc)
        raised_is_oom = isinstance(exc, torch.OutOfMemoryError)
    took = time.perf_counter() - start
    free_cuda()  # the step's batch and activations went with the exception's traceback
    print(f"  trial 1 got batch size {got_batch}, monitor {monitor_kind!r}; {took:.1f} s")
    print(f"  the with block re-raised: {raised or 'nothing'}")
    checks.check(got_batch == huge, "the first trial runs the default (huge) batch size")
    checks.check(monitor_kind == "nvml", "BatchSizeOptimizer's own monitor is NVML")
    checks.check(raised_is_oom, "the real OOM is re-raised out of the with block")
    ends = service.events(EndTrial)
    print(f"  EndTrial events sent: {[(e.trial_number, str(e.reason)) for e, _ in ends]}")
    checks.check(
        len(ends) == 1 and ends[0][0].reason is StopReason.OUT_OF_MEMORY,
        "exactly one EndTrial, with reason out_of_memory",
    )
    trial = service.trial(JOB_ID, 1)
    print(
        f"  service's trial 1: status {trial.status}, reason {trial.stop_reason}, "
        f"hardware {trial.hardware_key!r}"
    )
    checks.check(
        trial.status is TrialStatus.FAILED and trial.stop_reason is StopReason.OUT_OF_MEMORY,
        "the service recorded trial 1 as failed: out_of_memory",
    )
    checks.check(
        trial.hardware_key == hardware.key,
        "the trial's hardware key is discover_hardware()'s",
        trial.hardware_key,
    )
    with BatchSizeOptimizer(spec, service=service, environ={}, heartbeat_interval_s=None) as bso:
        next_batch = bso.get_batch_size()
    checks.check(
        next_batch == small,
        "the next trial is not handed the size that ran out of memory",
        f"batch size {next_batch}",
    )
    checks.check(
        service.trial(JOB_ID, 2).stop_reason is StopReason.ABANDONED,
        "a trial left without an exception ends as abandoned",
    )
