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
import sys
from typing import TYPE_CHECKING, Any

from bso.commands.failures import UserError
from bso.core.cost import COST_TOLERANCE
from bso.core.micro_batch import (
    MIN_TIMED_STEPS,
    WARMUP_STEPS,
    MicroBatchChoice,
    MicroBatchExploration,
    accumulation_steps,
)
from bso.spec import MAX_BATCH_SIZE

if TYPE_CHECKING:
    from bso_client.energy.base import EnergyMonitor

DEFAULT_ETA_KNOB = 0.5
"""``--eta-knob`` when not given: :class:`bso.spec.JobSpec`'s default."""
DEFAULT_STEPS = 60
"""Optimizer steps an offline exploration may take (``--steps``)."""
MIN_STEPS = 2 * (WARMUP_STEPS + MIN_TIMED_STEPS)
"""Fewer cannot compare two micro-batches."""


def configure_parser(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("micro-batch exploration")
    group.add_argument(
        "--explore-micro-batch",
        action="store_true",
        help="time the micro-batches of --global-batch and recommend the fastest",
    )
    group.add_argument("--global-batch", type=int, help="the global batch to split")
    group.add_argument(
        "--eta-knob",
        type=float,
        help="weight of energy against time in the cost, as the job's eta_knob (default "
        f"{DEFAULT_ETA_KNOB}); "
        "energy comes from NVML or RAPL where they measure, else the cost is time alone",
    )
    group.add_argument(
        "--steps",
        type=int,
        help=f"optimizer steps the exploration may take, warm-ups included (default "
        f"{DEFAULT_STEPS}, at least {MIN_STEPS})",
    )


def check(args: argparse.Namespace) -> None:
    """The exploration's arguments, before anything runs (and none without it)."""
    if not args.explore_micro_batch:
        if args.global_batch is not None or args.steps is not None or args.eta_knob is not None:
            raise UserError(
                "--global-batch, --steps and --eta-knob go with --explore-micro-batch; add it"
            )
        return
    if args.eta_knob is None:
        args.eta_knob = DEFAULT_ETA_KNOB
    if args.global_batch is None:
        raise UserError("--explore-micro-batch needs --global-batch B (the batch to split)")
    if args.micro_batch is not None or args.limit is not None:
        raise UserError("--explore-micro-batch chooses the micro-batch: drop --micro-batch/--limit")
    if not 1 <= args.global_batch <= MAX_BATCH_SIZE or args.global_batch % args.devices:
        raise UserError(
            f"--global-batch {args.global_batch} must be a multiple of --devices "
            f"{args.devices} from 1 to {MAX_BATCH_SIZE}"
        )
    if not 0 <= args.eta_knob <= 1:
        raise UserError(f"--eta-knob must be from 0 to 1, got {args.eta_knob}")
    if args.eta_knob == 1:  # before the memory probe and the factory run for nothing
        from bso_client.energy.detect import detect_monitor

        with detect_monitor() as monitor:
            _require_energy(monitor)
    if args.steps is None:
        args.steps = DEFAULT_STEPS
    if args.steps < MIN_STEPS:
        raise UserError(
            f"--steps {args.steps} is too few: comparing two micro-batches takes {MIN_STEPS} "
            f"(a warm-up and {MIN_TIMED_STEPS} timed steps each)"
        )


def explore(args: argparse.Namespace, factory: Any, largest_fitting: int) -> int:
    from bso_client.energy.detect import detect_monitor
    from bso_client.micro_batch_probe import explore_micro_batch

    def show(choice: MicroBatchChoice) -> None:
        if not args.json:
            print(f"bso: {choice.log_line()}", flush=True)

    model, optimizer, make_batch, loss_fn = factory()
    steps: dict[int, list[tuple[float, float]]] = {}
    with detect_monitor() as monitor:  # check() refused --eta-knob 1 where none measures
        exploration = explore_micro_batch(
            model, optimizer, make_batch, loss_fn,
            global_batch=args.global_batch, budget_steps=args.steps, devices=args.devices,
            largest_fitting=largest_fitting, device=args.device, on_update=show,
            monitor=monitor, eta_knob=args.eta_knob, step_log=steps,
        )  # fmt: skip
        found = report(args, exploration, largest_fitting, steps, monitor.measures_energy)
    if args.json:
        json.dump(found, sys.stdout, indent=1)
        print()
    else:
        print(table(found))
    return 0


def _require_energy(monitor: EnergyMonitor) -> None:
    if not monitor.measures_energy:
        raise UserError(
            f"--eta-knob 1 weighs energy alone, but no energy is measured here "
            f"({monitor.description}); use a value below 1"
        )


def report(
    args: argparse.Namespace,
    exploration: MicroBatchExploration,
    largest_fitting: int,
    steps: dict[int, list[tuple[float, float]]],
    energy_measured: bool,
) -> dict[str, Any]:
    choice = exploration.choice()
    per_device = args.global_batch // args.devices
    rows = []
    for micro in exploration.candidates:
        counted = steps.get(micro, [])[WARMUP_STEPS:]
        seconds = _mean([s for s, _ in counted])
        joules = _mean([j for _, j in counted]) if energy_measured else None
        rows.append(
            {
                "micro_batch": micro,
                "accumulation": accumulation_steps(per_device, 1, micro),
                "steps": len(exploration.steps.get(micro, [])),
                "timed_steps": exploration.timed(micro),
                "ms_per_sample": None if seconds is None else 1000 * seconds,
                "mj_per_sample": None if joules is None else 1000 * joules,
                "p_within_tolerance": choice.probability.get(micro),
                "dropped": micro in exploration.dropped,
            }
        )
    return {
        "global_batch": args.global_batch,
        "devices": args.devices,
        "largest_fitting": largest_fitting,
        "steps": exploration.steps_taken,
        "budget_steps": exploration.budget,
        "untimed": sum(1 for row in rows if row["timed_steps"] == 0),
        "recommended": choice.micro_batch,
        "performance": choice.performance,
        "confidence": choice.score,
        "tolerance": COST_TOLERANCE,
        "eta_knob": args.eta_knob,
        "energy_measured": energy_measured,
        "base": exploration.base,
        "candidates": rows,
    }


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def table(found: dict[str, Any]) -> str:
    within = f"P(within {found['tolerance']:.0%})"
    lines = [
        f"global batch {found['global_batch']} on {found['devices']} device(s): one pass of "
        f"{found['largest_fitting']} fits per device; {found['steps']} steps of "
        f"{found['budget_steps']} (warm-ups included); {found['untimed']} of "
        f"{len(found['candidates'])} micro-batches not timed",
        f"{'micro':>6} {'passes':>6} {'timed':>5} {'ms/sample':>10} {'mJ/sample':>10} {within:>13}",
    ]
    for row in found["candidates"]:
        ms = "-" if row["ms_per_sample"] is None else f"{row['ms_per_sample']:.4f}"
        mj = "-" if row["mj_per_sample"] is None else f"{row['mj_per_sample']:.4f}"
        chance = "-" if row["p_within_tolerance"] is None else f"{row['p_within_tolerance']:.2f}"
        lines.append(
            f"{row['micro_batch']:>6} {row['accumulation']:>6} {row['timed_steps']:>5} {ms:>10} "
            f"{mj:>10} {chance:>13}" + ("  (dropped)" if row["dropped"] else "")
        )
    cost = (
        f"the cost at eta {found['eta_knob']:g}"
        if found["energy_measured"]
        else "time alone: no energy measured here"
    )
    lines.append(
        f"recommended micro_batch_size {found['recommended']}: micro-batch {found['base']} "
        f"costs {found['performance']:.2f}x as much per sample ({cost}), confidence "
        f"{found['confidence']} (out of 100)"
    )
    return "\n".join(lines)
