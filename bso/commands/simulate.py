"""``bso simulate``: replay recurring jobs in-process, bso against always-default and Zeus.

Needs only the core (no Redis, no Celery, no database): every policy replays
the same pre-drawn world (:mod:`bso.replay.simulate`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import cast

from tqdm import tqdm

from bso.replay.report import plot, to_json, write_recurrences, write_summary
from bso.replay.simulate import LEARNING_POLICIES, Comparison, compare
from bso.replay.traces import TraceError, load_trace_workloads
from bso.replay.workloads import Workload, synthetic_workloads
from bso.spec import PolicyName


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


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"not a finite number: {text!r}")
    return value


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
        "--recurrences", type=_positive, default=50, help="recurrences of each job to replay"
    )
    parser.add_argument("--seed", type=int, default=1, help="seed of the world and the bandit")
    parser.add_argument(
        "--policies",
        type=_policies,
        default=list(LEARNING_POLICIES),
        help=f"comma list of learning policies to replay (default: {','.join(LEARNING_POLICIES)})",
    )
    parser.add_argument(
        "--details", action="store_true", help="per-recurrence table of every policy"
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument("--plot", type=Path, help="write cost and size per recurrence to this PNG")


def select_workloads(args: argparse.Namespace) -> list[Workload]:
    workloads = (
        load_trace_workloads(args.traces, args.gpu) if args.traces else synthetic_workloads()
    )
    if args.workload:
        known = {w.name for w in workloads}
        missing = sorted(set(args.workload) - known)
        if missing:
            raise TraceError(f"unknown workload(s) {missing}; have {sorted(known)}")
        workloads = [w for w in workloads if w.name in args.workload]
    return workloads


def run(args: argparse.Namespace) -> int:
    try:
        workloads = select_workloads(args)
    except TraceError as exc:
        print(f"bso simulate: {exc}", file=sys.stderr)
        return 2
    etas = args.eta or [0.5]
    total = len(workloads) * len(etas) * len(args.policies) * args.recurrences
    comparisons: list[Comparison] = []
    with tqdm(total=total, desc="replaying", unit="rec", file=sys.stderr, disable=None) as bar:
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
