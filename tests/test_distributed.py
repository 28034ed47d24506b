"""Data-parallel runs: a real gloo process group of 2 spawned processes on CPU.

Each process builds its own in-process service (a real BsoService over a
memory store); only rank 0's may ever be called, which every scenario checks,
so both ranks agreeing on batch size, trial number and stop means the answers
were broadcast.  Energy comes from a fake NVML per process with a fake clock,
so the job totals are exact: two "nodes" (``LOCAL_RANK`` 0 on both ranks) of
two GPUs each must report four GPUs' energy, one node (``LOCAL_RANK`` 0 and 1)
only rank 0's.

Assertions run inside the ranks; a failing one makes its rank exit non-zero
(its traceback on stderr).  The process group times out after 60 s, so a rank left
waiting in a collective fails the test instead of hanging it.
"""

from __future__ import annotations

import math
import multiprocessing
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from bso.core.vocabulary import StopReason
from bso.errors import ConfigMismatch
from bso.spec import Hardware, JobSpec
from bso.storage.memory import MemoryStore
from bso_client.distributed import SingleProcess, TorchCollective, local_rank
from bso_client.energy.nvml import NvmlMonitor
from bso_client.energy.time_only import TimeOnlyMonitor
from bso_client.errors import MixedGpuModels, TrainFailError
from bso_client.optimizer import BatchSizeOptimizer
from bso_client.testing import ConstantLoad, FakeClock, FakeGpu, FakeNvml
from tests.test_optimizer import RecordingService

SPEC = JobSpec(
    job_id="ddp", batch_sizes=[8, 16, 32], default_batch_size=16, target_metric=0.9, mab_seed=3
)
GPU_W = 60 + (400 - 60) * 0.5  # FakeGpu's power at ConstantLoad(0.5)
EPOCH_S = 10.0


def fake_monitor(clock: FakeClock, name: str = "NVIDIA A100-SXM4-40GB") -> NvmlMonitor:
    nvml = FakeNvml([FakeGpu(name=name, load=ConstantLoad(0.5))] * 2, clock=clock)
    return NvmlMonitor(nvml=nvml, clock=clock, environ={})


def run_epochs(
    bso: BatchSizeOptimizer, clock: FakeClock, metrics: list[float], rank: int
) -> list[bool]:
    """Train through ``metrics`` (rank 1 reports nonsense, which must be ignored)."""
    stops = []
    bso.on_train_begin()
    for metric in metrics:
        clock.advance(EPOCH_S)
        decision = bso.on_evaluate(metric if rank == 0 else -1.0)
        stops.append(decision.stop)
        if bso.training_finished:
            break
    return stops


def two_nodes(rank: int, service: RecordingService) -> None:
    clock = FakeClock()
    env = {"LOCAL_RANK": "0"}  # each rank is the first of its node: both measure
    bso = BatchSizeOptimizer(SPEC, service=service, monitor=fake_monitor(clock), environ=env)
    assert bso.hardware == Hardware(
        gpu_model="NVIDIA A100-SXM4-40GB", gpu_count=4, max_power_w=400, devices=2
    )
    assert (bso.get_batch_size(), bso.trial_number) == (16, 1)
    assert run_epochs(bso, clock, [0.5, 0.95, 0.99], rank) == [False, True]
    bso.close()
    if rank == 0:
        reports = [kw for m, _, kw in service.calls if m == "report_epoch"]
        assert [r["metric"] for r in reports] == [0.5, 0.95]
        assert [r["energy_j"] for r in reports] == pytest.approx(
            [4 * GPU_W * EPOCH_S, 8 * GPU_W * EPOCH_S], abs=0.01
        )
        assert [r["time_s"] for r in reports] == [EPOCH_S, 2 * EPOCH_S]

    # The next recurrence explores another size; the service stops it at max_epochs.
    spec = SPEC.model_copy(update={"max_epochs": 1})
    with pytest.raises(ConfigMismatch, match="max_epochs"):  # on both ranks
        BatchSizeOptimizer(
            spec, service=service, monitor=fake_monitor(clock), environ=env, on_unavailable="raise"
        )
    # By default the changed spec trains at its default without bso, on both ranks.
    untracked = BatchSizeOptimizer(spec, service=service, monitor=fake_monitor(clock), environ=env)
    assert (untracked.get_batch_size(), untracked.trial_number) == (16, None)
    assert untracked.detached
    untracked.close()
    bso = BatchSizeOptimizer(SPEC, service=service, monitor=fake_monitor(clock), environ=env)
    assert bso.get_batch_size() != 16
    assert bso.trial_number == 2
    bso.on_train_begin()
    clock.advance(EPOCH_S)
    for _ in range(SPEC.max_epochs - 1):
        bso.on_evaluate(0.1)
    with pytest.raises(TrainFailError) as caught:  # on both ranks
        bso.on_evaluate(math.nan if rank == 0 else 0.1)  # rank 0's metric is the one that counts
    assert (caught.value.trial_number, caught.value.reason) == (2, StopReason.DIVERGED)
    bso.close()


def one_node(rank: int, service: RecordingService) -> None:
    clock = FakeClock()
    for env in ({"LOCAL_RANK": str(rank)}, {}):  # given, or counted by host name
        bso = BatchSizeOptimizer(SPEC, service=service, monitor=fake_monitor(clock), environ=env)
        assert (bso.monitor is not None) == (rank == 0)  # rank 1's monitor is not used
        assert bso.hardware.gpu_count == 2
        bso.get_batch_size()
        run_epochs(bso, clock, [0.5, 0.5], rank)
        bso.close()
    assert local_rank(TorchCollective(), {}) == rank
    if rank == 0:
        reports = [kw for m, _, kw in service.calls if m == "report_epoch"]
        assert [r["energy_j"] for r in reports] == pytest.approx(
            [2 * GPU_W * EPOCH_S, 4 * GPU_W * EPOCH_S] * 2, abs=0.01
        )
    # energy_scope="rank": every rank measures what it sees (one GPU each under SLURM).
    bso = BatchSizeOptimizer(
        SPEC, service=service, monitor=fake_monitor(clock), environ={}, energy_scope="rank"
    )
    assert bso.hardware.gpu_count == 4
    bso.close()


def mixed_models(rank: int, service: RecordingService) -> None:
    name = "NVIDIA A100-SXM4-40GB" if rank == 0 else "NVIDIA H100 80GB HBM3"
    with pytest.raises(MixedGpuModels, match="H100"):
        BatchSizeOptimizer(
            SPEC,
            service=service,
            monitor=fake_monitor(FakeClock(), name),
            environ={"LOCAL_RANK": "0"},
        )


def process_count_changes(rank: int, service: RecordingService) -> None:
    """A job run with 1 process, then with 2: two lanes, and each rank loads half of
    the global batch bso hands out and records (issue 23: it trained twice that)."""
    if rank == 0:
        alone = BatchSizeOptimizer(
            SPEC, service=service, monitor=TimeOnlyMonitor(), collective=SingleProcess()
        )
        single = alone.get_batch_size()
        assert (alone.hardware.key, alone.per_device_batch_size) == ("cpu-time-only x1", single)
        alone.close()
    bso = BatchSizeOptimizer(
        SPEC, service=service, monitor=TimeOnlyMonitor(), environ={"LOCAL_RANK": str(rank)}
    )
    global_batch = bso.get_batch_size()
    assert bso.hardware.key == "cpu-time-only x1 dp2"
    assert bso.per_device_batch_size == bso.micro_batch_size == global_batch // 2
    assert bso.accumulation_steps == 1
    bso.close()
    if rank == 0:
        lanes = {lane.hardware.key: lane for lane in service.status(SPEC.job_id or "").lanes}
        assert set(lanes) == {"cpu-time-only x1", "cpu-time-only x1 dp2"}
        assert lanes["cpu-time-only x1 dp2"].hardware.devices == 2


SCENARIOS: dict[str, Callable[[int, RecordingService], None]] = {
    "two_nodes": two_nodes,
    "one_node": one_node,
    "mixed_models": mixed_models,
    "process_count_changes": process_count_changes,
}


def rank_main(rank: int, rendezvous: str) -> None:
    """Every scenario in turn, each with fresh services, in one process group."""
    dist.init_process_group(
        "gloo", init_method=rendezvous, rank=rank, world_size=2, timeout=timedelta(seconds=60)
    )
    try:
        for name, scenario in SCENARIOS.items():
            service = RecordingService(MemoryStore())
            scenario(rank, service)
            if rank != 0:
                assert service.calls == [], f"{name}: only rank 0 may talk to the service"
            dist.barrier()
    finally:
        dist.destroy_process_group()


def test_two_ranks_over_gloo(tmp_path: Path) -> None:
    # One spawn for all scenarios: starting a process that imports torch costs seconds.
    context = multiprocessing.get_context("spawn")
    ranks = [
        context.Process(target=rank_main, args=(rank, f"file://{tmp_path / 'rendezvous'}"))
        for rank in range(2)
    ]
    try:
        for process in ranks:
            process.start()
        for process in ranks:
            process.join(timeout=240)
    finally:
        for process in ranks:
            if process.is_alive():
                process.kill()
    # A failed assertion's traceback is on the rank's stderr, shown with the failure.
    assert [p.exitcode for p in ranks] == [0, 0]
