"""Lane transfer: a job's second lane, started from its first, against a cold start.

Every workload is paired with every second GPU of ``bso.replay.lanes.TILTS``
(epoch time and power tilted per doubling of the batch; the same epochs to
target), replayed ``--recurrences`` times on its own GPU and then as many times
on the other, in one job.  Printed per pair: how far the oracle moved, lane B's
excess cost over its oracle size cold (a job of its own) and transferred, and
their ratio; then the geometric means, the worst world, and the worst pair (a
workload on one second GPU at one eta, its worlds' costs summed over the seeds:
a single world's ratio is mostly the luck of which recurrences drew which epochs).

    .venv/bin/python scripts/bench_transfer.py --traces ../shared/traces
    .venv/bin/python scripts/bench_transfer.py --landscapes
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from bso.replay.landscapes import landscape_workloads
from bso.replay.lanes import TILTS, replay_pairs
from bso.replay.report import geometric_mean
from bso.replay.traces import load_trace_workloads

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", type=Path, default=ROOT.parent / "shared" / "traces")
    parser.add_argument("--landscapes", action="store_true", help="the synthetic landscapes")
    parser.add_argument("--workloads", default="", help="comma list of workload names")
    parser.add_argument("--etas", default="0.5")
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--recurrences", type=int, default=50)
    args = parser.parse_args()
    workloads = landscape_workloads() if args.landscapes else load_trace_workloads(args.traces)
    if args.workloads:
        workloads = [w for w in workloads if w.name in args.workloads.split(",")]
    started = time.perf_counter()
    results = replay_pairs(
        workloads,
        TILTS,
        etas=[float(e) for e in args.etas.split(",")],
        seeds=[int(s) for s in args.seeds.split(",")],
        recurrences=args.recurrences,
    )
    print(f"lane B after {args.recurrences} recurrences on lane A; excess = cost / oracle - 1")
    print(f"{'workload':<20} {'lane B':<16} {'eta':>5} {'move':>5} {'cold':>7} "
          f"{'transfer':>9} {'B cost':>7}")  # fmt: skip
    for r in results:
        print(
            f"{r.workload:<20} {r.tilt:<16} {r.eta_knob:>5} {r.optimum_move:>+5d} "
            f"{r.cold_excess:>7.3f} {r.transferred_excess:>9.3f} {r.transferred / r.cold:>7.3f}"
        )
    cold = geometric_mean([r.cold / r.oracle for r in results]) - 1
    moved = geometric_mean([r.transferred / r.oracle for r in results]) - 1
    worst = max(results, key=lambda r: r.transferred / r.cold)
    print(
        f"geometric mean excess: cold {cold:.4f}, transferred {moved:.4f} "
        f"(transferred / cold: {moved / cold:.2f})"
    )
    print(
        f"worst world: transferred costs {worst.transferred / worst.cold:.3f}x cold "
        f"({worst.workload} -> {worst.tilt}, eta {worst.eta_knob})"
    )
    pairs: dict[tuple[str, str, float], tuple[float, float]] = {}
    for r in results:
        cold_sum, moved_sum = pairs.get((r.workload, r.tilt, r.eta_knob), (0.0, 0.0))
        pairs[(r.workload, r.tilt, r.eta_knob)] = (cold_sum + r.cold, moved_sum + r.transferred)
    ratio, (workload, tilt, eta) = max((m / c, key) for key, (c, m) in pairs.items())
    over = sum(1 for c, m in pairs.values() if m > 1.01 * c)
    print(
        f"worst pair (its worlds summed): transferred costs {ratio:.3f}x cold "
        f"({workload} -> {tilt}, eta {eta}); pairs over 1.01x: {over} of {len(pairs)}"
    )
    print(f"replay time {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
