"""How a trial ended, whose fault that was, and what bso learns from it.

Every finished trial has one :class:`Outcome`, derived from its status and stop
reason.  The effect of each on learning is written once, here, in
:func:`learning_view`, which turns the stored trials of a lane into the trials
the policies decide from:

========================  ====================================================
outcome                   effect on learning
========================  ====================================================
converged                 a measurement of the size's cost
stopped (by bso)          censored: the size needed more than the run had
                          (``cost_bound``, ``projected_cost``); the policy may
                          revisit the size when new evidence says it could win
failed                    the size's fault (``max_epochs``, a crash, a
                          diverged metric): counts against the size; two in a
                          row drop it
out_of_memory             the size and every larger one are not candidates on
                          this hardware until the caller re-probes memory
                          (``NextTrial.reprobe_memory``)
interrupted               not the size's fault (SIGTERM, preemption, cancel, a
                          vanished client): ignored, and the size gets the next
                          trial again; its partial cost is shown, never used.
                          Only :data:`MAX_INTERRUPTIONS` interruptions of one
                          size in a row count as one failure, so a size whose
                          runs always die (the host's OOM killer) is not
                          retried forever.
========================  ====================================================
"""

from __future__ import annotations

import dataclasses
from enum import StrEnum

from bso.core.state import JobSnapshot, TrialSnapshot
from bso.core.vocabulary import StopReason, TrialPhase, TrialStatus

MAX_INTERRUPTIONS = 3
"""Interruptions of one size in a row (no finished run between) that count as a failure."""

CENSORING_REASONS = frozenset({StopReason.PROJECTED_COST, StopReason.COST_BOUND})
"""Stops by bso's cost rules: the run says "more than this", not "infeasible"."""


class Outcome(StrEnum):
    RUNNING = "running"
    CONVERGED = "converged"
    STOPPED = "stopped"
    """Stopped by bso (cost bound or projection)."""
    FAILED = "failed"
    """Failed or diverged: the size's fault."""
    OUT_OF_MEMORY = "out_of_memory"
    INTERRUPTED = "interrupted"


def outcome_of(trial: TrialSnapshot) -> Outcome:
    if trial.running:
        return Outcome.RUNNING
    if trial.converged:
        return Outcome.CONVERGED
    if trial.interrupted:
        return Outcome.INTERRUPTED
    if trial.stop_reason is StopReason.OUT_OF_MEMORY:
        return Outcome.OUT_OF_MEMORY
    if trial.stop_reason in CENSORING_REASONS:
        return Outcome.STOPPED
    return Outcome.FAILED


def memory_limit(trials: tuple[TrialSnapshot, ...], reprobed_through: int = 0) -> int | None:
    """Smallest size that ran out of memory after the last re-probe (trial numbers
    up to ``reprobed_through`` are forgotten), or None.  A trial that grew online ran
    out of memory at the size it had grown to, not at the one it started at."""
    sizes = [
        t.largest_size_run for t in trials if t.out_of_memory and t.trial_number > reprobed_through
    ]
    return min(sizes) if sizes else None


def learning_view(snapshot: JobSnapshot) -> JobSnapshot:
    """The lane as the policies see it; see the module docstring for each outcome."""
    limit = memory_limit(snapshot.trials, snapshot.memory_reprobed_through)
    if snapshot.memory_limit is not None:
        limit = snapshot.memory_limit if limit is None else min(limit, snapshot.memory_limit)
    kept: list[TrialSnapshot] = []
    interruptions: dict[int, int] = {}
    for trial in snapshot.trials:
        if limit is not None and trial.batch_size >= limit:
            continue
        if trial.out_of_memory:  # re-probed since: the size is a candidate again
            continue
        if trial.interrupted:
            count = interruptions.get(trial.batch_size, 0) + 1
            interruptions[trial.batch_size] = count % MAX_INTERRUPTIONS
            if count == MAX_INTERRUPTIONS:
                kept.append(
                    dataclasses.replace(
                        trial, status=TrialStatus.FAILED, stop_reason=StopReason.ABANDONED
                    )
                )
            continue
        if not trial.running:
            interruptions[trial.batch_size] = 0
        kept.append(trial)
    return dataclasses.replace(snapshot, trials=tuple(kept), memory_limit=limit)


def interrupted_retry(snapshot: JobSnapshot, view: JobSnapshot) -> tuple[int, TrialPhase] | None:
    """The size (and phase) of the lane's latest finished trial when it was
    interrupted and still counts as such: it gets the next trial again."""
    finished = [t for t in snapshot.trials if not t.running]
    if not finished or not finished[-1].interrupted:
        return None
    last = finished[-1]
    if last.batch_size not in view.candidate_sizes:
        return None
    counted_as_failure = any(t.trial_number == last.trial_number and t.failed for t in view.trials)
    if counted_as_failure:
        return None
    return last.batch_size, last.phase
