"""The ``memprobe`` section: issue 12's memory probe (predict, then confirm) on real GPU memory.

The tests run :func:`bso_client.memory_probe.probe_memory` on the CPU, where it
counts what the profiler sees; on a CUDA device it reads the allocator's peak.
Here, on an MLP with Adam:

* ``probe_memory`` with budgets of 4 GiB, 16 GiB and the GPU's free memory less
  Discovery's margin: the maximum's predicted and measured peaks, the steps and
  the time; the measured peak is within the budget and uses most of it, a step
  at 1.1 x the maximum really goes over (or runs out of memory), and the model,
  its gradients, Adam's state and the allocator are as they were;
* a budget twice the card's memory, so that a step really runs out of memory
  inside the probe and must count as over the budget;
* ``bso probe gpu_check.probe_factory:setup --device cuda --memory-budget 4GiB
  --json`` in process, as a user runs it;
* :func:`bso_client.discovery.probe_plan` with no budget (free memory less the
  margin): a plan, cached, and the cached plan read back without a step.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from bso_client import discovery
from bso_client.batch_search import (
    is_allocation_failure,
    preserved_training_state,
    training_steps,
)
from bso_client.memory_probe import AIM, MAX_RUNS, MemoryProbe, _peak_bytes, probe_memory
from gpu_check.batch_probe import _same, _snapshot
from gpu_check.report import MIB, Checks, gib, heading
from gpu_check.workloads import MlpTask, free_cuda

DEVICE = "cuda"
WIDTH = 512
DEPTH = 64
"""About 100-130 KiB of activations and 100 MFLOP (forward and backward) a sample: the
free memory of an 80 GB card holds some 600,000 samples, within the reach of the
probe's 8 steps (each at most 8x the largest size so far: 32 x 8^5 = 1,048,576), and
a step of that size takes well under a second in TF32."""
GIB = 1 << 30
BUDGETS = ((4 * GIB, "4 GiB"), (16 * GIB, "16 GiB"))
"""Fixed budgets; the free-memory one is added when the section runs."""
CLI_BUDGET = "4GiB"
FACTORY = "gpu_check.probe_factory:setup"
MAX_ERROR = 0.15
"""The prediction at the maximum is within this of the measured peak (the tests' bound)."""
MIN_USE = 0.85
"""The maximum's measured peak is at least this share of the budget (the probe aims at 97%)."""


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(output, target)


def _steps_line(found: MemoryProbe) -> str:
    return ", ".join(
        f"{b:,}: {'out of memory' if m is None else f'{m / MIB:,.0f} MiB'}" for b, m in found.points
    )


def _step_peak(task: MlpTask, batch_size: int) -> int | None:
    """The peak of a training step at ``batch_size`` measured as the probe measures one
    (a warm-up step, then the measured one); None when it runs out of memory.  The
    model and optimizer are put back afterwards."""
    run = training_steps(task.model, task.optimizer, task.make_batch, _loss, DEVICE)

    def step() -> None:
        run(batch_size)

    out_of_memory = False
    with preserved_training_state(task.model, task.optimizer):
        task.model.train()
        try:
            step()
            peak: int | None = _peak_bytes(step, torch.device(DEVICE), task.model, task.optimizer)
        except RuntimeError as exc:
            if not is_allocation_failure(exc):
                raise
            out_of_memory = True
            peak = None
    if out_of_memory:
        free_cuda()
    return peak


def _probe_with_budget(
    checks: Checks, task: MlpTask, budget: int, label: str, *, beyond_memory: bool = False
) -> None:
    """One ``probe_memory`` run on ``task`` and what it must leave behind."""
    free_cuda()
    before = _snapshot(task)
    allocated_before = torch.cuda.memory_allocated()
    start = time.perf_counter()
    found = probe_memory(
        task.model, task.optimizer, task.make_batch, _loss, budget_bytes=budget, device=DEVICE
    )
    took = time.perf_counter() - start
    torch.cuda.synchronize()
    allocated_after = torch.cuda.memory_allocated()
    after = _snapshot(task)
    error = found.predicted_peak_bytes / found.measured_peak_bytes - 1
    print(
        f"  budget {label} ({budget:,} bytes): max batch {found.max_batch_size:,}; peak at it "
        f"predicted {gib(found.predicted_peak_bytes)}, measured {gib(found.measured_peak_bytes)} "
        f"({error:+.2%}), {found.measured_peak_bytes / budget:.1%} of the budget; "
        f"{found.trials} real steps, {took:.1f} s"
    )
    print(
        f"    line {found.model.fixed_bytes / MIB:,.1f} MiB + "
        f"{found.model.bytes_per_sample / 1024:,.2f} KiB x batch; steps {_steps_line(found)}"
    )
    tag = f"[{label}]"
    checks.check(
        found.trials <= MAX_RUNS, f"{tag} at most {MAX_RUNS} real steps", str(found.trials)
    )
    checks.check(
        found.measured_peak_bytes <= budget,
        f"{tag} the maximum's measured peak is within the budget",
        f"{found.measured_peak_bytes:,} <= {budget:,}",
    )
    if beyond_memory:
        checks.check(
            any(m is None for _, m in found.points),
            f"{tag} a step ran out of memory inside the probe and counted as over the budget",
            _steps_line(found),
        )
        within = [b for b, m in found.points if m is not None and m <= budget]
        checks.check(
            bool(within) and found.max_batch_size == max(within),
            f"{tag} the answer is the largest size a real step fitted",
        )
    else:
        checks.check(
            abs(error) <= MAX_ERROR,
            f"{tag} the prediction at the maximum is within {MAX_ERROR:.0%} of the measured peak",
            f"{error:+.2%}",
        )
        checks.check(
            found.measured_peak_bytes >= MIN_USE * budget,
            f"{tag} the maximum uses at least {MIN_USE:.0%} of the budget",
            f"{found.measured_peak_bytes / budget:.1%} (aim {AIM:.0%})",
        )
        next_predicted = found.model.predict(found.max_batch_size + 1)
        over_size = max(found.max_batch_size + 1, math.ceil(1.1 * found.max_batch_size))
        over_peak = _step_peak(task, over_size)
        print(
            f"    the final line predicts {gib(next_predicted)} at {found.max_batch_size + 1:,} "
            f"(aim {gib(AIM * budget)}); a real step at 1.1 x the maximum ({over_size:,}) "
            f"peaked at {'out of memory' if over_peak is None else gib(over_peak)}"
        )
        checks.check(
            over_peak is None or over_peak > budget,
            f"{tag} a real step at 1.1 x the maximum goes over the budget (or out of memory)",
            "out of memory" if over_peak is None else f"{over_peak:,} > {budget:,}",
        )
    free_cuda()
    allocated_end = torch.cuda.memory_allocated()
    end = _snapshot(task)  # after the step at 1.1 x too, which puts the state back as well
    checks.check(
        _same(before["params"], after["params"]) and _same(before["params"], end["params"]),
        f"{tag} weights and buffers restored exactly",
    )
    checks.check(
        _same(before["grads"], after["grads"]) and _same(before["grads"], end["grads"]),
        f"{tag} gradients restored exactly",
    )
    checks.check(
        _same(before["optimizer"], after["optimizer"])
        and _same(before["optimizer"], end["optimizer"])
        and before["lrs"] == after["lrs"] == end["lrs"],
        f"{tag} Adam state (moments, step) and learning rates restored exactly",
    )
    checks.check(
        before["training"] == after["training"] == end["training"],
        f"{tag} train/eval modes restored",
    )
    checks.check(
        max(allocated_after, allocated_end) <= allocated_before + MIB,
        f"{tag} torch.cuda.memory_allocated back to its level (within 1 MiB)",
        f"{allocated_before:,} -> {allocated_after:,} after the probe, {allocated_end:,} at the "
        "end",
    )


def _check_cli(checks: Checks) -> None:
    """``bso probe FACTORY --device cuda --memory-budget 4GiB --json``, in process."""
    from bso.cli import main
    from bso.commands.probe import memory_size

    free_cuda()
    allocated_before = torch.cuda.memory_allocated()
    argv = ["probe", FACTORY, "--device", DEVICE, "--memory-budget", CLI_BUDGET, "--json"]
    out, err = io.StringIO(), io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(argv)
    took = time.perf_counter() - start
    free_cuda()
    allocated_after = torch.cuda.memory_allocated()
    print(f"  bso {' '.join(argv)}: exit {status}, {took:.1f} s")
    if err.getvalue().strip():
        print(f"    stderr: {err.getvalue().strip()}")
    checks.check(status == 0, "bso probe --device cuda --json exits 0", f"{status}")
    try:
        result: dict[str, Any] = json.loads(out.getvalue())
    except ValueError:
        print(f"    stdout: {out.getvalue()[:2000]!r}")
        checks.check(False, "bso probe --json prints one JSON document")
        return
    budget = memory_size(CLI_BUDGET)
    measured, predicted = result["measured_peak_bytes"], result["predicted_peak_bytes"]
    error = predicted / measured - 1
    print(
        f"    max {result['max_batch_size']:,}, default {result['default_batch_size']:,}, "
        f"candidates {result['candidates']}; predicted {gib(predicted)}, measured "
        f"{gib(measured)} ({error:+.2%}); {result['trials']} steps, {result['seconds']} s; "
        f"device {result['device']!r}, budget {result['memory_budget_bytes']:,}"
    )
    checks.check(
        result["device"] == DEVICE and result["memory_budget_bytes"] == budget,
        "bso probe measured on cuda with the budget given",
    )
    checks.check(measured <= budget, "bso probe: the measured peak is within --memory-budget")
    checks.check(
        abs(error) <= MAX_ERROR,
        f"bso probe: the prediction is within {MAX_ERROR:.0%} of the measured peak",
        f"{error:+.2%}",
    )
    checks.check(
        result["max_batch_size"] == max(result["candidates"])
        and result["default_batch_size"] in result["candidates"]
        and result["trials"] == len(result["steps"]) <= MAX_RUNS,
        "bso probe: the candidates end at the maximum, the default is one, steps <= 8",
    )
    checks.check(
        allocated_after <= allocated_before + MIB,
        "bso probe leaves no CUDA memory allocated once its model is dropped",
        f"{allocated_before:,} -> {allocated_after:,}",
    )


def _check_discovery(checks: Checks) -> None:
    """``probe_plan`` on the factory with no budget: free memory less the margin; then the cache."""
    from gpu_check.probe_factory import setup

    free_cuda()
    free_b, _ = torch.cuda.mem_get_info()
    with tempfile.TemporaryDirectory(prefix="bso-gpu-check-") as cache:
        wanted = discovery.Discovery(setup, device=DEVICE, cache_dir=Path(cache))
        key = torch.cuda.get_device_name()
        start = time.perf_counter()
        first = discovery.probe_plan(wanted, hardware_key=key)
        took = time.perf_counter() - start
        free_cuda()
        start = time.perf_counter()
        again = discovery.probe_plan(wanted, hardware_key=key)
        took_again = time.perf_counter() - start
        cached_files = sorted(p.name for p in Path(cache).iterdir())
    free_cuda()
    plan = first.plan
    error = first.predicted_peak_bytes / first.measured_peak_bytes - 1
    print(
        f"  Discovery (no budget: free {gib(free_b)} less {discovery.CUDA_SAFETY_MARGIN:.0%}, "
        f"budget {gib(first.memory_budget_bytes)}): max {first.max_batch_size:,}, "
        f"predicted {gib(first.predicted_peak_bytes)}, measured "
        f"{gib(first.measured_peak_bytes)} ({error:+.2%}); {first.trials} steps, {took:.1f} s"
    )
    print(f"    plan: candidates {plan.batch_sizes}, default {plan.default_batch_size}")
    print(f"    again: cached={again.cached}, {took_again:.2f} s; cache files {cached_files}")
    checks.check(
        first.device == DEVICE and not first.cached, "Discovery probed on cuda (not cached)"
    )
    checks.check(
        0.8 * free_b <= first.memory_budget_bytes <= free_b + torch.cuda.memory_allocated(),
        "Discovery's budget is the free memory less its margin",
        f"{first.memory_budget_bytes:,} of {free_b:,} free",
    )
    checks.check(
        first.measured_peak_bytes <= first.memory_budget_bytes,
        "Discovery: the maximum's measured peak is within the budget",
    )
    checks.check(
        max(plan.batch_sizes) == first.max_batch_size
        and plan.default_batch_size in plan.batch_sizes
        and plan.batch_sizes == sorted(plan.batch_sizes),
        "Discovery's plan: sorted candidates up to the maximum, the default among them",
    )
    checks.check(
        again.cached and again.plan == plan and again.max_batch_size == first.max_batch_size,
        "the second probe_plan reads the same plan from the cache",
        f"{took_again:.2f} s",
    )


def _guarded(checks: Checks, what: str, part: Callable[[], None]) -> None:
    """Run one part; one that raises is a failed check, and the next part still runs."""
    try:
        part()
    except Exception:
        traceback.print_exc(file=sys.stdout)
        checks.check(False, f"{what} ran to its end")
    finally:
        free_cuda()


def section_memory_probe(checks: Checks) -> None:
    heading("f. memory probe: probe_memory, bso probe --device cuda, Discovery on the real GPU")
    free_cuda()
    tf32_before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True  # the large steps take a fraction of the time
    try:
        task = MlpTask(width=WIDTH, depth=DEPTH)
        task.step(256)  # Adam has moments and the parameters have gradients before the probe
        task.model.eval()  # a mode the probe must put back (it trains in train mode)
        free_cuda()
        parameters = sum(p.numel() for p in task.model.parameters())
        free_b, total_b = torch.cuda.mem_get_info()
        print(
            f"  MLP {DEPTH} x {WIDTH}, Adam, {parameters:,} parameters; allocated "
            f"{torch.cuda.memory_allocated() / MIB:,.1f} MiB; free {gib(free_b)} of {gib(total_b)}"
        )
        for budget, label in BUDGETS:
            _guarded(
                checks,
                f"probe_memory [{label}]",
                partial(_probe_with_budget, checks, task, budget, label),
            )
        free_cuda()
        whole = discovery.memory_budget(DEVICE, None)
        label = "free memory less 10%"
        _guarded(
            checks,
            f"probe_memory [{label}]",
            partial(_probe_with_budget, checks, task, whole, label),
        )
        label = "twice the card"
        _guarded(
            checks,
            f"probe_memory [{label}]",
            partial(_probe_with_budget, checks, task, 2 * total_b, label, beyond_memory=True),
        )
        del task
        free_cuda()
        _guarded(checks, "bso probe --device cuda", partial(_check_cli, checks))
        _guarded(checks, "Discovery's probe_plan", partial(_check_discovery, checks))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32_before
        free_cuda()
