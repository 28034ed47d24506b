"""``bso probe MODULE:FACTORY --explore-micro-batch --global-batch B``: the fastest
micro-batch for a global batch, timed on real training steps.

The largest micro-batch that fits comes from the memory probe (the same budget
rules as ``bso probe``); the candidates are the divisors of ``B / --devices`` up
to it; :func:`bso_client.micro_batch_probe.explore_micro_batch` times them
(:mod:`bso.core.micro_batch` decides which, and when to stop) and prints one
Cerebras-style line per update, then a table.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from bso.commands.failures import UserError
from bso.core.micro_batch import MicroBatchChoice, MicroBatchExploration, accumulation_steps

DEFAULT_STEPS = 60
"""Optimizer steps an offline exploration may time (``--steps``)."""


def configure_parser(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("micro-batch exploration")
    group.add_argument(
        "--explore-micro-batch",
        action="store_true",
        help="time the micro-batches of --global-batch and recommend the fastest",
    )
    group.add_argument("--global-batch", type=int, help="the global batch to split")
    group.add_argument(
        "--steps",
        type=int,
        default=DEFAULT_STEPS,
        help=f"optimizer steps the exploration may time (default {DEFAULT_STEPS})",
    )


def check(args: argparse.Namespace) -> None:
    """The exploration's arguments, before anything runs."""
    if args.global_batch is None:
        raise UserError("--explore-micro-batch needs --global-batch B (the batch to split)")
    if args.global_batch < 1 or args.global_batch % args.devices:
        raise UserError(
            f"--global-batch {args.global_batch} must be a positive multiple of "
            f"--devices {args.devices}"
        )
    if args.steps < 1:
        raise UserError(f"--steps must be at least 1, got {args.steps}")
    if args.micro_batch is not None or args.limit is not None:
        raise UserError("--explore-micro-batch chooses the micro-batch: drop --micro-batch/--limit")


def explore(args: argparse.Namespace, factory: Any, largest_fitting: int) -> int:
    from bso_client.micro_batch_probe import explore_micro_batch

    def show(choice: MicroBatchChoice) -> None:
        if not args.json:
            print(f"bso: {choice.log_line()}", flush=True)

    model, optimizer, make_batch, loss_fn = factory()
    exploration = explore_micro_batch(
        model, optimizer, make_batch, loss_fn,
        global_batch=args.global_batch, budget_steps=args.steps, devices=args.devices,
        largest_fitting=largest_fitting, device=args.device, on_update=show,
    )  # fmt: skip
    if args.json:
        json.dump(report(args, exploration), sys.stdout, indent=1)
        print()
    else:
        print(table(args, exploration))
    return 0


def report(args: argparse.Namespace, exploration: MicroBatchExploration) -> dict[str, Any]:
    choice = exploration.choice()
    per_device = args.global_batch // args.devices
    rows = []
    for micro in exploration.candidates:
        steps = exploration.steps.get(micro, [])
        counted = steps[1:]
        rows.append(
            {
                "micro_batch": micro,
                "accumulation": accumulation_steps(per_device, 1, micro),
                "steps": len(steps),
                "ms_per_sample": (
                    1000 * sum(math.exp(v) for v in counted) / len(counted) if counted else None
                ),
                "confidence": choice.probability.get(micro),
                "dropped": micro in exploration.dropped,
            }
        )
    return {
        "global_batch": args.global_batch,
        "devices": args.devices,
        "largest_fitting": max(exploration.candidates),
        "steps": exploration.steps_taken,
        "recommended": choice.micro_batch,
        "performance": choice.performance,
        "confidence": choice.score,
        "base": exploration.base,
        "candidates": rows,
    }


def table(args: argparse.Namespace, exploration: MicroBatchExploration) -> str:
    found = report(args, exploration)
    lines = [
        f"global batch {found['global_batch']} on {found['devices']} device(s); micro-batches "
        f"up to {found['largest_fitting']} fit; {found['steps']} steps timed",
        f"{'micro':>6} {'passes':>6} {'steps':>5} {'ms/sample':>10} {'P(within 1%)':>13}",
    ]
    for row in found["candidates"]:
        ms = "-" if row["ms_per_sample"] is None else f"{row['ms_per_sample']:.3f}"
        chance = "-" if row["confidence"] is None else f"{row['confidence']:.2f}"
        lines.append(
            f"{row['micro_batch']:>6} {row['accumulation']:>6} {row['steps']:>5} {ms:>10} "
            f"{chance:>13}" + ("  (dropped)" if row["dropped"] else "")
        )
    lines.append(
        f"recommended micro_batch_size {found['recommended']}: {found['performance']:.2f}x "
        f"the largest that fits ({found['base']}), confidence {found['confidence']} (out of 100)"
    )
    return "\n".join(lines)
