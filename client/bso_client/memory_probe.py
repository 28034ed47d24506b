"""Predict a training step's peak memory from a few small batches, then confirm it.

:func:`~bso_client.batch_search.find_max_batch_size` finds the largest batch
by running out of memory on purpose, a dozen real steps on the way.  A
training step's peak memory is close to affine in the batch size: the weights,
their gradients and the optimizer's state do not depend on it, the activations
and the batch itself grow with it.  So a few small steps fit the line, the line
says which batch fills the budget, and one real step at that size confirms it
(or, with the new point, the line is refitted and tried again).

What is measured:

* on a CUDA device, the allocator's peak (``torch.cuda.max_memory_allocated``)
  over the step, after resetting it;
* on the CPU, what torch allocates: the bytes of the tensors alive before the
  step (weights, optimizer state) plus the running peak of the allocations and
  frees the profiler records during it.  That makes a budget on the CPU a real
  limit that tests can run here.

Like the rest of :mod:`bso_client`, importing this module does not import torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from bso_client.batch_search import (
    free_memory,
    is_allocation_failure,
    preserved_training_state,
    training_steps,
)
from bso_client.errors import NoBatchSizeFits
from bso_client.native_chatter import quiet_profiler_chatter

if TYPE_CHECKING:
    import torch

FIT_SIZES = (2, 8, 32)
"""Batches the line is fitted on: small enough to fit anywhere a model trains at all,
far enough apart that the per-sample slope is not lost in fixed costs (2, not 1:
BatchNorm in training mode cannot normalise a single sample)."""
MAX_RUNS = 8
"""Real steps a probe may take, the fitting ones included."""
AIM = 0.97
"""The line aims a step's predicted peak at this share of the budget: measured
peaks of one size vary by a percent or two (allocator rounding, what the
profiler sees of blocks freed from earlier steps), and a size predicted right at
the budget is as likely over it as under."""
MAX_GROWTH = 8
"""A step may be at most this many times the largest size measured so far: a
line fitted on small sizes can be far off, and one huge step could take the
whole host's memory."""


@dataclass(frozen=True)
class AffineMemory:
    """Peak bytes of a step at batch ``b``: ``fixed_bytes + bytes_per_sample * b``."""

    fixed_bytes: float
    bytes_per_sample: float

    @classmethod
    def fit(cls, points: Sequence[tuple[int, int]]) -> AffineMemory:
        """Least squares through ``(batch, peak bytes)`` points (at least two sizes)."""
        sizes = {b for b, _ in points}
        if len(sizes) < 2:
            raise ValueError("a line needs peaks at two batch sizes at least")
        n = len(points)
        mean_b = sum(b for b, _ in points) / n
        mean_m = sum(m for _, m in points) / n
        covariance = sum((b - mean_b) * (m - mean_m) for b, m in points)
        variance = sum((b - mean_b) ** 2 for b, _ in points)
        slope = max(covariance / variance, 0.0)
        return cls(mean_m - slope * mean_b, slope)

    def predict(self, batch_size: int) -> int:
        return round(self.fixed_bytes + self.bytes_per_sample * batch_size)

    def largest_within(self, budget_bytes: int) -> int:
        """The largest batch whose predicted peak is at most ``budget_bytes`` (0 if none)."""
        if self.bytes_per_sample <= 0:
            return 0 if self.fixed_bytes > budget_bytes else 2**31 - 1
        return max(math.floor((budget_bytes - self.fixed_bytes) / self.bytes_per_sample), 0)


@dataclass
class MemoryProbe:
    """What :func:`probe_memory` found; ``points`` are its real steps, in order."""

    max_batch_size: int
    predicted_peak_bytes: int
    """The line's prediction at ``max_batch_size``, made before that size was run."""
    measured_peak_bytes: int
    budget_bytes: int
    model: AffineMemory
    points: list[tuple[int, int | None]] = field(default_factory=list)
    """``(batch, peak bytes)`` of each real step; None where it ran out of memory."""

    @property
    def trials(self) -> int:
        return len(self.points)


def probe_memory(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    make_batch: Callable[[int], tuple[Any, ...]],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    *,
    budget_bytes: int,
    device: str = "cpu",
    limit: int | None = None,
) -> MemoryProbe:
    """The largest batch whose training step peaks within ``budget_bytes``, in at most
    :data:`MAX_RUNS` real steps; the model and optimizer are left as they were.

    ``make_batch(b)`` returns ``(inputs..., target)`` as for
    :func:`~bso_client.batch_search.probe_model`.  Each real step runs one
    warm-up step first (a stateful optimizer allocates its state on its first
    step) and measures the second.  A size that runs out of memory counts as
    over the budget, and the state is restored after every step.
    """
    import torch

    target = torch.device(device)
    run_step = training_steps(model, optimizer, make_batch, loss_fn, target)
    points: list[tuple[int, int | None]] = []

    def run(batch_size: int) -> int | None:
        def step() -> None:
            run_step(batch_size)

        try:
            step()  # warm-up: optimizer state, lazy buffers, allocator caches
            peak: int | None = _peak_bytes(step, target, model, optimizer)
        except RuntimeError as exc:
            if not is_allocation_failure(exc):
                raise
            peak = None
        finally:
            state.restore()
            free_memory()
        points.append((batch_size, peak))
        return peak

    with preserved_training_state(model, optimizer) as state:
        model.train()
        for size in FIT_SIZES:
            run(size)
        fitted = [(b, m) for b, m in points if m is not None]
        if len(fitted) < 2 or min(m for _, m in fitted) > budget_bytes:
            raise NoBatchSizeFits(
                FIT_SIZES[0],
                f"over the budget of {budget_bytes} bytes; peaks measured: {points}",
            )
        best, best_peak = max((b, m) for b, m in fitted if m <= budget_bytes)
        ceiling = limit if limit is not None else 2**31 - 1
        line = AffineMemory.fit(fitted)
        predicted_at = {b: line.predict(b) for b, _ in fitted}
        while len(points) < MAX_RUNS:
            largest_run = max(b for b, m in points if m is not None)
            candidate = min(
                line.largest_within(math.floor(budget_bytes * AIM)),
                ceiling,
                largest_run * MAX_GROWTH,
            )
            if candidate <= best:
                break
            predicted_at[candidate] = line.predict(candidate)  # before it runs
            peak = run(candidate)
            if peak is not None and peak <= budget_bytes:
                best, best_peak = candidate, peak
                if candidate == ceiling:
                    break
            elif peak is None:
                # Out of memory below the budget: the line says nothing about why,
                # so halve the distance to the largest size known to fit.
                ceiling = (best + candidate) // 2
            else:
                ceiling = candidate - 1
            line = AffineMemory.fit([(b, m) for b, m in points if m is not None])
        return MemoryProbe(best, predicted_at[best], best_peak, budget_bytes, line, points)


def _peak_bytes(
    step: Callable[[], None],
    device: torch.device,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
) -> int:
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        step()
        return int(torch.cuda.max_memory_allocated(device))
    from torch.profiler import ProfilerActivity, profile

    resident = _tensor_bytes(model, optimizer)
    with (
        quiet_profiler_chatter(),
        profile(activities=[ProfilerActivity.CPU], profile_memory=True) as recorded,
    ):
        step()
    changes = sorted(
        (event.time_range.start, event.self_cpu_memory_usage)
        for event in recorded.events()
        if event.self_cpu_memory_usage
    )
    level = peak = 0
    for _, change in changes:
        level += change
        peak = max(peak, level)
    return resident + peak


def _tensor_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors alive when a step starts: weights, buffers, the gradients
    of the step before (the step frees them, and the profiler sees that free) and the
    optimizer's state."""
    import torch

    seen: set[int] = set()
    total = 0

    def add(tensor: torch.Tensor) -> None:
        nonlocal total
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()

    for tensor in [*model.parameters(), *model.buffers()]:
        add(tensor)
    for parameter in model.parameters():
        if parameter.grad is not None:
            add(parameter.grad)
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                add(value)
    return total
