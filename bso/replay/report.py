"""Text, JSON and plot output of ``bso simulate``."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from bso.replay.simulate import Comparison

BASELINES = ("oracle", "default")


def geometric_mean(values: Sequence[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else math.nan


def learning_policies(comparison: Comparison) -> list[str]:
    return [p for p in comparison.results if p not in BASELINES]


def write_recurrences(comparison: Comparison, policy: str, out: TextIO) -> None:
    """Per-recurrence table of one policy, with running totals against the baselines."""
    result = comparison.results[policy]
    oracle = comparison.results["oracle"].recurrences
    default = comparison.results["default"].recurrences
    out.write(
        f"\n== {comparison.workload} (eta={comparison.eta_knob}) policy={policy}  "
        f"oracle size={comparison.oracle_batch_size}\n"
    )
    out.write(
        f"{'rec':>4} {'sizes tried':<22} {'tries':>5} {'time h':>9} {'energy MJ':>10} "
        f"{'cost MJ':>9} {'cum/oracle':>10} {'cum/default':>11} {'recommend (conf)':>17}\n"
    )
    total = total_oracle = total_default = 0.0
    for rec, o, d in zip(result.recurrences, oracle, default, strict=True):
        total += rec.cost
        total_oracle += o.cost
        total_default += d.cost
        sizes = ",".join(str(b) for b in rec.sizes) + ("" if rec.converged else " (failed)")
        recommend = (
            f"{rec.recommendation} ({rec.confidence})"
            if rec.recommendation is not None and rec.confidence is not None
            else "-"
        )
        out.write(
            f"{rec.index + 1:>4} {sizes:<22} {rec.tries:>5} {rec.time_s / 3600:>9.2f} "
            f"{rec.energy_j / 1e6:>10.3f} {rec.cost / 1e6:>9.3f} {total / total_oracle:>10.3f} "
            f"{total / total_default:>11.3f} {recommend:>17}\n"
        )


def write_summary(comparisons: Sequence[Comparison], out: TextIO) -> None:
    """One line per workload: cumulative cost over the oracle's, per policy."""
    if not comparisons:
        return
    policies = ["default", *learning_policies(comparisons[0])]
    out.write("\nCumulative cost / oracle's (best fixed size in expectation, same world):\n")
    header = f"{'workload':<20} {'eta':>5} {'oracle bs':>9} " + " ".join(
        f"{p:>9}" for p in policies
    )
    out.write(header + "\n")
    for c in comparisons:
        ratios = " ".join(f"{c.ratio(p):>9.3f}" for p in policies)
        out.write(f"{c.workload:<20} {c.eta_knob:>5} {c.oracle_batch_size:>9} {ratios}\n")
    means = " ".join(f"{geometric_mean([c.ratio(p) for c in comparisons]):>9.3f}" for p in policies)
    out.write(f"{'geometric mean':<20} {'':>5} {'':>9} {means}\n")


def to_json(comparisons: Sequence[Comparison]) -> dict[str, Any]:
    policies = learning_policies(comparisons[0]) if comparisons else []
    return {
        "comparisons": [
            {
                "workload": c.workload,
                "eta_knob": c.eta_knob,
                "oracle_batch_size": c.oracle_batch_size,
                "ratio_to_oracle": {p: c.ratio(p) for p in c.results},
                "ratio_to_default": {p: c.ratio(p, "default") for p in c.results},
                "results": {p: r.to_dict() for p, r in c.results.items()},
            }
            for c in comparisons
        ],
        "geometric_mean_ratio_to_oracle": {
            p: geometric_mean([c.ratio(p) for c in comparisons]) for p in ["default", *policies]
        },
    }


def plot(comparisons: Sequence[Comparison], path: Path) -> None:
    """Cost per recurrence (top) and the size that finished each recurrence (bottom)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        2, len(comparisons), figsize=(4.5 * len(comparisons), 6.5), squeeze=False, sharex="col"
    )
    for column, c in enumerate(comparisons):
        cost_ax, size_ax = axes[0][column], axes[1][column]
        for policy, result in c.results.items():
            x = [r.index + 1 for r in result.recurrences]
            cost_ax.plot(x, [r.cost / 1e6 for r in result.recurrences], label=policy, lw=1)
            sizes = [r.sizes[-1] if r.sizes else math.nan for r in result.recurrences]
            size_ax.step(x, sizes, where="mid", label=policy, lw=1)
        cost_ax.set_title(f"{c.workload} (eta={c.eta_knob})", fontsize=9)
        cost_ax.set_ylabel("cost per recurrence (MJ)")
        size_ax.set_yscale("log", base=2)
        size_ax.set_ylabel("batch size")
        size_ax.set_xlabel("recurrence")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
