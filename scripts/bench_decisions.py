"""Cumulative cost over the oracle's, per trace workload: always-default, bso, Zeus.

Every policy replays the same pre-drawn world (see bso.replay.simulate).  The
walk-floor column is a clairvoyant walk from the default to the oracle, one
size per recurrence (bso.replay.simulate.walk_floor_schedule): a floor for any
policy that must find the oracle by trying neighbours, not a target.  Zeus's
own server-side optimizer (PyPI ``zeus`` 0.16.0) runs in a side venv
(``scripts/setup_zeus_venv.sh`` makes ``.venv-zeus``) through
``scripts/zeus_driver.py``; without that venv its column reads ``n/a``.

    .venv/bin/python scripts/bench_decisions.py --traces ../shared/traces
    .venv/bin/python scripts/bench_decisions.py --landscapes

``--budgets 0.01,0.02,0.05`` adds a column per exploration budget (bso replayed
with ``JobSpec.exploration_budget``), and the worst single world's cost over
always-default's under each: what the budget promises to bound (and the worst
workload, its worlds' costs summed: the mark of issue 25).  ``--transfer``
adds two: the workload replayed as a job's second GPU lane (every second GPU of
``bso.replay.lanes.TILTS``, after as many recurrences on its own), lane B's cost
over its oracle's learning from nothing (``B-cold``) and from lane A
(``B-transfer``); ``scripts/bench_transfer.py`` prints each pair.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bso.replay.landscapes import landscape_workloads
from bso.replay.lanes import TILTS, replay_pairs
from bso.replay.report import geometric_mean
from bso.replay.simulate import (
    budgeted_label,
    make_world,
    replay_fixed,
    replay_policy,
    replay_schedule,
    walk_floor_schedule,
)
from bso.replay.traces import load_trace_workloads
from bso.replay.workloads import Workload

ROOT = Path(__file__).resolve().parent.parent
ZEUS_PYTHON = ROOT / ".venv-zeus" / "bin" / "python"
ZEUS_DRIVER = ROOT / "scripts" / "zeus_driver.py"


def run_zeus(worlds: list[dict[str, Any]]) -> list[float] | None:
    """Total cost of each world under Zeus, or None when the side venv is missing.

    ``--fast`` makes the driver commit only the report Zeus stops on; the
    driver's own tests show it yields the same decisions as reporting every epoch.
    """
    if not ZEUS_PYTHON.exists():
        return None
    done = subprocess.run(
        [str(ZEUS_PYTHON), str(ZEUS_DRIVER), "--fast"],
        input=json.dumps(worlds),
        capture_output=True,
        text=True,
        check=True,
    )
    results = json.loads(done.stdout)
    refused = sum(int(result.get("zeus_errors", 0)) for result in results)
    if refused:
        # Zeus raises "no converged batch sizes" and the driver charges nothing
        # for those recurrences, which flatters Zeus; say so next to the table.
        print(
            f"note: Zeus refused {refused} recurrence(s); they cost nothing above", file=sys.stderr
        )
    return [sum(r["cost"] for r in result["recurrences"]) for result in results]


def lane_b_ratios(
    workloads: list[Workload], etas: list[float], seeds: list[int], recurrences: int
) -> dict[tuple[str, float], dict[str, float]]:
    """Per workload and eta, over every second GPU and seed: lane B's total cost
    over its oracle's, cold and transferred."""
    totals: dict[tuple[str, float], list[float]] = {}
    for r in replay_pairs(workloads, TILTS, etas=etas, seeds=seeds, recurrences=recurrences):
        oracle, cold, transferred = totals.setdefault((r.workload, r.eta_knob), [0.0] * 3)
        totals[(r.workload, r.eta_knob)] = [
            oracle + r.oracle,
            cold + r.cold,
            transferred + r.transferred,
        ]
    return {
        key: {"B-cold": cold / oracle, "B-transfer": transferred / oracle}
        for key, (oracle, cold, transferred) in totals.items()
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", type=Path, default=ROOT.parent / "shared" / "traces")
    parser.add_argument("--gpu")
    parser.add_argument("--etas", default="0,0.25,0.5,1")
    parser.add_argument("--seeds", default="1,2,3", help="worlds per configuration")
    parser.add_argument("--recurrences", type=int, default=50)
    parser.add_argument("--beta", type=float, default=2.0)
    parser.add_argument(
        "--budgets", default="", help="comma list of exploration budgets to replay bso with"
    )
    parser.add_argument(
        "--transfer", action="store_true", help="add lane B's cost cold and transferred"
    )
    parser.add_argument("--workloads", default="", help="comma list of workload names (all)")
    parser.add_argument(
        "--landscapes",
        action="store_true",
        help="replay the synthetic landscapes (bso/replay/landscapes.py) instead of the traces",
    )
    kinds = parser.add_mutually_exclusive_group()
    kinds.add_argument(
        "--held-out-kinds",
        dest="kinds",
        action="store_const",
        const="held-out",
        default="usual",
        help="with --landscapes: the kinds added after the confidence model was frozen",
    )
    kinds.add_argument(
        "--second-held-out-kinds",
        dest="kinds",
        action="store_const",
        const="second-held-out",
        help="with --landscapes: the kinds written after it changed again (SHAPE_DOUBT)",
    )
    args = parser.parse_args()
    etas = [float(e) for e in args.etas.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    budgets = [float(b) for b in args.budgets.split(",") if b.strip()]
    budget_columns = [budgeted_label(b) for b in budgets]
    worst_world: dict[str, tuple[float, str]] = dict.fromkeys(budget_columns, (0.0, ""))

    started = time.perf_counter()
    rows: list[tuple[str, float, dict[str, float]]] = []
    zeus_worlds: list[dict[str, Any]] = []
    workloads = (
        landscape_workloads(kinds=args.kinds)
        if args.landscapes
        else load_trace_workloads(args.traces, args.gpu)
    )
    if args.workloads:
        workloads = [w for w in workloads if w.name in args.workloads.split(",")]
    for workload in workloads:
        for eta in etas:
            totals = {
                "oracle": 0.0,
                "default": 0.0,
                "walk-floor": 0.0,
                "bso": 0.0,
                "zeus-baseline": 0.0,
                **dict.fromkeys(budget_columns, 0.0),
            }
            floor_schedule = walk_floor_schedule(workload, eta, args.recurrences)
            oracle_size, _ = workload.oracle(eta)
            for seed in seeds:
                world = make_world(workload, args.recurrences, seed)
                totals["oracle"] += replay_fixed(world, oracle_size, eta, "oracle").total_cost
                default_cost = replay_fixed(
                    world, workload.default_batch_size, eta, "default"
                ).total_cost
                totals["default"] += default_cost
                totals["walk-floor"] += replay_schedule(
                    world, floor_schedule, eta, "walk-floor"
                ).total_cost
                for policy, column in (("bso", "bso"), ("zeus", "zeus-baseline")):
                    totals[column] += replay_policy(
                        world, policy, eta_knob=eta, beta_knob=args.beta, seed=seed
                    ).total_cost
                for budget, column in zip(budgets, budget_columns, strict=True):
                    spent = replay_policy(
                        world,
                        "bso",
                        eta_knob=eta,
                        beta_knob=args.beta,
                        seed=seed,
                        exploration_budget=budget,
                    ).total_cost
                    totals[column] += spent
                    where = f"{workload.name} eta {eta} seed {seed}"
                    worst_world[column] = max(worst_world[column], (spent / default_cost, where))
                spec = workload.job_spec(
                    job_id=f"{workload.name}-{eta}-{seed}",
                    eta_knob=eta,
                    beta_knob=args.beta,
                    seed=seed,
                    policy="zeus",
                )
                zeus_worlds.append(world.to_json(spec))
            rows.append((workload.name, eta, totals))
    lane_b = lane_b_ratios(workloads, etas, seeds, args.recurrences) if args.transfer else {}
    ours = time.perf_counter() - started

    zeus_started = time.perf_counter()
    zeus_costs = run_zeus(zeus_worlds)
    zeus_seconds = time.perf_counter() - zeus_started
    per_config = len(seeds)

    transfer_columns = ["B-cold", "B-transfer"] if args.transfer else []
    columns = [
        "default", "walk-floor", "bso", *budget_columns, *transfer_columns,
        "zeus-baseline", "zeus-0.16.0",
    ]  # fmt: skip
    print(f"cumulative cost / oracle, {args.recurrences} recurrences, mean over seeds {seeds}")
    print(f"{'workload':<14} {'eta':>5} " + " ".join(f"{c:>13}" for c in columns) + "  bso/default")
    ratios: dict[str, list[float]] = {c: [] for c in columns}
    for index, (name, eta, totals) in enumerate(rows):
        own = ("default", "walk-floor", "bso", *budget_columns, "zeus-baseline")
        values = {c: totals[c] / totals["oracle"] for c in own}
        values.update(lane_b.get((name, eta), {}))
        if zeus_costs is not None:
            chunk = zeus_costs[index * per_config : (index + 1) * per_config]
            values["zeus-0.16.0"] = sum(chunk) / totals["oracle"]
        for c, v in values.items():
            ratios[c].append(v)
        cells = " ".join(f"{values[c]:>13.3f}" if c in values else f"{'n/a':>13}" for c in columns)
        print(f"{name:<14} {eta:>5} {cells}  {totals['bso'] / totals['default']:>11.3f}")
    means = " ".join(
        f"{geometric_mean(ratios[c]):>13.3f}" if ratios[c] else f"{'n/a':>13}" for c in columns
    )
    print(f"{'geomean':<14} {'':>5} {means}")
    worse = sum(1 for b, d in zip(ratios["bso"], ratios["default"], strict=True) if b > d * 1.01)
    print(f"configurations where bso is >1% worse than always-default: {worse} of {len(rows)}")
    for zeus in ("zeus-baseline", "zeus-0.16.0"):
        if ratios[zeus]:
            behind = sum(
                1 for b, z in zip(ratios["bso"], ratios[zeus], strict=True) if b > z * 1.01
            )
            print(f"configurations where bso is >1% worse than {zeus}: {behind} of {len(rows)}")
    for column in budget_columns:
        ratio, name, eta = max((t[column] / t["default"], name, eta) for name, eta, t in rows)
        print(f"{column}: worst workload {ratio:.3f}x always-default's cost ({name} eta {eta})")
        ratio, where = worst_world[column]
        print(f"{column}: worst world {ratio:.3f}x always-default's cost ({where})")
    if zeus_costs is None:
        print("zeus-0.16.0: n/a (run scripts/setup_zeus_venv.sh to create .venv-zeus)")
    print(f"replay time: ours {ours:.1f} s, zeus {zeus_seconds:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
