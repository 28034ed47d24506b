"""Finding the largest batch size that fits (bso_client.batch_search)."""

from __future__ import annotations

import gc
import math
import pickle
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from bso.errors import InvalidSpec
from bso.spec import MAX_BATCH_SIZE
from bso_client import batch_search
from bso_client.batch_candidates import auto_batch_sizes
from bso_client.batch_search import (
    TrainingState,
    find_max_batch_size,
    is_allocation_failure,
    preserved_training_state,
    probe_model,
)
from bso_client.errors import NoBatchSizeFits

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def collections(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the search's garbage collections instead of running them.

    A full ``gc.collect()`` with torch loaded takes a fifth of a second here,
    nothing next to a GPU training step but most of this file's run time.
    ``test_the_failed_step_is_released_before_the_next_probe`` puts the real one back.
    """
    calls: list[int] = []
    monkeypatch.setattr(batch_search, "gc", SimpleNamespace(collect=lambda: calls.append(1)))
    return calls


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """The models here are tiny: one thread avoids contention on a busy machine (10x faster)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def real_cpu_oom() -> RuntimeError:
    """The RuntimeError torch's CPU allocator raises when an allocation fails."""
    try:
        torch.empty(1 << 50, dtype=torch.uint8)  # 1 PiB: beyond any address space
    except RuntimeError as err:
        return err
    raise AssertionError("a 1 PiB allocation succeeded")


class FakeDevice:
    """A try_batch that runs out of memory above ``capacity``, recording every probe."""

    def __init__(self, capacity: int, error: Callable[[int], BaseException] | None = None):
        self.capacity = capacity
        self.error = error or (lambda b: MemoryError(f"cannot fit {b}"))
        self.calls: list[int] = []

    def __call__(self, batch_size: int) -> None:
        self.calls.append(batch_size)
        if batch_size > self.capacity:
            raise self.error(batch_size)


# --- the search on a fake device --------------------------------------------


@pytest.mark.parametrize("capacity", [1, 2, 3, 7, 8, 20, 100, 1000, 1023, 1024, 1025, 99_999])
def test_finds_the_exact_capacity_in_logarithmic_probes(capacity: int) -> None:
    device = FakeDevice(capacity)
    assert find_max_batch_size(device) == capacity
    # Doubling takes log2(capacity) + 2 probes at most, the bisection log2(capacity) + 1.
    assert len(device.calls) <= 2 * math.ceil(math.log2(capacity + 1)) + 3
    assert capacity in device.calls  # the answer was run, not inferred
    assert len(device.calls) == len(set(device.calls))  # nothing is probed twice


def test_probe_order_doubles_then_bisects() -> None:
    device = FakeDevice(20)
    assert find_max_batch_size(device) == 20
    assert device.calls == [1, 2, 4, 8, 16, 32, 24, 20, 22, 21]


def test_large_capacity_stays_cheap() -> None:
    device = FakeDevice(3_000_000)
    assert find_max_batch_size(device) == 3_000_000
    assert len(device.calls) <= 2 * 22 + 3


@pytest.mark.parametrize(
    ("capacity", "granularity", "expected"),
    [(1000, 8, 1000), (1001, 8, 1000), (1007, 8, 1000), (1008, 8, 1008), (20, 8, 16), (5, 8, 4)],
)
def test_granularity_only_tries_multiples_between_the_bounds(
    capacity: int, granularity: int, expected: int
) -> None:
    device = FakeDevice(capacity)
    assert find_max_batch_size(device, granularity=granularity) == expected
    doubling = [b for b in device.calls if b & (b - 1) == 0]
    bisection = device.calls[len(doubling) :]
    assert all(b % granularity == 0 for b in bisection)


def test_granularity_cuts_the_probes() -> None:
    fine, coarse = FakeDevice(1000), FakeDevice(1000)
    find_max_batch_size(fine)
    find_max_batch_size(coarse, granularity=8)
    assert len(coarse.calls) == len(fine.calls) - 3


def test_start_is_where_doubling_begins() -> None:
    device = FakeDevice(100)
    assert find_max_batch_size(device, start=12, granularity=4) == 100
    assert device.calls[:4] == [12, 24, 48, 96]


@pytest.mark.parametrize(("limit", "expected_calls"), [(100, 8), (64, 7), (1, 1)])
def test_limit_is_returned_when_it_fits(limit: int, expected_calls: int) -> None:
    device = FakeDevice(10_000)
    assert find_max_batch_size(device, limit=limit) == limit
    assert device.calls[-1] == limit
    assert len(device.calls) == expected_calls


def test_limit_bounds_the_bisection_too() -> None:
    device = FakeDevice(90)
    assert find_max_batch_size(device, limit=100) == 90
    assert max(device.calls) == 100


def test_without_limit_the_search_stops_at_what_a_jobspec_accepts() -> None:
    device = FakeDevice(MAX_BATCH_SIZE * 4)
    assert find_max_batch_size(device) == MAX_BATCH_SIZE
    assert max(device.calls) == MAX_BATCH_SIZE


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"start": 0}, "start must be a positive"),
        ({"granularity": 0}, "granularity must be positive"),
        ({"start": 16, "limit": 8}, "limit 8 is below start 16"),
    ],
)
def test_bad_arguments_are_refused_before_any_probe(options: dict[str, Any], match: str) -> None:
    device = FakeDevice(100)
    with pytest.raises(ValueError, match=match):
        find_max_batch_size(device, **options)
    assert device.calls == []


# --- errors -----------------------------------------------------------------


def test_nothing_fits_raises_a_typed_error_with_the_oom_chained() -> None:
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail")
    device = FakeDevice(0, error=lambda b: oom)
    with pytest.raises(NoBatchSizeFits) as caught:
        find_max_batch_size(device, start=4)
    error = caught.value
    assert isinstance(error, InvalidSpec)
    assert error.code == "invalid_spec"
    assert error.batch_size == 4
    assert error.__cause__ is oom
    assert "even batch size 4 does not fit in memory" in str(error)
    assert "CUDA out of memory. Tried to allocate 2.00 GiB" in str(error)
    assert "more detail" not in str(error)  # one line of the OOM, not its whole report
    assert "start the search at a smaller batch size" in str(error)
    assert device.calls == [4]


def test_nothing_fits_at_one_does_not_suggest_a_smaller_start() -> None:
    with pytest.raises(NoBatchSizeFits, match=r"batch size 1 does not fit") as caught:
        find_max_batch_size(FakeDevice(0))
    assert "smaller batch size" not in str(caught.value)


def test_no_batch_size_fits_survives_pickling() -> None:
    error = NoBatchSizeFits(8, "CUDA out of memory")
    clone = pickle.loads(pickle.dumps(error))
    assert type(clone) is NoBatchSizeFits
    assert (clone.batch_size, clone.detail, str(clone)) == (8, "CUDA out of memory", str(error))


@pytest.mark.parametrize(
    "error",
    [
        ValueError("bad label 7"),
        RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 4x2)"),
        KeyError("input_ids"),
    ],
)
def test_other_errors_propagate_unchanged(error: Exception) -> None:
    resets: list[int] = []

    def try_batch(batch_size: int) -> None:
        if batch_size >= 8:
            raise error

    with pytest.raises(type(error)) as caught:
        find_max_batch_size(try_batch, reset=lambda: resets.append(1))
    assert caught.value is error
    assert len(resets) == 4  # 1, 2, 4 and the failing 8: the state is put back anyway


def test_keyboard_interrupt_is_not_taken_for_oom() -> None:
    def try_batch(batch_size: int) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        find_max_batch_size(try_batch)


@pytest.mark.parametrize(
    "error",
    [
        MemoryError(),
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB"),
        torch.cuda.OutOfMemoryError("HIP out of memory. Tried to allocate 1.00 GiB"),
        RuntimeError("CUDA out of memory. Tried to allocate 512.00 MiB (GPU 0; 7.79 GiB total)"),
        RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously..."),
        RuntimeError("MPS backend out of memory (MPS allocated: 17.00 GB, other: 1.00 GB)"),
        RuntimeError("XPU out of memory. Tried to allocate 2.00 GiB"),
        RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
        RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if..."),
        real_cpu_oom(),
    ],
    ids=lambda e: type(e).__name__ + ":" + str(e)[:30],
)
def test_out_of_memory_is_recognised(error: BaseException) -> None:
    assert is_allocation_failure(error)


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("Expected all tensors to be on the same device"),
        RuntimeError("CUDA error: device-side assert triggered"),
        ValueError("out of memory"),  # not an allocator's error type
        KeyboardInterrupt(),
        OSError(12, "Cannot allocate memory"),
    ],
    ids=repr,
)
def test_other_errors_are_not_out_of_memory(error: BaseException) -> None:
    assert not is_allocation_failure(error)


# --- memory freeing and the reset hook ---------------------------------------


def test_memory_is_freed_after_each_oom_then_the_state_is_reset(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    events: list[str] = []
    monkeypatch.setattr(batch_search, "free_memory", lambda: events.append("free"))

    def try_batch(batch_size: int) -> None:
        events.append(f"try {batch_size}")
        if batch_size > 5:
            raise MemoryError

    assert find_max_batch_size(try_batch, reset=lambda: events.append("reset")) == 5
    assert events == [
        *("try 1", "reset", "try 2", "reset", "try 4", "reset"),
        *("try 8", "free", "reset", "try 6", "free", "reset", "try 5", "reset"),
    ]


def test_the_failed_step_is_released_before_the_next_probe(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The OOM's traceback must not keep the failed step's tensors alive."""
    import weakref

    monkeypatch.setattr(batch_search, "gc", gc)

    alive: list[weakref.ref[torch.Tensor]] = []

    def try_batch(batch_size: int) -> None:
        activations = torch.zeros(batch_size)
        alive.append(weakref.ref(activations))
        if batch_size > 3:
            raise real_cpu_oom()
        if len(alive) > 1:
            assert alive[-2]() is None, "the previous probe's tensor is still referenced"

    assert find_max_batch_size(try_batch) == 3
    assert all(ref() is None for ref in alive)


def test_free_memory_collects_and_empties_the_cuda_cache(
    monkeypatch: pytest.MonkeyPatch, collections: list[int]
) -> None:
    emptied: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    batch_search.free_memory()
    assert (collections, emptied) == ([1], [1])


def test_free_memory_leaves_cuda_alone_when_there_is_none(collections: list[int]) -> None:
    assert not torch.cuda.is_available()  # the test machine's CPU-only torch
    batch_search.free_memory()  # would raise if it called into CUDA
    assert collections == [1]


def test_importing_the_module_does_not_import_torch() -> None:
    code = (
        "import sys\n"
        "import bso_client.batch_candidates as c, bso_client.batch_search as m\n"
        "assert c.candidate_batch_sizes(100) == [8, 16, 32, 64, 100]\n"
        "assert m.find_max_batch_size(lambda b: None, limit=64) == 64\n"
        "assert m.is_allocation_failure(MemoryError())\n"
        "m.free_memory()\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert out.stdout.strip() == "False"


# --- real torch on CPU, with a fake memory cap ---------------------------------


class CappedNet(torch.nn.Module):
    """A tiny classifier whose forward pass fails like torch's allocator above ``cap`` samples."""

    def __init__(self, cap: int) -> None:
        super().__init__()
        self.cap = cap
        self.body = torch.nn.Sequential(
            torch.nn.Linear(6, 16),
            torch.nn.BatchNorm1d(16),
            torch.nn.ReLU(),
            torch.nn.Dropout(0.2),
            torch.nn.Linear(16, 3),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.cap:
            torch.empty(1 << 50, dtype=torch.uint8)  # raises the real CPU allocator error
        out: torch.Tensor = self.body(x)
        return out


def make_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch_size, 6), torch.randint(0, 3, (batch_size,))


def snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    state = optimizer.state_dict()["state"]
    return {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "grads": {
            n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()
        },
        "optimizer": {i: {k: v.clone() for k, v in s.items()} for i, s in state.items()},
        "lr": [g["lr"] for g in optimizer.param_groups],
        "modes": [m.training for m in model.modules()],
        "rng": torch.get_rng_state(),
    }


def assert_same(before: dict[str, Any], after: dict[str, Any]) -> None:
    assert before["model"].keys() == after["model"].keys()
    for key, value in before["model"].items():
        assert torch.equal(value, after["model"][key]), key
    assert before["grads"].keys() == after["grads"].keys()
    for name, grad in before["grads"].items():
        other = after["grads"][name]
        assert (grad is None and other is None) or torch.equal(grad, other), name
    assert before["optimizer"].keys() == after["optimizer"].keys()
    for index, state in before["optimizer"].items():
        for key, value in state.items():
            assert torch.equal(value, after["optimizer"][index][key]), (index, key)
    assert before["lr"] == after["lr"]
    assert before["modes"] == after["modes"]
    assert torch.equal(before["rng"], after["rng"])


def trained_setup(cap: int) -> tuple[CappedNet, torch.optim.Optimizer]:
    """A model one Adam step into training, so every kind of state is non-trivial."""
    torch.manual_seed(0)
    model = CappedNet(cap)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = make_batch(8)
    torch.autograd.backward(torch.nn.functional.cross_entropy(model(x), y))
    optimizer.step()  # leaves gradients and Adam moments behind
    model.eval()  # the caller's mode must come back too
    return model, optimizer


def test_probe_model_finds_the_cap_and_leaves_the_model_as_it_was() -> None:
    model, optimizer = trained_setup(cap=48)
    before = snapshot(model, optimizer)
    found = probe_model(
        model,
        optimizer,
        make_batch,
        torch.nn.functional.cross_entropy,
        device="cpu",
        limit=512,
        granularity=8,
    )
    assert found == 48
    assert_same(before, snapshot(model, optimizer))


def test_probe_model_with_a_fresh_optimizer_leaves_no_state_behind() -> None:
    torch.manual_seed(1)
    model = CappedNet(cap=100)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    before = snapshot(model, optimizer)
    assert probe_model(model, optimizer, make_batch, torch.nn.functional.cross_entropy) == 100
    assert optimizer.state_dict()["state"] == {}
    assert all(p.grad is None for p in model.parameters())
    assert_same(before, snapshot(model, optimizer))


def test_probe_model_runs_real_training_steps() -> None:
    model, optimizer = trained_setup(cap=1000)
    steps: list[int] = []
    original_step = optimizer.step

    def counting_step(*args: Any, **kwargs: Any) -> Any:
        steps.append(1)
        return original_step(*args, **kwargs)

    optimizer.step = counting_step  # type: ignore[method-assign]
    assert (
        probe_model(model, optimizer, make_batch, torch.nn.functional.cross_entropy, limit=16) == 16
    )
    assert len(steps) == 2 * 4  # sizes 2, 4, 8, 16 (start is 2); two steps each


def test_probe_model_refuses_a_batch_without_target() -> None:
    model, optimizer = trained_setup(cap=100)
    before = snapshot(model, optimizer)
    with pytest.raises(ValueError, match=r"\(inputs\.\.\., target\)"):
        probe_model(model, optimizer, lambda b: (torch.randn(b, 6),), torch.nn.functional.mse_loss)
    assert_same(before, snapshot(model, optimizer))


def test_probe_model_raises_when_nothing_fits_and_still_restores() -> None:
    model, optimizer = trained_setup(cap=10)
    model.cap = 0
    before = snapshot(model, optimizer)
    with pytest.raises(NoBatchSizeFits, match="DefaultCPUAllocator: can't allocate memory"):
        probe_model(model, optimizer, make_batch, torch.nn.functional.cross_entropy)
    assert_same(before, snapshot(model, optimizer))


def test_a_custom_try_batch_with_the_preserved_state() -> None:
    model, optimizer = trained_setup(cap=10_000)
    before = snapshot(model, optimizer)
    starts: list[torch.Tensor] = []

    def try_batch(batch_size: int) -> None:
        starts.append(next(model.parameters()).detach().clone())
        if batch_size > 24:
            raise real_cpu_oom()
        x, y = make_batch(batch_size)
        optimizer.zero_grad()
        torch.autograd.backward(torch.nn.functional.cross_entropy(model(x), y))
        optimizer.step()

    with preserved_training_state(model, optimizer) as state:
        model.train()
        assert find_max_batch_size(try_batch, start=2, reset=state.restore) == 24
    assert_same(before, snapshot(model, optimizer))
    assert all(torch.equal(w, starts[0]) for w in starts)  # every probe began from the same weights


def test_without_reset_the_probes_change_the_weights() -> None:
    """Documented behaviour: the search trains the model unless the state is put back."""
    model, optimizer = trained_setup(cap=10_000)
    before = snapshot(model, optimizer)

    def try_batch(batch_size: int) -> None:
        x, y = make_batch(batch_size)
        optimizer.zero_grad()
        torch.autograd.backward(torch.nn.functional.cross_entropy(model(x), y))
        optimizer.step()

    find_max_batch_size(try_batch, start=2, limit=8)
    after = snapshot(model, optimizer)
    assert not torch.equal(before["model"]["body.0.weight"], after["model"]["body.0.weight"])


def test_restore_can_be_repeated_after_more_training() -> None:
    """Loading the saved optimizer state must not let later steps write into the copy."""
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    torch.autograd.backward(model(torch.randn(4, 3)).sum())
    optimizer.step()
    before = snapshot(model, optimizer)
    state = TrainingState(model, optimizer)
    for _ in range(3):
        for _ in range(2):
            optimizer.zero_grad()
            torch.autograd.backward(model(torch.randn(4, 3)).sum())
            optimizer.step()
        state.restore()
        assert_same(before, snapshot(model, optimizer))


def test_preserved_state_is_restored_when_the_block_fails() -> None:
    model, optimizer = trained_setup(cap=10)
    before = snapshot(model, optimizer)

    def meddle_then_fail() -> None:
        with preserved_training_state(model, optimizer):
            with torch.no_grad():
                for param in model.parameters():
                    param.add_(1.0)
            model.train()
            torch.randn(5)
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        meddle_then_fail()
    assert_same(before, snapshot(model, optimizer))


def test_state_without_optimizer_or_rng() -> None:
    model = torch.nn.Linear(2, 2)
    weight = model.weight.detach().clone()
    state = TrainingState(model, rng=False)
    with torch.no_grad():
        model.weight.mul_(3)
    rng_before = torch.get_rng_state()
    torch.randn(3)
    state.restore()
    assert torch.equal(model.weight, weight)
    assert not torch.equal(torch.get_rng_state(), rng_before)  # generators left alone


def test_from_search_to_spec_end_to_end() -> None:
    model, optimizer = trained_setup(cap=300)
    maximum = probe_model(
        model, optimizer, make_batch, torch.nn.functional.cross_entropy, granularity=8, limit=2048
    )
    assert maximum == 296
    auto = auto_batch_sizes(maximum, default_cap=64)
    assert auto.batch_sizes == [8, 16, 32, 64, 128, 256, 296]
    assert auto.default_batch_size == 64
