"""``bso simulate``: replay recurring jobs in-process, bso against always-default and Zeus.

Needs only the core (no Redis, no Celery, no database): every policy replays
the same pre-drawn world (:mod:`bso.replay.simulate`).  With ``--growth`` it
instead compares an online batch-growth schedule with fixed sizes, per start
size, in expectation over the recorded runs (:mod:`bso.replay.growth`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict
from pathlib import Path
from typing import TextIO, cast

from tqdm import tqdm

from bso.commands.arguments import positive_int
from bso.commands.failures import UserError
from bso.commands.plot_path import checked_plot_path
from bso.core.growth import BatchGrowth
from bso.replay.growth import GrowthComparison, compare_growth
from bso.replay.lanes import TILTS, replay_pairs
from bso.replay.report import plot, to_json, write_recurrences, write_summary
from bso.replay.simulate import LEARNING_POLICIES, Comparison, compare
from bso.replay.traces import TraceError, load_trace_workloads
from bso.replay.workloads import Workload, synthetic_workloads
from bso.spec import PolicyName, checked_exploration_budget


def _beta(text: str) -> float | None:
    if text.lower() == "none":
        return None
    beta = _number(text)
    if not beta > 1.0:
        raise argparse.ArgumentTypeError(f"beta_knob must be above 1 (or 'none'), got {text}")
    return beta


def _eta(text: str) -> float:
    eta = _number(text)
    if not 0.0 <= eta <= 1.0:
        raise argparse.ArgumentTypeError(f"eta_knob must be within [0, 1], got {text}")
    return eta


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"not a finite number: {text!r}")
    return value


def _growth(text: str) -> BatchGrowth:
    parts = text.split(":")
    if len(parts) not in (2, 3):
        raise argparse.ArgumentTypeError(f"growth is EVERY:FACTOR[:MAX_BATCH_SIZE], got {text!r}")
    try:
        every, factor = positive_int(parts[0]), _number(parts[1])
        cap = positive_int(parts[2]) if len(parts) == 3 else None
        return BatchGrowth(every_epochs=every, factor=factor, max_batch_size=cap)
    except (ValueError, argparse.ArgumentTypeError) as exc:
        raise argparse.ArgumentTypeError(f"growth {text!r}: {exc}") from None


def _budget(text: str) -> float:
    try:
        return checked_exploration_budget(_number(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _policies(text: str) -> list[PolicyName]:
    names = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in names if p not in LEARNING_POLICIES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"policies are a comma list of {LEARNING_POLICIES}")
    return cast(list[PolicyName], names)


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--traces",
        type=Path,
        help="folder with Zeus-format traces (summary_train.csv, summary_power_<gpu>.csv); "
        "built-in synthetic workloads when omitted",
    )
    parser.add_argument("--gpu", help="GPU of the power trace to use (default: the first found)")
    parser.add_argument(
        "--workload", action="append", help="only this workload (repeatable) (default: all)"
    )
    parser.add_argument(
        "--eta", type=_eta, action="append", help="eta_knob (repeatable) (default: 0.5)"
    )
    parser.add_argument("--beta", type=_beta, default=2.0, help="beta_knob, or 'none'")
    parser.add_argument(
        "--recurrences", type=positive_int, default=50, help="recurrences of each job to replay"
    )
    parser.add_argument("--seed", type=int, default=1, help="seed of the world and the bandit")
    parser.add_argument(
        "--policies",
        type=_policies,
        default=list(LEARNING_POLICIES),
        help=f"comma list of learning policies to replay (default: {','.join(LEARNING_POLICIES)})",
    )
    parser.add_argument(
        "--exploration-budget",
        type=_budget,
        action="append",
        default=[],
        metavar="FRACTION",
        help="also replay bso with this exploration_budget, as column bso@FRACTION (repeatable)",
    )
    parser.add_argument(
        "--details", action="store_true", help="per-recurrence table of every policy"
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument(
        "--plot",
        type=Path,
        help="write cost and size per recurrence to this image (.png, .pdf, .svg)",
    )
    parser.add_argument(
        "--transfer",
        action="store_true",
        help="instead of the policy replay, replay each workload as a job's second GPU lane "
        "(bso/replay/lanes.py): lane B started from lane A's recurrences against a cold start",
    )
    parser.add_argument(
        "--growth",
        type=_growth,
        action="append",
        metavar="EVERY:FACTOR[:MAX]",
        help="instead of the policy replay, compare online batch growth (every EVERY epochs, "
        "by up to FACTOR, to at most MAX) with fixed sizes, per start size (repeatable)",
    )


def select_workloads(args: argparse.Namespace) -> list[Workload]:
    """The workloads ``args`` name; a :class:`UserError` says what there is otherwise."""
    if args.traces is not None and not args.traces.is_dir():
        what = "not a folder" if args.traces.exists() else "no such folder"
        raise UserError(
            f"--traces {args.traces}: {what}; give the folder of Zeus's traces "
            "(summary_train.csv, summary_power_<gpu>.csv), or leave --traces out to replay "
            "the synthetic workloads"
        )
    try:
        workloads = (
            load_trace_workloads(args.traces, args.gpu) if args.traces else synthetic_workloads()
        )
    except TraceError as exc:
        raise UserError(str(exc)) from exc
    if args.workload:
        known = {w.name for w in workloads}
        missing = sorted(set(args.workload) - known)
        if missing:
            raise UserError(f"unknown workload(s) {missing}; have {sorted(known)}")
        workloads = [w for w in workloads if w.name in args.workload]
    return workloads


def run(args: argparse.Namespace) -> int:
    if args.plot is not None:
        if args.growth:
            raise UserError("--plot plots the policy replay, not --growth: leave one of them out")
        checked_plot_path(args.plot)  # before the replay, which may take minutes
    workloads = select_workloads(args)
    etas = args.eta or [0.5]
    if args.growth:
        return run_growth(args, workloads, etas)
    if args.transfer:
        return run_transfer(args, workloads, etas)
    replays = len(args.policies) + len(args.exploration_budget)
    total = len(workloads) * len(etas) * replays * args.recurrences
    comparisons: list[Comparison] = []
    # Only on a terminal (disable=None), and gone once done: piped output stays the tables.
    with tqdm(
        total=total, desc="replaying", unit="rec", file=sys.stderr, disable=None, leave=False
    ) as bar:
        for workload in workloads:
            for eta in etas:
                comparisons.append(
                    compare(
                        workload,
                        args.policies,
                        eta_knob=eta,
                        beta_knob=args.beta,
                        recurrences=args.recurrences,
                        seed=args.seed,
                        budgets=args.exploration_budget,
                        on_recurrence=lambda _: bar.update(),
                    )
                )
    if args.json:
        json.dump(to_json(comparisons), sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        for c in comparisons:
            for policy in args.policies if args.details else args.policies[:1]:
                write_recurrences(c, policy, sys.stdout)
        write_summary(comparisons, sys.stdout)
    if args.plot:
        plot(comparisons, args.plot)
        print(f"plot written to {args.plot}", file=sys.stderr)
    return 0


def run_transfer(args: argparse.Namespace, workloads: list[Workload], etas: list[float]) -> int:
    """``--transfer``: per workload, eta and second GPU, lane B's excess over its oracle
    cold and transferred (the table of ``scripts/bench_transfer.py``), or the same as JSON."""
    results = replay_pairs(
        workloads, TILTS, etas=etas, seeds=[args.seed], recurrences=args.recurrences
    )
    if args.json:
        rows = [{**asdict(r), "cold_excess": r.cold_excess,
                 "transferred_excess": r.transferred_excess} for r in results]  # fmt: skip
        json.dump({"transfer": rows}, sys.stdout, indent=1)
        sys.stdout.write("\n")
        return 0
    print(
        f"Lane B after {args.recurrences} recurrences on lane A (the workload's own GPU), "
        "against lane B alone;\nexcess = cumulative cost / lane B's oracle size's - 1."
    )
    print(f"{'workload':<20} {'lane B':<16} {'eta':>5} {'move':>5} {'cold':>7} {'transfer':>9}")
    for r in results:
        print(
            f"{r.workload:<20} {r.tilt:<16} {r.eta_knob:>5} {r.optimum_move:>+5d} "
            f"{r.cold_excess:>7.3f} {r.transferred_excess:>9.3f}"
        )
    return 0


def run_growth(args: argparse.Namespace, workloads: list[Workload], etas: list[float]) -> int:
    """``--growth``: a table per workload, eta and schedule, or the same as JSON."""
    comparisons = [
        compare_growth(workload, growth, eta)
        for workload in workloads
        for eta in etas
        for growth in args.growth
    ]
    if args.json:
        json.dump({"growth": [c.to_dict() for c in comparisons]}, sys.stdout, indent=1)
        sys.stdout.write("\n")
        return 0
    print(
        "Online batch growth against fixed sizes: expected cost to the target per start size,\n"
        "under the progress-fraction model (e epochs at a size that needs E epochs do e/E of\n"
        "the work; bso/replay/growth.py).  Cost in MJ; inf: some recorded run misses the target."
    )
    for c in comparisons:
        write_growth(c, sys.stdout)
    return 0


def write_growth(c: GrowthComparison, out: TextIO) -> None:
    """Per start size: fixed and grown cost, then whether growth beats the best fixed size."""
    g = c.growth
    cap = f", to at most {g.max_batch_size}" if g.max_batch_size is not None else ""
    out.write(
        f"\n== {c.workload} (eta={c.eta_knob}) growth every {g.every_epochs} epochs "
        f"by up to {g.factor:g}x{cap}\n"
    )
    out.write(
        f"{'start':>6} {'fixed MJ':>10} {'grown MJ':>10} {'ratio':>7} {'reaches':>9} "
        f"{'epochs':>7}  sizes\n"
    )
    for r in c.rows:
        epochs = "-" if r.run.epochs is None else f"{r.run.epochs:.2f}"
        out.write(
            f"{r.start:>6} {_mj(r.fixed_cost):>10} {_mj(r.grown_cost):>10} "
            f"{_ratio_text(r.ratio):>7} {r.run.reaches:>9} {epochs:>7}  "
            f"{'>'.join(str(b) for b in r.run.sizes)}\n"
        )
    verdict = "pays" if c.pays else "does not pay"
    grown = (
        f"best grown {_mj(c.best_grown_cost)} MJ (start {c.best_start})"
        if math.isfinite(c.best_grown_cost)
        else "no start always reaches the target"
    )
    out.write(
        f"{c.workload}: growth {verdict}: {grown} vs best fixed {_mj(c.best_fixed_cost)} MJ "
        f"(size {c.best_fixed}) (ratio {_ratio_text(c.ratio)})\n"
    )


def _mj(cost: float) -> str:
    return f"{cost / 1e6:.5g}" if math.isfinite(cost) else "inf"


def _ratio_text(ratio: float) -> str:
    return f"{ratio:.3f}" if math.isfinite(ratio) else ("-" if math.isnan(ratio) else "inf")
