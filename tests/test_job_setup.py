"""JobSetup: the spec a run registers, with devices filled in and batch sizes discovered."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from bso.errors import InvalidSpec
from bso.service import BsoService
from bso.spec import BatchPlan, Hardware, JobSpec
from bso.storage.memory import MemoryStore
from bso_client.discovery import Discovery
from bso_client.energy.time_only import TimeOnlyMonitor
from bso_client.job_setup import JobSetup
from bso_client.optimizer import BatchSizeOptimizer

JOB: dict[str, Any] = {"job_id": "auto", "target_metric": 0.9, "max_epochs": 3, "mab_seed": 1}
CPU = Hardware()


def on_zero(ask: Callable[[], BatchPlan]) -> BatchPlan:
    return ask()


class Factory:
    """A small MLP; counts the training steps the probe ran through ``make_batch``."""

    def __init__(self) -> None:
        self.batches = 0

    def __call__(self) -> tuple[Any, ...]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4)
        )

        def make_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
            self.batches += 1
            return torch.randn(n, 64), torch.randint(0, 4, (n,))

        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        return model, optimizer, make_batch, torch.nn.functional.cross_entropy


def test_a_listed_spec_gets_the_world_size_as_its_devices() -> None:
    setup = JobSetup({**JOB, "batch_sizes": [16, 32], "default_batch_size": 16}, None)
    spec = setup.complete(world_size=4, hardware=CPU, reprobe=False, on_rank_zero=on_zero)
    assert spec.devices == 4
    assert spec.split(32) == (8, 8, 1)
    single = setup.complete(world_size=1, hardware=CPU, reprobe=False, on_rank_zero=on_zero)
    assert single.devices is None


def test_sizes_that_do_not_split_over_the_ranks_are_refused() -> None:
    setup = JobSetup({**JOB, "batch_sizes": [16, 30], "default_batch_size": 16}, None)
    with pytest.raises(InvalidSpec, match="do not split over 4 devices"):
        setup.complete(world_size=4, hardware=CPU, reprobe=False, on_rank_zero=on_zero)


def test_devices_that_contradict_the_world_size_are_refused() -> None:
    spec = JobSpec.model_validate({**JOB, "batch_sizes": [16], "default_batch_size": 16})
    setup = JobSetup(spec.model_copy(update={"devices": 2}), None)
    with pytest.raises(InvalidSpec, match="devices=2, but 4 processes"):
        setup.complete(world_size=4, hardware=CPU, reprobe=False, on_rank_zero=on_zero)


def test_no_batch_sizes_and_no_discovery_says_what_to_do() -> None:
    with pytest.raises(InvalidSpec, match="pass discovery=Discovery"):
        JobSetup(JOB, None)


def test_other_fields_are_checked_before_any_probe(tmp_path: Path) -> None:
    factory = Factory()
    with pytest.raises(ValueError, match="eta_knob"):
        JobSetup({**JOB, "eta_knob": 7}, Discovery(factory, memory_budget=1 << 24))
    assert factory.batches == 0


@pytest.mark.parametrize("name", ["default_batch_size", "micro_batch_size", "devices"])
def test_the_plan_fields_a_discovering_job_gives_are_checked_as_a_listed_jobs(name: str) -> None:
    """The placeholder plan replaced them unchecked: micro_batch_size=True trained in
    passes of one, devices=True passed as one device (JobSpec refuses both)."""
    discovery = Discovery(Factory(), memory_budget=1 << 24)
    for bad in (True, 0, "sixty-four"):
        with pytest.raises(ValueError, match=name):
            JobSetup({**JOB, name: bad}, discovery)
    setup = JobSetup({**JOB, name: "4"}, discovery)  # what JobSpec takes, as it takes it
    assert (setup.default_cap, setup.micro_batch_size, setup.devices_given).count(4) == 1
    assert JobSetup({**JOB, "default_batch_size": None}, discovery).default_cap is None


def optimizer(discovery: Discovery, service: BsoService, **job: Any) -> BatchSizeOptimizer:
    return BatchSizeOptimizer(
        {**JOB, **job}, service=service, discovery=discovery, monitor=TimeOnlyMonitor()
    )


def test_a_job_without_sizes_probes_once_registers_them_and_runs(tmp_path: Path) -> None:
    factory = Factory()
    discovery = Discovery(factory, memory_budget=16 << 20, device="cpu", cache_dir=tmp_path)
    service = BsoService(MemoryStore())
    with optimizer(discovery, service, default_batch_size=64) as first:
        sizes = first.spec.batch_sizes
        assert sizes[0] == 8
        assert first.spec.default_batch_size == 64  # the user's tuned size caps the default
        assert first.get_batch_size() == 64
    probed = factory.batches
    with optimizer(discovery, service, default_batch_size=64) as again:
        assert again.spec.batch_sizes == sizes
    assert factory.batches == probed + 1  # the cache: only the shape check ran
    assert service.status("auto").spec.batch_sizes == sizes


def test_reprobe_memory_probes_again(tmp_path: Path) -> None:
    factory = Factory()
    discovery = Discovery(factory, memory_budget=16 << 20, device="cpu", cache_dir=tmp_path)
    service = BsoService(MemoryStore())
    optimizer(discovery, service).close()
    probed = factory.batches
    BatchSizeOptimizer(
        JOB,
        service=service,
        discovery=discovery,
        monitor=TimeOnlyMonitor(),
        reprobe_memory=True,
    ).close()
    assert factory.batches > probed + 1


def test_micro_batches_show_in_the_trial(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    discovery = Discovery(
        Factory(), memory_budget=16 << 20, micro_batch_size=16, limit=512, cache_dir=tmp_path
    )
    caplog.set_level(logging.INFO, logger="bso_client")
    with optimizer(discovery, service=BsoService(MemoryStore()), default_batch_size=128) as bso:
        assert bso.get_batch_size() == 128
        assert (bso.micro_batch_size, bso.accumulation_steps) == (16, 8)
        assert bso.per_device_batch_size == 128
    assert "batch size 128 = 16 x 8 passes x 1 devices" in caplog.text


def test_a_probe_on_another_machine_of_the_same_gpu_adopts_the_lanes_plan(
    tmp_path: Path,
) -> None:
    service = BsoService(MemoryStore())
    first_machine = Discovery(Factory(), memory_budget=16 << 20, cache_dir=tmp_path / "a")
    with optimizer(first_machine, service) as first:
        lane_sizes = first.spec.batch_sizes
    # The second machine's probe finds another maximum (a smaller budget here).
    second_machine = Discovery(Factory(), memory_budget=12 << 20, cache_dir=tmp_path / "b")
    with optimizer(second_machine, service) as second:
        assert second.spec.batch_sizes == lane_sizes
        assert second.get_batch_size() in lane_sizes


def test_a_typed_list_that_differs_from_the_lanes_is_still_refused() -> None:
    from bso.errors import ConfigMismatch

    service = BsoService(MemoryStore())
    typed = {**JOB, "batch_sizes": [8, 16], "default_batch_size": 8}
    BatchSizeOptimizer(typed, service=service, monitor=TimeOnlyMonitor()).close()
    other = {**typed, "batch_sizes": [8, 32]}
    with pytest.raises(ConfigMismatch, match="fixed"):
        BatchSizeOptimizer(
            other, service=service, monitor=TimeOnlyMonitor(), on_unavailable="raise"
        )
    with BatchSizeOptimizer(other, service=service, monitor=TimeOnlyMonitor()) as untracked:
        assert (untracked.get_batch_size(), untracked.trial_number) == (8, None)


def test_the_devices_are_part_of_the_hardware_it_registers() -> None:
    setup = JobSetup({**JOB, "batch_sizes": [16, 32], "default_batch_size": 16}, None)
    ddp = setup.complete(world_size=2, hardware=CPU, reprobe=False, on_rank_zero=on_zero)
    alone = setup.complete(world_size=1, hardware=CPU, reprobe=False, on_rank_zero=on_zero)
    assert ddp.hardware.key == f"{CPU.key} dp2"
    assert alone.hardware.key == CPU.key  # the key single-process lanes always had


def test_a_lane_learned_over_other_devices_is_refused_not_run_at_another_batch(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from bso.errors import ConfigMismatch

    service = BsoService(MemoryStore())
    # A data-parallel client from before lanes counted devices: 2 ranks, the old key.
    old = JobSpec.model_validate(
        {**JOB, "batch_sizes": [16, 32], "default_batch_size": 16, "devices": 2}
    )
    service.register(old.model_copy(update={"hardware": TimeOnlyMonitor().hardware}))
    discovery = Discovery(Factory(), memory_budget=16 << 20, device="cpu", cache_dir=tmp_path)
    caplog.set_level(logging.INFO, logger="bso_client")
    with pytest.raises(ConfigMismatch, match="over 2 data-parallel devices, and this run has 1"):
        optimizer(discovery, service)
    assert "probed here" not in caplog.text


def test_adopting_a_typed_lane_plan_logs_no_probe(caplog: pytest.LogCaptureFixture) -> None:
    setup = JobSetup({**JOB, "batch_sizes": [16, 32], "default_batch_size": 16}, None)
    spec = setup.complete(world_size=1, hardware=CPU, reprobe=False, on_rank_zero=on_zero)
    caplog.set_level(logging.INFO, logger="bso_client")
    kept = setup.adopt(spec, BatchPlan(batch_sizes=[16, 32, 64], default_batch_size=16))
    assert kept.batch_sizes == [16, 32, 64]
    assert "probe" not in caplog.text
