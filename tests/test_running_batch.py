"""Online growth in a run: the batch grows at epoch boundaries, the service hears it,
the learning rate follows, and the trial's cost stays one trial's."""

from __future__ import annotations

from typing import Any

import pytest

from bso.core.growth import BatchGrowth
from bso.errors import InvalidEvent
from bso.service import BsoService
from bso.spec import JobSpec
from bso.storage.memory import MemoryStore
from bso_client.energy.time_only import TimeOnlyMonitor
from bso_client.optimizer import BatchSizeOptimizer
from bso_client.running_batch import RunningBatch

SPEC = JobSpec(
    job_id="grow",
    batch_sizes=[16, 32, 64, 128],
    default_batch_size=16,
    target_metric=0.9,
    max_epochs=6,
    mab_seed=1,
)


class FakeOptimizer:
    """torch-style param groups, enough for the LR rules (matched by class name)."""

    def __init__(self, lr: float) -> None:
        self.param_groups: list[dict[str, Any]] = [{"lr": lr}]


class SGD(FakeOptimizer):
    pass


def test_growth_is_reported_and_rescales_the_tracked_learning_rate() -> None:
    service = BsoService(MemoryStore())
    with BatchSizeOptimizer(
        SPEC,
        service=service,
        monitor=TimeOnlyMonitor(),
        growth=BatchGrowth(every_epochs=2),
        heartbeat_interval_s=None,
    ) as bso:
        assert bso.get_batch_size() == 16
        optimizer = SGD(0.1)
        bso.scale_lr(optimizer)  # linear rule, 16 is the default: factor 1
        bso.on_train_begin()
        seen = []
        for _ in range(5):
            seen.append(bso.current_batch_size)
            bso.on_evaluate(0.1)
        assert seen == [16, 16, 32, 32, 64]
        assert optimizer.param_groups[0]["lr"] == pytest.approx(0.4)  # 16 -> 64, linear
        assert bso.batch_size == 16  # the trial's own size: its cost is charged there
    with service.store.read("grow") as tx:
        (trial,) = tx.trials()
    assert (trial.batch_size, trial.current_batch_size, trial.epochs) == (16, 64, 5)


def test_without_growth_nothing_changes_and_no_size_is_reported() -> None:
    running = RunningBatch(SPEC, 32, None)
    assert running.reported_size is None
    assert not running.after_epoch(3)
    assert running.current == 32


def test_growth_stops_at_the_largest_size() -> None:
    running = RunningBatch(SPEC, 64, BatchGrowth())
    assert running.after_epoch(1)
    assert not running.after_epoch(2)
    assert running.current == 128
    assert running.split == (128, 128, 1)


def test_the_service_refuses_a_size_the_lane_does_not_have() -> None:
    service = BsoService(MemoryStore())
    service.register(SPEC)
    trial = service.next_trial("grow")
    with pytest.raises(InvalidEvent, match="may only grow"):
        service.report_epoch(
            "grow", trial.trial_number, epoch=1, time_s=1, energy_j=1, metric=0, batch_size=48
        )


def test_out_of_memory_at_a_grown_size_is_charged_to_that_size_and_caps_growth() -> None:
    service = BsoService(MemoryStore())
    options: dict[str, Any] = {
        "service": service,
        "monitor": TimeOnlyMonitor(),
        "growth": BatchGrowth(),
        "heartbeat_interval_s": None,
    }

    def train_until_out_of_memory() -> None:
        with BatchSizeOptimizer(SPEC, **options) as bso:
            bso.get_batch_size()
            bso.on_train_begin()
            for _ in range(3):
                if bso.current_batch_size == 64:
                    raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
                bso.on_evaluate(0.1)

    with pytest.raises(RuntimeError, match="out of memory"):
        train_until_out_of_memory()
    (lane,) = service.status("grow").lanes
    assert lane.memory_limit == 64  # where it failed, not 16, where it started
    with BatchSizeOptimizer(SPEC, **options) as again:
        assert again.get_batch_size() == 16  # the default itself still fits
        again.on_train_begin()
        for _ in range(4):
            again.on_evaluate(0.1)
        assert again.current_batch_size == 32  # never grows into what ran out of memory
