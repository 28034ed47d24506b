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
    for policy in policies:
        if policy.startswith("bso@"):  # replayed with an exploration budget
            worst = max(comparisons, key=lambda c: c.ratio(policy, "default"))
            out.write(
                f"{policy}: at most {worst.ratio(policy, 'default'):.3f}x always-default's cost "
                f"({worst.workload}, eta {worst.eta_knob})\n"
            )


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


PLOT_COLUMNS = 3
"""Comparisons side by side in ``bso simulate --plot``; more go on further rows.
Three panels of 4.5 inches at 110 dpi make an image 1,485 pixels wide, which a
screen or a page shows at full size (one row of 12 was 5,940 pixels)."""


def plot_grid(panels: int, columns: int = PLOT_COLUMNS) -> tuple[int, int]:
    """Rows and columns of panels for ``panels`` comparisons: at most ``columns``
    side by side, as many rows as that takes."""
    used = max(1, min(panels, columns))
    return math.ceil(max(panels, 1) / used), used


def plot(comparisons: Sequence[Comparison], path: Path) -> None:
    """One panel per comparison, in a grid of at most :data:`PLOT_COLUMNS` columns:
    cost per recurrence above, the size that finished each recurrence below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, columns = plot_grid(len(comparisons))
    fig, axes = plt.subplots(
        2 * rows,
        columns,
        figsize=(4.5 * columns, 5.5 * rows),
        squeeze=False,
        gridspec_kw={"height_ratios": [3, 2] * rows},
    )
    for index, c in enumerate(comparisons):
        row, column = divmod(index, columns)
        cost_ax, size_ax = axes[2 * row][column], axes[2 * row + 1][column]
        size_ax.sharex(cost_ax)
        for policy, result in c.results.items():
            x = [r.index + 1 for r in result.recurrences]
            cost_ax.plot(x, [r.cost / 1e6 for r in result.recurrences], label=policy, lw=1)
            sizes = [r.sizes[-1] if r.sizes else math.nan for r in result.recurrences]
            size_ax.step(x, sizes, where="mid", label=policy, lw=1)
        cost_ax.set_title(f"{c.workload} (eta={c.eta_knob})", fontsize=9)
        cost_ax.set_ylabel("cost per recurrence (MJ)", fontsize=8)
        cost_ax.tick_params(labelbottom=False, labelsize=7)
        size_ax.set_yscale("log", base=2)
        size_ax.set_ylabel("batch size", fontsize=8)
        size_ax.set_xlabel("recurrence", fontsize=8)
        size_ax.tick_params(labelsize=7)
    for index in range(len(comparisons), rows * columns):  # the last row's empty places
        row, column = divmod(index, columns)
        axes[2 * row][column].set_visible(False)
        axes[2 * row + 1][column].set_visible(False)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
