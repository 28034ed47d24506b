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


# -- the probe leaves no trace, and takes sizes as the CLI does ------------------------


def dropout_setup() -> tuple[Any, ...]:
    """A factory that draws from every global generator, as a real one may."""
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.Dropout(0.5), torch.nn.Linear(64, 4)
    )
    optimizer = torch.optim.Adam(model.parameters())
    torch.backends.cudnn.benchmark = True  # a factory that tunes for speed

    def make_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(n, 16), torch.randint(0, 4, (n,))

    return model, optimizer, make_batch, torch.nn.functional.cross_entropy


def first_epoch(discovery: Discovery | None) -> list[torch.Tensor]:
    """Seed, maybe probe (as the optimizer does before the script builds its model),
    then train a few steps with dropout and shuffled batches; the weights after."""
    torch.manual_seed(7)
    if discovery is not None:
        probe_plan(discovery, hardware_key="cpu-time-only x1")
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.Dropout(0.3), torch.nn.Linear(32, 4)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(4):
        inputs, labels = torch.randn(8, 16), torch.randint(0, 4, (8,))
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(inputs), labels).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def test_the_same_seed_trains_bit_identically_with_and_without_a_probe(tmp_path: Path) -> None:
    benchmark = torch.backends.cudnn.benchmark
    discovery = Discovery(dropout_setup, memory_budget="8MiB", device="cpu", cache_dir=tmp_path)
    without = first_epoch(None)
    probed = first_epoch(discovery)  # probes and caches
    cached = first_epoch(discovery)  # reads the cache: the factory still ran
    assert list(tmp_path.glob("probe-*.json"))
    for weights in (probed, cached):
        assert all(torch.equal(a, b) for a, b in zip(without, weights, strict=True))
    assert torch.backends.cudnn.benchmark == benchmark


def test_the_memory_budget_takes_the_clis_size_texts() -> None:
    assert Discovery(dropout_setup, memory_budget="256MiB").memory_budget == 256 << 20
    assert Discovery(dropout_setup, memory_budget="2GiB").memory_budget_bytes == 2 << 30
    assert Discovery(dropout_setup, memory_budget=4096).memory_budget == 4096
    with pytest.raises(ValueError, match=r"memory_budget=.*not a memory size: 'lots'"):
        Discovery(dropout_setup, memory_budget="lots")


def test_a_cpu_probe_without_a_budget_names_the_python_argument(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="memory_budget=") as refused:
        probe_plan(Discovery(dropout_setup, device="cpu", cache_dir=tmp_path))
    assert "--memory-budget" not in str(refused.value)
