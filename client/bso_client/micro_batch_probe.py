"""Time real training steps at each micro-batch of a global batch, and pick the fastest.

The rule (candidates, order, stop, confidence) is :mod:`bso.core.micro_batch`'s;
this module runs it on a model: each step is one optimizer step on the whole
per-device batch, run as ``accumulation`` passes of the micro-batch whose
gradients add up (each pass's loss divided by the passes, so that the update is
the one a single pass over the whole batch would make, up to float rounding and
batch-dependent layers such as BatchNorm, whose statistics are per pass).

``bso probe MODULE:FACTORY --explore-micro-batch`` runs it offline and puts the
model and optimizer back afterwards.  Like the rest of :mod:`bso_client`,
importing it does not import torch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from bso.core.micro_batch import (
    MicroBatchChoice,
    MicroBatchExploration,
    Timings,
    accumulation_steps,
    candidates,
)
from bso_client.batch_search import preserved_training_state, training_batch
from bso_client.energy.base import EnergyMonitor

if TYPE_CHECKING:
    import torch

UPDATE_POINTS = 10
"""A change of confidence worth a log line of its own."""
WINDOW = "bso-micro-batch-probe-step"
"""The energy monitor's window around one timed step."""


def accumulated_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    make_batch: Callable[[int], tuple[Any, ...]],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    *,
    per_device: int,
    micro_batch: int,
    device: torch.device,
) -> None:
    """One optimizer step on ``per_device`` samples, in passes of ``micro_batch``."""
    import torch

    passes = accumulation_steps(per_device, 1, micro_batch)
    optimizer.zero_grad(set_to_none=True)
    with torch.enable_grad():
        for _ in range(passes):
            inputs, target = training_batch(make_batch, micro_batch, device)
            loss = loss_fn(model(*inputs), target) / passes
            torch.autograd.backward(loss)
    optimizer.step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def explore_micro_batch(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    make_batch: Callable[[int], tuple[Any, ...]],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    *,
    global_batch: int,
    budget_steps: int,
    devices: int = 1,
    largest_fitting: int | None = None,
    base: int | None = None,
    device: str = "cpu",
    on_update: Callable[[MicroBatchChoice], None] | None = None,
    monitor: EnergyMonitor | None = None,
    eta_knob: float = 0.0,
    step_log: dict[int, list[tuple[float, float]]] | None = None,
    known: Mapping[int, Timings] | None = None,
) -> MicroBatchExploration:
    """Time at most ``budget_steps`` optimizer steps of this device's share of
    ``global_batch`` at its candidate micro-batches; the model and optimizer are
    put back afterwards.  ``on_update`` hears the recommendation whenever it
    changes, or its confidence moves by :data:`UPDATE_POINTS` or more since the
    last it heard (one line per update, not per step).

    With a ``monitor`` each step's energy is read too and the cost is bso's at
    ``eta_knob`` (with the monitor's max power); without one, time alone.
    ``step_log`` gets each step's (seconds, joules) per sample, per micro-batch,
    warm-ups included (joules 0 where energy is not measured).  ``known``:
    earlier runs' timings to start from (:class:`~bso.core.micro_batch.Timings`)."""
    import torch

    target = torch.device(device)
    options = candidates(global_batch, devices, largest_fitting)
    exploration = MicroBatchExploration(
        options,
        base or options[-1],
        budget_steps,
        eta_knob=eta_knob if monitor is not None else 0.0,
        max_power_w=monitor.hardware.total_max_power_w if monitor is not None else 1.0,
        known=known or {},
    )
    per_device = global_batch // devices
    last: MicroBatchChoice | None = None
    with preserved_training_state(model, optimizer):
        model.train()
        while (micro := exploration.next_micro_batch()) is not None:
            if monitor is not None:
                monitor.begin_window(WINDOW)
            started = time.perf_counter()
            accumulated_step(
                model, optimizer, make_batch, loss_fn,
                per_device=per_device, micro_batch=micro, device=target,
            )  # fmt: skip
            elapsed = time.perf_counter() - started
            energy = monitor.end_window(WINDOW)[1] if monitor is not None else 0.0
            exploration.record(micro, per_device, elapsed, energy)
            if step_log is not None:
                step_log.setdefault(micro, []).append((elapsed / per_device, energy / per_device))
            choice = exploration.choice()
            if on_update is not None and (
                last is None
                or choice.micro_batch != last.micro_batch
                or abs(choice.score - last.score) >= UPDATE_POINTS
            ):
                on_update(choice)
                last = choice
    return exploration
