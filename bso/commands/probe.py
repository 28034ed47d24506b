"""``bso probe MODULE:FACTORY``: the largest batch that fits, and the candidates from it.

``FACTORY()`` returns ``(model, optimizer, make_batch, loss_fn)`` with
``make_batch(n) -> (inputs..., targets)``.  The probe fits a line of peak
memory against batch size on a few small steps, predicts the largest batch
within the budget, and confirms it with real steps
(:func:`bso_client.memory_probe.probe_memory`); the model and optimizer are
put back after every step.  The budget: ``--memory-budget``, or on a CUDA
device its free memory less a safety margin.  With ``--micro-batch N`` every
device runs a candidate as passes of N samples and accumulates their gradients,
and ``--devices D`` splits each candidate over D data-parallel devices: the
candidates are global batch sizes, multiples of N x D (see
:mod:`bso_client.discovery` for how far they go).  ``--explore-micro-batch
--global-batch B`` then times the micro-batches of B that fit instead
(:mod:`bso.commands.probe_micro_batch`).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path
from typing import Any

from bso.commands import probe_micro_batch
from bso.commands.arguments import positive_int
from bso.commands.failures import UserError
from bso.spec import MAX_BATCH_SIZE
from bso.spec import memory_size as parse_memory_size
from bso_client.discovery import CUDA_SAFETY_MARGIN, Discovery, ProbedPlan, probe_plan


def memory_size(text: str) -> int:
    """``512MiB``, ``2GB``, ``1.5G``, ``1000000`` (bytes) -> bytes: :func:`bso.spec.memory_size`,
    the parser ``Discovery(memory_budget=...)`` shares; argparse names ``--memory-budget``."""
    try:
        return parse_memory_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("factory", help="MODULE:FACTORY, e.g. mymodel:probe_setup")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: cpu)")
    parser.add_argument(
        "--memory-budget",
        type=memory_size,
        help="peak memory a step may use, e.g. 2GiB (default on a GPU: its free memory "
        f"less {CUDA_SAFETY_MARGIN * 100:.0f}%%; required on the CPU)",
    )
    parser.add_argument(
        "--limit",
        type=positive_int,
        help="largest global batch size to consider (with --micro-batch: how far "
        "accumulation may take the batch; default: what fits in one pass per device)",
    )
    parser.add_argument(
        "--micro-batch",
        type=positive_int,
        help="samples per device per forward/backward pass; batches accumulate passes",
    )
    parser.add_argument(
        "--devices",
        type=positive_int,
        default=1,
        help="data-parallel devices a batch is split across",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    probe_micro_batch.configure_parser(parser)


def load_factory(spec: str) -> Any:
    module_name, _, name = spec.partition(":")
    if not module_name or not name:
        raise UserError(f"expected MODULE:FACTORY, e.g. mymodel:probe_setup; got {spec!r}")
    sys.path.insert(0, str(Path.cwd()))
    try:
        return getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as exc:
        raise UserError(
            f"cannot load {spec} ({exc}); run bso probe where MODULE is importable, "
            "and name a function of it"
        ) from exc


def checked(factory: Any, name: str) -> Any:
    """``factory`` whose own failures, and a result of the wrong shape, are the user's
    to fix (one line naming it), not an internal error of bso's."""

    def call() -> tuple[Any, Any, Any, Any]:
        try:
            made = factory()
        except Exception as exc:
            raise UserError(
                f"{name}() raised {type(exc).__name__}: {exc}; fix the factory "
                "(BSO_DEBUG=1 shows the traceback)"
            ) from exc
        if not isinstance(made, tuple | list) or len(made) != 4:
            raise UserError(
                f"{name}() must return (model, optimizer, make_batch, loss_fn), got "
                f"{type(made).__name__}"
                + (f" of {len(made)}" if isinstance(made, tuple | list) else "")
            )
        model, optimizer, make_batch, loss_fn = made
        return model, optimizer, make_batch, loss_fn

    return call


def check_device(device: str) -> None:
    """A device torch can use here, or a message that says why not."""
    import torch

    try:
        parsed = torch.device(device)
    except RuntimeError as exc:
        raise UserError(f"not a device: {device!r} ({exc}); give cpu, cuda or cuda:N") from exc
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"{device} asked for, but torch sees no CUDA device here; use --device cpu")
    if parsed.type not in ("cpu", "cuda"):
        raise UserError(f"measures memory on cpu or cuda devices, not {device!r}")


def run(args: argparse.Namespace) -> int:
    from bso_client.errors import NoBatchSizeFits

    check_device(args.device)
    if args.memory_budget is None and not args.device.startswith("cuda"):
        raise UserError("on the CPU give --memory-budget (e.g. --memory-budget 2GiB)")
    probe_micro_batch.check(args)
    unit = (args.micro_batch or 1) * args.devices
    if args.limit is not None and args.limit > MAX_BATCH_SIZE:
        raise UserError(
            f"--limit {args.limit} is above {MAX_BATCH_SIZE}, the largest batch size "
            "a job may list; lower it"
        )
    if args.limit is not None and args.limit < unit:
        raise UserError(
            f"--limit {args.limit} is below one micro-batch on every device "
            f"({args.micro_batch or 1} x {args.devices} = {unit}); raise --limit"
        )
    factory = checked(load_factory(args.factory), args.factory)
    discovery = Discovery(
        factory=factory,
        memory_budget=args.memory_budget,
        device=args.device,
        micro_batch_size=args.micro_batch,
        # Exploring, no pass larger than the global batch is of use.
        limit=args.global_batch if args.explore_micro_batch else args.limit,
    )
    try:
        found = probe_plan(discovery, devices=args.devices, read_cache=False, write_cache=False)
        if args.explore_micro_batch:
            return probe_micro_batch.explore(args, factory, found.max_batch_size)
    except (UserError, NoBatchSizeFits):
        raise
    except (RuntimeError, TypeError, ValueError, IndexError, KeyError) as exc:
        # Raised while running the user's model, batches and loss (bso's own
        # steps are a forward, a backward and an optimizer step around them).
        raise UserError(
            f"a training step of {args.factory} failed ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}); check its model, make_batch "
            "and loss_fn (BSO_DEBUG=1 shows the traceback; report it if it points into bso)"
        ) from exc
    if args.json:
        print(json.dumps(found.to_json(), indent=1))
        return 0
    print(summary(found))
    return 0


def summary(found: ProbedPlan) -> str:
    error = found.predicted_peak_bytes / found.measured_peak_bytes - 1
    plan = found.plan
    lines = [
        f"largest batch within {found.memory_budget_bytes / 2**20:.1f} MiB on {found.device}: "
        f"{found.max_batch_size} per device and pass (predicted peak "
        f"{found.predicted_peak_bytes / 2**20:.1f} MiB, measured "
        f"{found.measured_peak_bytes / 2**20:.1f} MiB, {error:+.1%}; {found.trials} real "
        f"steps, {found.seconds:.1f} s)",
        f"candidates {plan.batch_sizes}, default {plan.default_batch_size}",
    ]
    if plan.micro_batch_size or plan.devices:
        splits = [(b, plan.split(b)) for b in plan.batch_sizes]
        lines.append(
            "per candidate: "
            + ", ".join(
                f"{b} = {s.micro_batch_size} x {s.accumulation_steps} passes x "
                f"{plan.devices or 1} devices"
                for b, s in splits
            )
        )
    return "\n".join(lines)
