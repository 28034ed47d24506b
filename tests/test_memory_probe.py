"""The memory line and the probe that fits, predicts and confirms it (CPU, real torch)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from bso_client.errors import NoBatchSizeFits
from bso_client.memory_probe import MAX_RUNS, AffineMemory, probe_memory


def test_the_line_is_the_least_squares_fit_and_inverts_to_the_budget() -> None:
    line = AffineMemory.fit([(2, 1200), (8, 1800), (32, 4200)])
    assert line.bytes_per_sample == pytest.approx(100)
    assert line.fixed_bytes == pytest.approx(1000)
    assert line.predict(50) == 6000
    assert line.largest_within(6000) == 50
    assert line.largest_within(6099) == 50
    assert line.largest_within(999) == 0
    with pytest.raises(ValueError, match="two batch sizes"):
        AffineMemory.fit([(4, 10), (4, 12)])


def setup(hidden: int = 1024) -> tuple[Any, Any, Any, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 10)
    )
    optimizer = torch.optim.Adam(model.parameters())

    def make_batch(n: int) -> tuple[Any, Any]:
        return torch.randn(n, 256), torch.randint(0, 10, (n,))

    return model, optimizer, make_batch, torch.nn.functional.cross_entropy


@pytest.mark.parametrize("budget_mib", [32, 96])
def test_the_prediction_at_the_maximum_is_within_15_percent_in_at_most_8_steps(
    budget_mib: int,
) -> None:
    model, optimizer, make_batch, loss_fn = setup()
    found = probe_memory(model, optimizer, make_batch, loss_fn, budget_bytes=budget_mib << 20)
    assert found.trials <= MAX_RUNS
    assert found.measured_peak_bytes <= budget_mib << 20
    assert abs(found.predicted_peak_bytes / found.measured_peak_bytes - 1) <= 0.15
    # The maximum is the largest size measured within the budget.
    within = [b for b, m in found.points if m is not None and m <= budget_mib << 20]
    assert found.max_batch_size == max(within)


def test_doubling_the_budget_grows_the_maximum_as_the_line_says() -> None:
    model, optimizer, make_batch, loss_fn = setup()
    small = probe_memory(model, optimizer, make_batch, loss_fn, budget_bytes=48 << 20)
    large = probe_memory(model, optimizer, make_batch, loss_fn, budget_bytes=96 << 20)
    expected = small.model.largest_within(96 << 20) / small.model.largest_within(48 << 20)
    assert large.max_batch_size / small.max_batch_size == pytest.approx(expected, rel=0.1)
    assert large.max_batch_size > 1.8 * small.max_batch_size


def test_the_model_and_optimizer_are_left_as_they_were() -> None:
    model, optimizer, make_batch, loss_fn = setup()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    probe_memory(model, optimizer, make_batch, loss_fn, budget_bytes=32 << 20)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert optimizer.state_dict()["state"] == {}
    assert all(p.grad is None for p in model.parameters())


def test_a_step_that_runs_out_of_memory_counts_as_over_the_budget() -> None:
    model, optimizer, make_batch, loss_fn = setup()

    def limited(n: int) -> tuple[Any, Any]:
        if n > 1000:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate")
        return make_batch(n)

    found = probe_memory(model, optimizer, limited, loss_fn, budget_bytes=256 << 20)
    assert found.max_batch_size <= 1000
    assert any(m is None for _, m in found.points)
    assert found.trials <= MAX_RUNS
    assert all(p.grad is None for p in model.parameters())


def test_a_budget_below_the_smallest_step_says_nothing_fits() -> None:
    model, optimizer, make_batch, loss_fn = setup()
    with pytest.raises(NoBatchSizeFits, match="over the budget"):
        probe_memory(model, optimizer, make_batch, loss_fn, budget_bytes=1 << 20)


def test_another_error_is_not_taken_for_memory() -> None:
    model, optimizer, _, loss_fn = setup()

    def broken(n: int) -> tuple[Any, Any]:
        raise RuntimeError("shape mismatch")

    with pytest.raises(RuntimeError, match="shape mismatch"):
        probe_memory(model, optimizer, broken, loss_fn, budget_bytes=64 << 20)
