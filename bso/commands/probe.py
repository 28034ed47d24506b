"""``bso probe MODULE:FACTORY``: the largest batch that fits, and the candidates from it.

``FACTORY()`` returns ``(model, optimizer, make_batch, loss_fn)`` with
``make_batch(n) -> (inputs..., targets)``.  The probe fits a line of peak
memory against batch size on a few small steps, predicts the largest batch
within the budget, and confirms it with real steps
(:func:`bso_client.memory_probe.probe_memory`); the model and optimizer are
put back after every step.  The budget: ``--memory-budget``, or on a CUDA
device its free memory less a safety margin.  Every candidate runs as one step
of its full size (no micro-batching yet: ``accumulation_steps`` is 1).
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

from bso_client.batch_candidates import auto_batch_sizes

CUDA_SAFETY_MARGIN = 0.10
"""Share of a GPU's free memory left out of the budget: other processes, the CUDA
context's own growth, the allocator's fragmentation."""
UNITS = {"": 1, "b": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4}
BINARY_UNITS = {"ki": 1024, "mi": 1024**2, "gi": 1024**3, "ti": 1024**4}


def memory_size(text: str) -> int:
    """``512MiB``, ``2GB``, ``1.5G``, ``1000000`` (bytes) -> bytes."""
    found = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]i?)?b?\s*", text.lower())
    if not found:
        raise argparse.ArgumentTypeError(f"not a memory size: {text!r} (e.g. 512MiB, 2GB)")
    number, unit = float(found.group(1)), found.group(2) or ""
    scale = BINARY_UNITS.get(unit) or UNITS[unit]
    size = int(number * scale)
    if size < 1:
        raise argparse.ArgumentTypeError(f"a memory budget must be positive, got {text!r}")
    return size


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("factory", help="MODULE:FACTORY, e.g. mymodel:probe_setup")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: cpu)")
    parser.add_argument(
        "--memory-budget",
        type=memory_size,
        help="peak memory a step may use, e.g. 2GiB (default on a GPU: its free memory "
        f"less {CUDA_SAFETY_MARGIN:.0%}; required on the CPU)",
    )
    parser.add_argument("--limit", type=int, help="never probe above this batch size")
    parser.add_argument("--json", action="store_true", help="print one JSON document")


def load_factory(spec: str) -> Any:
    module_name, _, name = spec.partition(":")
    if not module_name or not name:
        raise SystemExit(f"bso probe: expected MODULE:FACTORY, got {spec!r}")
    sys.path.insert(0, str(Path.cwd()))
    try:
        return getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as exc:
        raise SystemExit(f"bso probe: cannot load {spec}: {exc}") from exc


def check_device(device: str) -> None:
    """A device torch can use here, or a message that says why not."""
    import torch

    try:
        parsed = torch.device(device)
    except RuntimeError as exc:
        raise SystemExit(f"bso probe: not a device: {device!r} ({exc})") from exc
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"bso probe: {device} asked for, but torch sees no CUDA device here")
    if parsed.type not in ("cpu", "cuda"):
        raise SystemExit(f"bso probe: measures memory on cpu or cuda devices, not {device!r}")


def budget_for(device: str, given: int | None) -> int:
    if given is not None:
        return given
    if not device.startswith("cuda"):
        raise SystemExit("bso probe: on the CPU give --memory-budget (e.g. --memory-budget 2GiB)")
    import torch

    free, _total = torch.cuda.mem_get_info(torch.device(device))
    return int(free * (1 - CUDA_SAFETY_MARGIN)) + int(torch.cuda.memory_allocated(device))


def run(args: argparse.Namespace) -> int:
    from bso_client.errors import NoBatchSizeFits
    from bso_client.memory_probe import probe_memory

    check_device(args.device)
    setup = load_factory(args.factory)
    model, optimizer, make_batch, loss_fn = setup()
    model.to(args.device)
    budget = budget_for(args.device, args.memory_budget)
    started = time.perf_counter()
    try:
        found = probe_memory(
            model,
            optimizer,
            make_batch,
            loss_fn,
            budget_bytes=budget,
            device=args.device,
            limit=args.limit,
        )
    except NoBatchSizeFits as exc:
        print(f"bso probe: {exc}", file=sys.stderr)
        return 1
    seconds = time.perf_counter() - started
    sizes = auto_batch_sizes(found.max_batch_size)
    result = {
        "max_batch_size": found.max_batch_size,
        "default_batch_size": sizes.default_batch_size,
        "candidates": sizes.batch_sizes,
        "predicted_peak_bytes": found.predicted_peak_bytes,
        "measured_peak_bytes": found.measured_peak_bytes,
        "memory_budget_bytes": budget,
        "trials": found.trials,
        "steps": [{"batch_size": b, "peak_bytes": m} for b, m in found.points],
        "micro_batch_size": None,
        "accumulation_steps": dict.fromkeys((str(b) for b in sizes.batch_sizes), 1),
        "bytes_per_sample": round(found.model.bytes_per_sample),
        "fixed_bytes": round(found.model.fixed_bytes),
        "device": args.device,
        "seconds": round(seconds, 2),
    }
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    error = found.predicted_peak_bytes / found.measured_peak_bytes - 1
    print(
        f"largest batch within {budget / 2**20:.1f} MiB on {args.device}: "
        f"{found.max_batch_size} (predicted peak {found.predicted_peak_bytes / 2**20:.1f} MiB, "
        f"measured {found.measured_peak_bytes / 2**20:.1f} MiB, {error:+.1%}; "
        f"{found.trials} real steps, {seconds:.1f} s)"
    )
    print(f"candidates {sizes.batch_sizes}, default {sizes.default_batch_size}")
    return 0
