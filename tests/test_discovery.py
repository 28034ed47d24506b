"""Discovery: plans from the largest batch that fits, and the probe cache."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from bso_client.discovery import Discovery, plan_from_max, probe_plan
from bso_client.errors import NoBatchSizeFits


def test_a_plan_without_micro_batches_stops_at_what_fits() -> None:
    plan = plan_from_max(3000)
    assert plan.batch_sizes == [8, 16, 32, 64, 128, 256, 512, 1024, 2048, 3000]
    assert (plan.default_batch_size, plan.micro_batch_size, plan.devices) == (2048, None, None)


def test_devices_multiply_the_per_device_candidates() -> None:
    plan = plan_from_max(100, devices=4, default_cap=128)
    assert plan.batch_sizes == [32, 64, 128, 256, 400]
    assert plan.default_batch_size == 128
    assert plan.devices == 4


def test_micro_batches_accumulate_up_to_the_limit() -> None:
    plan = plan_from_max(40, micro_batch_size=24, devices=2, limit=1000)
    assert plan.batch_sizes == [48, 96, 192, 384, 768, 960]
    assert all(b % 48 == 0 for b in plan.batch_sizes)
    assert plan_from_max(40, micro_batch_size=24).batch_sizes == [24]  # no limit: one pass


def test_a_micro_batch_larger_than_what_fits_is_refused() -> None:
    with pytest.raises(NoBatchSizeFits, match="micro-batch of 64 does not fit"):
        plan_from_max(40, micro_batch_size=64)


class CountingFactory:
    """A small MLP factory that counts how often it was asked for a model."""

    def __init__(self, width: int = 256) -> None:
        self.width = width
        self.calls = 0
        self.batches = 0

    def __call__(self) -> tuple[Any, ...]:
        self.calls += 1
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(64, self.width), torch.nn.ReLU(), torch.nn.Linear(self.width, 4)
        )
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

        def make_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
            self.batches += 1
            return torch.randn(n, 64), torch.randint(0, 4, (n,))

        return model, optimizer, make_batch, torch.nn.functional.cross_entropy


def test_the_probe_runs_once_per_model_and_hardware(tmp_path: Path) -> None:
    factory = CountingFactory()
    discovery = Discovery(factory, memory_budget=16 << 20, device="cpu", cache_dir=tmp_path)
    first = probe_plan(discovery, hardware_key="cpu x1")
    probes_after_first = factory.batches
    again = probe_plan(discovery, hardware_key="cpu x1")
    assert not first.cached
    assert again.cached
    assert again.plan == first.plan
    assert factory.batches == probes_after_first + 1  # only the shape check, no probe steps
    other_hardware = probe_plan(discovery, hardware_key="Tesla T4 x1")
    assert not other_hardware.cached
    wider = Discovery(CountingFactory(width=512), memory_budget=16 << 20, cache_dir=tmp_path)
    assert not probe_plan(wider, hardware_key="cpu x1").cached  # another model: probed


def test_a_damaged_cache_entry_is_probed_again(tmp_path: Path) -> None:
    discovery = Discovery(CountingFactory(), memory_budget=16 << 20, cache_dir=tmp_path)
    first = probe_plan(discovery)
    (entry,) = tmp_path.glob("probe-*.json")
    entry.write_text("{not json")
    again = probe_plan(discovery)
    assert not again.cached
    assert again.plan.default_batch_size == first.plan.default_batch_size
    assert json.loads(entry.read_text())["result"]["candidates"] == again.plan.batch_sizes


def test_without_the_cache_nothing_is_read_or_written(tmp_path: Path) -> None:
    discovery = Discovery(CountingFactory(), memory_budget=16 << 20, cache_dir=tmp_path)
    assert not probe_plan(discovery, read_cache=False, write_cache=False).cached
    assert list(tmp_path.iterdir()) == []


def test_another_optimizer_or_forward_is_another_cache_entry(tmp_path: Path) -> None:
    class Adam(CountingFactory):
        def __call__(self) -> tuple[Any, ...]:
            model, _, make_batch, loss = super().__call__()
            return model, torch.optim.Adam(model.parameters()), make_batch, loss

    budget = {"memory_budget": 16 << 20, "cache_dir": tmp_path}
    assert not probe_plan(Discovery(CountingFactory(), **budget)).cached
    assert not probe_plan(Discovery(Adam(), **budget)).cached  # same shapes, other state
    assert probe_plan(Discovery(Adam(), **budget)).cached
