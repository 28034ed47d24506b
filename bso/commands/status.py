"""``bso status [JOB] [--json] [--plot FILE]``: what a job learned, per hardware lane.

Two sources:

* a live service (default): the client URL and API key from ``--broker-url`` /
  ``--api-key``, else ``$BSO_BROKER_URL`` / ``$BSO_API_KEY``, else ``bso up``'s
  ``--data-dir`` credentials.  Only the key's own tenant's jobs can be read, and
  a job must be named (the service has no "list my jobs" query);
* a database (``--database-url``): every job, any tenant, another tenant's job
  named ``<tenant>/<job id>`` (:func:`bso.apikeys.job_key`); whoever holds the
  database credentials can read it all anyway.

The text output gives, for each job and lane, the ``bso-status`` line the
client logs after each recurrence (:func:`bso.status.summary_line`), then the
outcomes and mean cost of each batch size.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path

from bso.apikeys import DEFAULT_TENANT, JOB_KEY_SEPARATOR, job_key, split_job_key
from bso.commands import live
from bso.commands.arguments import job_or_tenant_job
from bso.commands.failures import UserError
from bso.commands.plot_path import checked_plot_path
from bso.core.micro_batch import STOP_CONFIDENCE
from bso.service import BsoService
from bso.spec import listed
from bso.status import (
    BudgetStatus,
    JobStatus,
    LaneStatus,
    MicroBatchStatus,
    StartStatus,
    started_from_text,
    summary_line,
)
from bso.storage.sql import SqlStore
from bso.wire.connection import redact_url
from bso_client.energy.time_only import TIME_ONLY_MODEL

OUTCOME_COLUMNS = (
    "converged",
    "stopped",
    "failed",
    "out_of_memory",
    "interrupted",
    "script_error",
    "running",
)


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "job",
        nargs="?",
        type=job_or_tenant_job,
        help="job id (every job of the database when omitted; with --database-url, "
        "another tenant's job is <tenant>/<job id>)",
    )
    parser.add_argument(
        "--database-url", help="read this database instead of asking the live service"
    )
    live.add_service_arguments(parser)
    live.add_api_key_argument(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    parser.add_argument("--plot", type=Path, help="write cost per batch size over trials to a PNG")


def run(args: argparse.Namespace) -> int:
    if args.plot is not None:
        checked_plot_path(args.plot)
    statuses = read_from_database(args) if args.database_url else read_live(args)
    if args.json:
        print(json.dumps([s.model_dump(mode="json") for s in statuses], indent=1))
    else:
        for status in statuses:
            print(describe(status))
        if not statuses:  # a database that no job ever used: said, not a blank answer
            print(f"no jobs in {redact_url(args.database_url)}")
    if args.plot:
        plot(statuses, args.plot)
        print(f"plot written to {args.plot}", file=sys.stderr)
    return 0


def read_from_database(args: argparse.Namespace) -> list[JobStatus]:
    store = SqlStore(args.database_url)
    try:
        service = BsoService(store)
        every = store.job_ids()
        wanted = [job_key(*split_job_key(args.job))] if args.job else every  # default/J is J
        if args.job and (key := wanted[0]) not in every:
            namesakes = [k for k in every if split_job_key(k)[1] == key]
            hint = (
                f"other tenants' jobs of that id: {', '.join(namesakes)}"
                if namesakes
                else "without one, bso status lists every job of the database"
            )
            raise UserError(
                f"job {key!r} is not in {redact_url(args.database_url)}; check the job id "
                f"(another tenant's job is <tenant>/<job id>; {hint})"
            )
        statuses = []
        for key in wanted:
            tenant, job_id = split_job_key(key)
            statuses.append(service.status(job_id, tenant))
        return statuses
    finally:
        store.close()


def read_live(args: argparse.Namespace) -> list[JobStatus]:
    if not args.job:
        raise UserError(
            "name a job: a live service answers for one job at a time (--database-url "
            "reads every job)"
        )
    if JOB_KEY_SEPARATOR in args.job:
        raise UserError(
            f"{args.job!r} names a job with its tenant, which only --database-url reads: "
            "a team's key reads its own jobs, named by their id alone"
        )
    with live.connect(args) as client:
        return [client.status(args.job)]


def describe(status: JobStatus) -> str:
    """The summary line and a per-size table for each lane of ``status``."""
    owner = f" tenant={status.tenant}" if status.tenant else ""
    if not status.lanes:
        return f"bso-status job={status.job_id}{owner} (no trials yet)"
    blocks = []
    for lane in status.lanes:
        rows = [summary_line(status.job_id, lane) + owner, _size_table(lane)]
        if why := why_not_the_cheapest_mean(lane):
            rows.append(why)
        if lane.batch_sizes:
            rows.append(
                f"  candidates {listed(lane.batch_sizes)}, default {lane.default_batch_size}"
            )
        if lane.started_from is not None:
            rows.append(start_line(lane.started_from, lane.default_batch_size))
        if lane.exploration_budget is not None:
            rows.append(budget_line(lane.exploration_budget))
        rows.extend(micro_batch_line(choice) for choice in lane.micro_batches)
        if lane.detached_trials:
            rows.append(
                f"  {lane.detached_trials} detached run(s): trained while the service was "
                "unreachable, delivered from the client's journal afterwards"
            )
        if lane.memory_limit is not None:
            rows.append(f"  out of memory from batch size {lane.memory_limit} up (until re-probed)")
        if lane.stuck is not None:
            rows.append(f"  stuck: the next run gets NoFeasibleBatchSize: {lane.stuck}")
        blocks.append("\n".join(rows))
    return "\n".join(blocks)


def start_line(start: StartStatus, default: int | None) -> str:
    """What the lane's first run was taken from (bso/core/transfer.py)."""
    return f"  {started_from_text(start, default)}"


def micro_batch_line(choice: MicroBatchStatus) -> str:
    """The micro-batch runs at one global batch settled on (bso/core/micro_batch.py)."""
    settled = (
        "; later runs skip the exploration" if choice.confidence >= STOP_CONFIDENCE * 100 else ""
    )
    return (
        f"  micro-batch at batch size {choice.batch_size}: {choice.micro_batch_size} per pass "
        f"(confidence {choice.confidence}, {choice.timed_steps} steps timed over "
        f"{choice.runs} run(s)){settled}"
    )


def budget_line(ledger: BudgetStatus) -> str:
    """The exploration budget, used and left, in runs of the default size."""
    used = ledger.used_runs
    spent = (
        f"used {used:.2f} default runs" if used >= 0 else f"{-used:.2f} default runs saved so far"
    )
    return (
        f"  exploration budget {ledger.budget:g} of always-default's cost "
        f"({ledger.baseline_batch_size}, {ledger.baseline_cost:.4g} a run): {spent} over "
        f"{ledger.recurrences} recurrence(s), {max(ledger.left_runs, 0.0):.2f} left"
    )


def why_not_the_cheapest_mean(lane: LaneStatus) -> str | None:
    """One line when the recommendation is not the size with the lowest mean cost so
    far (the table's figures), saying why that is no contradiction; else None."""
    means = {s.batch_size: s.mean_cost for s in lane.sizes if s.mean_cost is not None}
    if lane.recommended_batch_size is None or not means:
        return None
    cheapest = min(means, key=lambda size: means[size])
    if cheapest == lane.recommended_batch_size:
        return None
    return (
        f"  recommended {lane.recommended_batch_size}, not {cheapest} (lowest mean so far): the "
        "recommendation and its gain come from a model of cost over all sizes and runs "
        "(few runs, stopped runs as lower bounds), not from these means; docs/client.md, "
        '"Reading bso status"'
    )


def _size_table(lane: LaneStatus) -> str:
    widths = [max(len(c), 5) for c in OUTCOME_COLUMNS]
    header = f"  {'size':>8} {'trials':>6} " + " ".join(
        f"{c:>{w}}" for c, w in zip(OUTCOME_COLUMNS, widths, strict=True)
    )
    lines = [header + f" {'mean cost':>12} {'P(best)':>7}"]
    for size in lane.sizes:
        counts = " ".join(
            f"{size.outcomes.get(c, 0):>{w}}" for c, w in zip(OUTCOME_COLUMNS, widths, strict=True)
        )
        cost = f"{cost_text(size.mean_cost) if size.mean_cost is not None else '-':>12}"
        chance = (
            f"{size.probability_best:>7.2f}" if size.probability_best is not None else f"{'-':>7}"
        )
        lines.append(f"  {size.batch_size:>8} {size.trials:>6} {counts} {cost} {chance}")
    return "\n".join(lines)


def cost_text(cost: float) -> str:
    """A cost as a person reads it: four significant digits below 10,000, whole numbers
    with thousands separators from there (``.4g`` turned to ``1.076e+04`` mid-column,
    for a job whose costs are joules of a run of hours)."""
    return f"{cost:.4g}" if abs(cost) < 10_000 else f"{cost:,.0f}"


SIZES_DOING = ("stopped", "failed", "out_of_memory")
"""Outcomes of runs that ended short of the target through the size: bso's stops, failures."""
SPREAD_FOR_LOG_SCALE = 10.0
"""The cost axis is logarithmic once the dearest run costs this many times the cheapest."""
NOT_THE_SIZES = ("interrupted", "script_error")
"""Outcomes of runs that ended short through no doing of the size (not learnt from)."""


def plot(statuses: Sequence[JobStatus], path: Path) -> None:
    """Per lane: each trial's cost by batch size, each size's running mean of its
    converged costs with a band of one standard error, and the recommendation.

    Every mark has a legend entry: a converged run is a dot at its cost; a run
    that bso stopped or that failed (the size's doing) is a cross at what it had
    cost when it ended, a lower bound of its full cost, so a cross low on the plot
    is not a cheap run; one that was interrupted or ended by the script (not the
    size's doing, and not learnt from) is a plus, likewise; a run that trained
    detached (the service was unreachable; delivered later) is ringed.  Trials
    are counted in whole numbers.  The axis names what the cost was computed
    from: with no energy measured, it is the max power times the time.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    # A job as its tenant knows it, with the tenant when it is not the default one
    # (job ids are per tenant: two teams' nightly are two plots).
    lanes = [
        (job_key(s.tenant or DEFAULT_TENANT, s.job_id), lane) for s in statuses for lane in s.lanes
    ]
    fig, axes = plt.subplots(
        max(1, len(lanes)), 1, figsize=(9, 3.6 * max(1, len(lanes))), squeeze=False
    )
    for (job_id, lane), row in zip(lanes, axes, strict=False):
        ax = row[0]
        handles: list[Line2D | Patch] = []
        for size in sorted({p.batch_size for p in lane.history}):
            points = [p for p in lane.history if p.batch_size == size]
            done = [p for p in points if p.outcome == "converged"]
            line = ax.plot([p.trial_number for p in done], [p.cost for p in done], "o", ms=3)
            color = line[0].get_color()
            for marker, outcomes in (("x", SIZES_DOING), ("+", NOT_THE_SIZES)):
                ended = [p for p in points if p.outcome in outcomes]
                ax.plot(
                    [p.trial_number for p in ended], [p.cost for p in ended], marker, color=color
                )
            away = [p for p in points if p.detached]
            ax.plot([p.trial_number for p in away], [p.cost for p in away], "o", mfc="none", ms=8,
                    color=color)  # fmt: skip
            x, mean, err = _running_mean([p.trial_number for p in done], [p.cost for p in done])
            ax.plot(x, mean, "-", color=color, lw=1)
            ax.fill_between(
                x,
                [m - e for m, e in zip(mean, err, strict=True)],
                [m + e for m, e in zip(mean, err, strict=True)],
                color=color,
                alpha=0.2,
            )
            handles.append(Line2D([], [], color=color, marker="o", ms=3, label=f"batch {size}"))
        grey = "0.35"
        handles += [
            Line2D([], [], color=grey, marker="o", ls="", ms=3, label="converged run: its cost"),
            Line2D([], [], color=grey, marker="x", ls="", label="stopped/failed run: cost so far"),
            Line2D(
                [],
                [],
                color=grey,
                marker="+",
                ls="",
                label="interrupted or script error (not the size's): cost so far",
            ),
            Line2D(
                [],
                [],
                color=grey,
                marker="o",
                mfc="none",
                ms=8,
                ls="",
                label="ran detached (delivered later)",
            ),
            Line2D([], [], color=grey, lw=1, label="mean of converged runs"),
            Patch(color=grey, alpha=0.2, label="± 1 standard error of that mean"),
        ]
        if lane.recommended_batch_size is not None and lane.expected_cost is not None:
            ax.axhline(lane.expected_cost, color="black", ls="--", lw=1)
            handles.append(
                Line2D(
                    [], [], color="black", ls="--", lw=1,
                    label=f"recommended {lane.recommended_batch_size}: expected cost "
                    f"(confidence {lane.confidence}%)",
                )
            )  # fmt: skip
        ax.set_title(f"{job_id} on {lane.hardware.key}", fontsize=9)
        ax.set_xlabel("trial")
        # min_n_ticks=1: a lane of one trial spans less than one trial, where the
        # locator would otherwise fall back to ticks such as 0.96 and 1.035.
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
        costs = [p.cost for p in lane.history if p.cost > 0]
        if costs and max(costs) > SPREAD_FOR_LOG_SCALE * min(costs):
            ax.set_yscale("log")  # one slow run would flatten every other on a linear axis
        ax.set_ylabel(cost_axis_label(lane))
        ax.legend(handles=handles, fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cost_axis_label(lane: LaneStatus) -> str:
    """What the cost was computed from on ``lane``: energy, or time alone."""
    if lane.hardware.gpu_model == TIME_ONLY_MODEL:
        return "cost (J-equivalent)\nmax power x time: no energy measured"
    return "cost (J)\nfrom measured energy and time"


def _running_mean(x: list[int], y: list[float]) -> tuple[list[int], list[float], list[float]]:
    """Mean of the first k values and its standard error, for each k."""
    means, errors = [], []
    for k in range(1, len(y) + 1):
        head = y[:k]
        mean = sum(head) / k
        spread = math.sqrt(sum((v - mean) ** 2 for v in head) / (k - 1)) if k > 1 else 0.0
        means.append(mean)
        errors.append(spread / math.sqrt(k))
    return x, means, errors
