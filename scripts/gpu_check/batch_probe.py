"""The ``probe`` section: the batch-size search on real GPU memory.

:func:`find_max_batch_size` on raw allocations, whose right answer is the free
memory; then :func:`probe_model` on an MLP, which must leave the model, its
gradients, the optimizer and the allocator exactly as it found them, and whose
answer must be a size that a training step really fits in.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from bso.spec import MAX_BATCH_SIZE
from bso_client import batch_search
from gpu_check.report import MIB, Checks, gib, heading
from gpu_check.workloads import MlpTask, free_cuda


def _host(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True)


def _snapshot(task: MlpTask) -> dict[str, Any]:
    """A copy in host memory, so that it takes nothing from the probes on the GPU."""
    model, optimizer = task.model, task.optimizer
    return {
        "params": {k: _host(v) for k, v in model.state_dict().items()},
        "grads": {
            k: None if p.grad is None else _host(p.grad) for k, p in model.named_parameters()
        },
        "optimizer": {
            i: {k: _host(v) if isinstance(v, torch.Tensor) else v for k, v in s.items()}
            for i, s in enumerate(optimizer.state.values())
        },
        "lrs": [g["lr"] for g in optimizer.param_groups],
        "training": [m.training for m in model.modules()],
    }


def _same(a: Any, b: Any) -> bool:
    """Equal to the bit, tensors included, through nested dicts and lists."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and bool(torch.equal(a, b))
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _check_allocation_search(checks: Checks, free_b: int, total_b: int) -> None:
    """Raw allocations of b MiB: the answer should be about the free memory."""

    def allocate(mib: int) -> None:
        block = torch.empty(mib * MIB, dtype=torch.uint8, device="cuda")
        del block

    start = time.perf_counter()
    found = batch_search.find_max_batch_size(allocate, start=1, limit=2 * total_b // MIB)
    took = time.perf_counter() - start
    free_cuda()
    free_after, _ = torch.cuda.mem_get_info()
    print(
        f"  allocation search: largest block {found} MiB, free before {free_b // MIB} MiB, "
        f"free after {free_after // MIB} MiB; {took:.2f} s"
    )
    checks.check(
        free_b // MIB - 1024 <= found <= free_b // MIB,
        "largest allocation found is within 1 GiB below the free memory",
    )


def section_probe(checks: Checks) -> None:
    heading("d. batch search: find_max_batch_size and probe_model on the real GPU")
    free_cuda()
    free_b, total_b = torch.cuda.mem_get_info()
    _check_allocation_search(checks, free_b, total_b)

    # probe_model on an MLP whose activations fill the GPU below the search limit.
    tf32_before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    depth = 24
    task = MlpTask(width=512, depth=depth)
    task.step(256)  # Adam has moments and the parameters have gradients before the probe
    task.model.eval()  # a mode the probe must put back (it trains in train mode)
    torch.cuda.synchronize()
    before = _snapshot(task)
    allocated_before = torch.cuda.memory_allocated()
    print(
        f"  MLP {depth} x {task.width}, Adam, "
        f"{sum(p.numel() for p in task.model.parameters()):,} "
        f"parameters; allocated before the probe {allocated_before / MIB:.1f} MiB"
    )
    search_log = logging.getLogger("bso_client.batch_search")
    search_log.setLevel(logging.DEBUG)  # every probe's outcome goes into the log
    start = time.perf_counter()
    max_bs = batch_search.probe_model(
        task.model,
        task.optimizer,
        task.make_batch,
        torch.nn.functional.cross_entropy,
        device="cuda",
        limit=MAX_BATCH_SIZE,
        granularity=1024,
    )
    took = time.perf_counter() - start
    search_log.setLevel(logging.INFO)
    torch.cuda.synchronize()
    allocated_after = torch.cuda.memory_allocated()
    reserved_after = torch.cuda.memory_reserved()
    after = _snapshot(task)
    print(
        f"  probe_model: max batch size {max_bs:,} (limit {MAX_BATCH_SIZE:,}, granularity 1024) "
        f"in {took:.1f} s"
    )
    print(
        f"  allocated after {allocated_after / MIB:.1f} MiB "
        f"({(allocated_after - allocated_before) / MIB:+.1f} MiB), "
        f"reserved after {reserved_after / MIB:.1f} MiB"
    )
    checks.check(2 <= max_bs < MAX_BATCH_SIZE, "the probe hit out of memory below the limit")
    checks.check(_same(before["params"], after["params"]), "weights and buffers restored exactly")
    checks.check(_same(before["grads"], after["grads"]), "gradients restored exactly")
    checks.check(
        _same(before["optimizer"], after["optimizer"]) and before["lrs"] == after["lrs"],
        "Adam state (moments, step) and learning rates restored exactly",
    )
    checks.check(before["training"] == after["training"], "train/eval modes restored")
    checks.check(
        allocated_after <= allocated_before + MIB,
        "torch.cuda.memory_allocated back to its level before the probe (within 1 MiB)",
        f"{allocated_before:,} -> {allocated_after:,} bytes",
    )
    checks.check(
        reserved_after <= allocated_after + 64 * MIB,
        "the allocator cache was handed back (reserved within 64 MiB of allocated)",
    )

    # The answer is usable: one more training step at that size fits.
    torch.cuda.reset_peak_memory_stats()
    fits = True
    try:
        task.model.train()
        task.step(max_bs)
    except Exception as exc:
        fits = False
        print(f"  a step at {max_bs} raised {type(exc).__name__}: {exc}")
    peak = torch.cuda.max_memory_allocated()
    free_cuda()
    torch.backends.cuda.matmul.allow_tf32 = tf32_before  # the later sections measure bf16
    checks.check(
        fits,
        f"a training step at the batch size found ({max_bs:,}) fits",
        f"peak allocated {gib(peak)} of {gib(total_b)}",
    )
