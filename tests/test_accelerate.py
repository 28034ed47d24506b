"""check_accelerator: an Accelerate loop trains the global batch bso chose, or is refused."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from accelerate import Accelerator

from bso.service import BsoService
from bso.storage.memory import MemoryStore
from bso_client.energy.time_only import TimeOnlyMonitor
from bso_client.integrations.accelerate import check_accelerator
from bso_client.optimizer import BatchSizeOptimizer

JOB: dict[str, Any] = {
    "job_id": "accelerate",
    "batch_sizes": [32, 64],
    "default_batch_size": 64,
    "micro_batch_size": 16,
    "target_metric": 0.9,
}


def optimizer() -> BatchSizeOptimizer:
    return BatchSizeOptimizer(JOB, service=BsoService(MemoryStore()), monitor=TimeOnlyMonitor())


def accelerator_like(**overrides: Any) -> SimpleNamespace:
    fields = {"num_processes": 1, "split_batches": False, "gradient_accumulation_steps": 4}
    return SimpleNamespace(**{**fields, **overrides})


def test_a_real_accelerator_set_up_as_the_docs_say_passes() -> None:
    with optimizer() as bso:
        bso.get_batch_size()
        assert (bso.micro_batch_size, bso.accumulation_steps) == (16, 4)
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=bso.accumulation_steps)
        check_accelerator(bso, accelerator, bso.micro_batch_size)
        with pytest.raises(ValueError, match=r"bso\.micro_batch_size"):
            check_accelerator(bso, accelerator, bso.get_batch_size())  # the global batch


def test_forgotten_accumulation_is_refused() -> None:
    with optimizer() as bso, pytest.raises(ValueError, match="gradient_accumulation_steps"):
        check_accelerator(bso, accelerator_like(gradient_accumulation_steps=1), 16)


def test_an_accelerator_that_sees_other_processes_than_torch_distributed_is_refused() -> None:
    with optimizer() as bso, pytest.raises(ValueError, match="Accelerate runs 2 process"):
        check_accelerator(bso, accelerator_like(num_processes=2), 16)


def test_split_batches_is_refused() -> None:
    with optimizer() as bso, pytest.raises(ValueError, match="split_batches"):
        check_accelerator(bso, accelerator_like(split_batches=True), 16)
