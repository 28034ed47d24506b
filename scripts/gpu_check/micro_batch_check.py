"""The ``microbatch`` section: issue 26's micro-batch exploration on the GPU.

For the two models of ``scripts/bench_micro_batch.py`` (an MLP and a small
convolutional network), every micro-batch of a global batch is timed
exhaustively, then the exploration's pick is compared with the fastest: its
throughput must be within 3% of the best's, in at most the exploration's
budget.  Then one real run explores inside itself
(``BatchSizeOptimizer.explore_micro_batch``) with the default monitor (NVML on
a GPU), against the in-process service: energy per sample enters the cost, the
run's timings reach the service, and a second run at that batch starts from
them.

Runs on the CPU too (``section_micro_batch(checks, device="cpu")``), which is
how it is tried before a GPU is lent.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import torch
from bench_micro_batch import MODELS, exhaustive

from bso.service import BsoService
from bso.spec import JobSpec
from bso.storage.memory import MemoryStore
from bso_client import BatchSizeOptimizer
from bso_client.energy.base import EnergyMonitor
from bso_client.micro_batch_probe import explore_micro_batch
from gpu_check.report import Checks, heading

GLOBAL_BATCH = 512
EXHAUSTIVE_STEPS = 10
BUDGET = 40
WITHIN = 0.97
"""The pick's throughput as a share of the fastest's: the issue's 3%."""


def section_micro_batch(
    checks: Checks, device: str = "cuda", monitor: EnergyMonitor | None = None
) -> None:
    heading(f"microbatch: the fastest micro-batch of a global batch of {GLOBAL_BATCH}")
    target = torch.device(device)
    for name, build in MODELS.items():
        setup = build(target)
        truth = exhaustive(setup, GLOBAL_BATCH, EXHAUSTIVE_STEPS, target)
        fastest = min(truth, key=lambda m: truth[m])
        print(f"  {name}: ms per sample by micro-batch (median of {EXHAUSTIVE_STEPS} steps)")
        for micro, seconds in sorted(truth.items(), reverse=True):
            print(f"    {micro:>5} {seconds * 1000:>9.4f}  {truth[fastest] / seconds:>6.1%}")
        model, optimizer, make_batch, loss_fn = setup
        found = explore_micro_batch(
            model, optimizer, make_batch, loss_fn,
            global_batch=GLOBAL_BATCH, budget_steps=BUDGET, device=device,
        )  # fmt: skip
        choice = found.choice()
        share = truth[fastest] / truth[choice.micro_batch]
        checks.check(
            share >= WITHIN and found.steps_taken <= BUDGET,
            f"{name}: the pick's throughput is within 3% of the fastest's",
            f"picked {choice.micro_batch} (confidence {choice.score}) in {found.steps_taken} "
            f"steps of {BUDGET}: {share:.1%} of {fastest}'s",
        )
    _in_run(checks, target, monitor)


def _batches(device: torch.device, count: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    for _ in range(count):
        yield (
            torch.randn(GLOBAL_BATCH, 256, device=device),
            torch.randint(0, 10, (GLOBAL_BATCH,), device=device),
        )


def _in_run(checks: Checks, device: torch.device, monitor: EnergyMonitor | None) -> None:
    """Two runs of a job that explores inside them, energy from the default monitor."""
    job = JobSpec(
        job_id="gpu-check-micro-batch",
        batch_sizes=[GLOBAL_BATCH],
        default_batch_size=GLOBAL_BATCH,
        target_metric=0.5,
        max_epochs=2,
        eta_knob=0.5,
    )
    service = BsoService(MemoryStore())
    steps = []
    for run in (1, 2):
        model, optimizer, _, loss_fn = MODELS["mlp"](device)
        batches = _batches(device, 3 * BUDGET)
        with BatchSizeOptimizer(
            job, service=service, monitor=monitor, environ={}, explore_micro_batch=True
        ) as bso:
            bso.get_batch_size()
            bso.on_train_begin()
            choice = bso.explore_micro_batch(
                model, optimizer, loss_fn, batches, budget_steps=BUDGET, device=device
            )
            taken = 3 * BUDGET - sum(1 for _ in itertools.islice(batches, 3 * BUDGET))
            steps.append(taken)
            print(
                f"  run {run}: micro-batch {choice.micro_batch} x {bso.accumulation_steps} "
                f"passes, confidence {choice.score}, {taken} exploration step(s); energy "
                f"measured: {bso.monitor is not None and bso.monitor.measures_energy}"
            )
            bso.on_evaluate(0.9)
    (lane,) = service.status(job.job_id).lanes
    shown = [(m.batch_size, m.micro_batch_size, m.confidence, m.runs) for m in lane.micro_batches]
    print(f"  bso status: {shown}")
    checks.check(
        steps[0] <= BUDGET and bool(shown) and steps[1] <= steps[0],
        "a run's exploration reaches the service and the next run starts from it",
        f"steps {steps}, status {shown}",
    )
