"""Is bso's confidence a measured probability?  Reliability of ``bso status``'s
confidence on replays.

For every recurrence of every replay (the bso policy, as ``bso simulate`` runs
it), the confidence of the recommendation after it is recorded with whether the
recommendation is right: its expected cost, over all recorded runs, is within
the confidence's tolerance (``bso.core.confidence.TOLERANCE``, 1%) of the
oracle's.  Per trace set it prints a 10-bin reliability table,
the expected calibration error (ECE: the bins' |hit rate - mean confidence|
weighted by their share) and how often a recommendation given at 99 or more
misses.

    .venv/bin/python scripts/bench_calibration.py --traces ../shared/traces

Held out (nothing in the model was chosen on these): other replay seeds, other
draws of the landscapes, e.g.

    .venv/bin/python scripts/bench_calibration.py --seeds 4,5,6 --landscape-seed 12
    .venv/bin/python scripts/bench_calibration.py --no-traces --landscape-seed 13

and landscape kinds added after the model was frozen
(``bso.replay.landscapes.HELD_OUT_SHAPES``), and those written after it changed
again (``SECOND_HELD_OUT_SHAPES``):

    .venv/bin/python scripts/bench_calibration.py --no-traces --held-out-kinds
    .venv/bin/python scripts/bench_calibration.py --no-traces --second-held-out-kinds
"""

from __future__ import annotations

import argparse
import random
import re
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

from bso.core import confidence
from bso.replay.landscapes import landscape_workloads
from bso.replay.simulate import make_world, replay_policy
from bso.replay.traces import load_trace_workloads
from bso.replay.workloads import Workload, synthetic_workloads

ROOT = Path(__file__).resolve().parent.parent
BINS = 10
BOOTSTRAP_SEED = 7


Sample = tuple[float, bool, int]
"""(confidence 0-1, recommendation within the tolerance of the cheapest, replay
it came from)."""


def samples(
    workloads: Iterable[Workload], etas: Sequence[float], seeds: Sequence[int], recurrences: int
) -> list[Sample]:
    """One sample per recurrence of every replay that has a recommendation by then."""
    found = []
    replay = 0
    for workload in workloads:
        for eta in etas:
            costs = {b: workload.expected_cost(b, eta) for b in workload.batch_sizes}
            cheapest = min(costs.values())
            for seed in seeds:
                world = make_world(workload, recurrences, seed)
                result = replay_policy(world, "bso", eta_knob=eta, beta_knob=2.0, seed=seed)
                replay += 1
                for rec in result.recurrences:
                    if rec.recommendation is None or rec.confidence is None:
                        continue
                    tolerance = confidence.TOLERANCE + 1e-9
                    hit = costs[rec.recommendation] <= cheapest * (1 + tolerance)
                    found.append((rec.confidence / 100, hit, replay))
    return found


def reliability(found: Sequence[Sample]) -> list[tuple[float, float, int, float, float]]:
    """Per non-empty bin of :data:`BINS`: (low, high, count, mean confidence, hit rate)."""
    rows = []
    for index in range(BINS):
        low, high = index / BINS, (index + 1) / BINS
        in_bin = [(c, h) for c, h, _ in found if low <= c < high or (high == 1 and c == 1)]
        if in_bin:
            mean = sum(c for c, _ in in_bin) / len(in_bin)
            rate = sum(h for _, h in in_bin) / len(in_bin)
            rows.append((low, high, len(in_bin), mean, rate))
    return rows


def ece(found: Sequence[Sample]) -> float:
    """Expected calibration error: the bins' |hit rate - mean confidence| by share."""
    return sum(
        count / len(found) * abs(rate - mean) for _, _, count, mean, rate in reliability(found)
    )


def ece_interval(found: Sequence[Sample], draws: int = 200) -> tuple[float, float]:
    """90% interval of the ECE over replays drawn with replacement.

    The recurrences of one replay are not independent (a recommendation and
    whether it is right persist for many recurrences), so the replay is the
    unit of resampling; the interval says how much of the ECE is luck of which
    worlds were drawn.
    """
    groups: dict[int, list[Sample]] = {}
    for sample in found:
        groups.setdefault(sample[2], []).append(sample)
    keys = sorted(groups)
    rng = random.Random(BOOTSTRAP_SEED)
    values = sorted(
        ece([s for k in rng.choices(keys, k=len(keys)) for s in groups[k]]) for _ in range(draws)
    )
    return values[int(0.05 * draws)], values[int(0.95 * draws) - 1]


def report(name: str, found: Sequence[Sample]) -> None:
    print(f"\n{name}: {len(found)} recommendations from {len({s[2] for s in found})} replays")
    print(f"{'confidence':>12} {'count':>6} {'mean conf':>9} {'hit rate':>8}")
    for low, high, count, mean, rate in reliability(found):
        print(f"{low:>5.1f}-{high:<5.1f} {count:>6} {mean:>9.3f} {rate:>8.3f}")
    sure = [h for c, h, _ in found if c >= 0.99]
    misses = (1 - sum(sure) / len(sure)) if sure else 0.0
    low, high = ece_interval(found)
    print(
        f"ECE {ece(found):.3f} (90% interval over replays {low:.3f}-{high:.3f}); "
        f"at >= 99: {len(sure)} recommendations, {misses:.1%} missed"
    )


def report_by_kind(
    workloads: Sequence[Workload], found: Sequence[Sample], per_workload: int
) -> None:
    """ECE and misses at >= 99 per kind of workload (its name less a trailing
    instance number): which kinds make the set's figures.  :func:`samples` numbers its
    replays from 1, ``per_workload`` (etas x seeds) to each workload in turn."""
    kinds = {
        index * per_workload + offset + 1: re.sub(r"-\d+$", "", workload.name)
        for index, workload in enumerate(workloads)
        for offset in range(per_workload)
    }
    for kind in dict.fromkeys(kinds.values()):
        mine = [sample for sample in found if kinds[sample[2]] == kind]
        if not mine:
            print(f"  {kind:<18} no recommendations")
            continue
        sure = [h for c, h, _ in mine if c >= 0.99]
        misses = f"{1 - sum(sure) / len(sure):.1%}" if sure else "n/a"
        print(
            f"  {kind:<18} {len(mine):>6} recommendations, ECE {ece(mine):.3f}; "
            f"at >= 99: {len(sure)}, {misses} missed"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", type=Path, default=ROOT.parent / "shared" / "traces")
    parser.add_argument("--gpu")
    parser.add_argument("--etas", default="0,0.25,0.5,1")
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--recurrences", type=int, default=50)
    parser.add_argument(
        "--landscape-seed", type=int, default=11, help="seed of the landscapes' draw"
    )
    parser.add_argument(
        "--tolerance",
        type=float,
        default=confidence.TOLERANCE,
        help="measure the confidence as defined with this tolerance (0: strictly the cheapest)",
    )
    parser.add_argument("--no-traces", action="store_true", help="only the landscapes")
    parser.add_argument("--no-landscapes", action="store_true", help="only the traces")
    parser.add_argument("--by-kind", action="store_true", help="also ECE and misses per kind")
    kinds = parser.add_mutually_exclusive_group()
    kinds.add_argument(
        "--held-out-kinds",
        dest="kinds",
        action="store_const",
        const="held-out",
        default="usual",
        help="the landscape kinds added after the model was frozen, instead of the usual ones",
    )
    kinds.add_argument(
        "--second-held-out-kinds",
        dest="kinds",
        action="store_const",
        const="second-held-out",
        help="the kinds written after the model changed again (SHAPE_DOUBT), instead",
    )
    args = parser.parse_args()
    if not 0 <= args.tolerance < 1:
        parser.error(f"--tolerance must be a fraction from 0 to below 1, got {args.tolerance}")
    confidence.TOLERANCE = args.tolerance  # the model and the hits, alike
    etas = [float(e) for e in args.etas.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    sets: dict[str, list[Workload]] = {}
    if not args.no_traces:
        sets["Zeus traces"] = load_trace_workloads(args.traces, args.gpu)
    if not args.no_landscapes:
        if args.kinds != "usual":
            name = f"{args.kinds} landscape kinds (landscape seed {args.landscape_seed})"
            sets[name] = landscape_workloads(seed=args.landscape_seed, kinds=args.kinds)
        else:
            name = f"synthetic landscapes (landscape seed {args.landscape_seed})"
            sets[name] = [*synthetic_workloads(), *landscape_workloads(seed=args.landscape_seed)]
    print(
        f"replay seeds {args.seeds}, etas {args.etas}, {args.recurrences} recurrences, "
        f"right within {args.tolerance:.1%} of the cheapest"
    )
    for name, workloads in sets.items():
        found = samples(workloads, etas, seeds, args.recurrences)
        report(name, found)
        if args.by_kind:
            report_by_kind(workloads, found, len(etas) * len(seeds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
