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
                          (``cost_bound``, ``projected_cost``,
                          ``exploration_budget``); the policy may
                          revisit the size when new evidence says it could win
failed                    the size's fault (``max_epochs``, a diverged
                          metric): counts against the size; two in a row
                          drop it.  But a metric that is NaN or infinite at
                          a run's first epoch report, in a lane where no
                          earlier run ever reported a number, says as much
                          of the script (an empty validation set, a division
                          by zero) as of the size: it counts like an
                          interruption (:func:`unproven_divergence`), so a
                          broken script's runs cannot rule out every size
out_of_memory             the size and every larger one are not candidates on
                          this hardware until the caller re-probes memory
                          (``NextTrial.reprobe_memory``)
interrupted               not the size's fault (SIGTERM, preemption, cancel, a
                          vanished client): ignored, and the size gets the next
                          trial again; its partial cost is shown, never used.
                          Only :data:`MAX_INTERRUPTIONS` interruptions of one
                          size in a row count as one failure, so a size whose
                          runs always die (the host's OOM killer) is not
                          retried forever.  A stop by a signal before the first
                          epoch (SIGTERM, Ctrl-C, a launcher tearing down the
                          job after another rank crashed) never counts: it
                          says nothing about the size.
script_error              the script raised (or bso's client refused a call
                          out of order or a metric it cannot read), or stopped
                          training short of the target on its own, before or
                          after its first epoch report (``abandoned``): a bug
                          in the script, not the size's fault.  Ignored like an
                          interruption, the size gets the next trial again (so
                          a fixed script runs the same size), and it never
                          counts toward :data:`MAX_INTERRUPTIONS`.  Only what
                          the size itself did rules it out: its metric (a
                          divergence, ``max_epochs``), its cost, its memory
                          (out of memory stays out_of_memory, at any epoch),
                          or a process that keeps dying without a word.  An
                          exception says nothing about the size: a typo in the
                          validation code raises at any batch size, and
                          charging it to the size locked jobs whose scripts
                          had a bug for a few runs (every size ruled out).
========================  ====================================================

Trials at sizes the lane no longer lists (``bso jobs set-sizes``) are left out
of the view; out of memory still says what fits on the hardware, whatever the list.
"""

from __future__ import annotations

import dataclasses
from enum import StrEnum

from bso.core.state import JobSnapshot, TrialSnapshot
from bso.core.vocabulary import StopReason, TrialPhase, TrialStatus

MAX_INTERRUPTIONS = 3
"""Interruptions of one size in a row (no finished run between) that count as a failure."""

SCRIPT_ERROR_NOTICE_AFTER = 3
"""Script errors in a row on a lane after which the next trial's reply says so plainly."""

CENSORING_REASONS = frozenset(
    {StopReason.PROJECTED_COST, StopReason.COST_BOUND, StopReason.EXPLORATION_BUDGET}
)
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
    SCRIPT_ERROR = "script_error"
    """The script raised or stopped on its own (``abandoned``): not the size's fault."""


def is_script_error(trial: TrialSnapshot) -> bool:
    """Ended by the caller (a crash, a usage error of bso's client, or training that
    stopped short of the target on its own), at any epoch: what the size did is not
    why it ended, so the script is at fault.  Out of memory and a diverged metric
    have their own stop reasons and stay the size's fault."""
    return trial.status is TrialStatus.FAILED and trial.stop_reason is StopReason.ABANDONED


def unproven_divergence(trial: TrialSnapshot, lane_reported_a_number: bool) -> bool:
    """Diverged at its first epoch report (no epoch recorded) while no earlier run of
    the lane had reported a finite metric: the script may never compute a number at
    all, whatever the size.  Like an interruption it counts against the size only
    when it repeats (:data:`MAX_INTERRUPTIONS` in a row), so a size that truly
    diverges at once is still dropped, a few runs later."""
    return (
        trial.stop_reason is StopReason.DIVERGED
        and trial.epochs == 0
        and not lane_reported_a_number
    )


def _unproven_divergences(trials: tuple[TrialSnapshot, ...]) -> set[int]:
    """The trial numbers of :func:`unproven_divergence` trials among ``trials``."""
    numbers: set[int] = set()
    reported = False
    for trial in sorted(trials, key=lambda t: t.trial_number):
        if unproven_divergence(trial, reported):
            numbers.add(trial.trial_number)
        reported = reported or trial.epochs > 0
    return numbers


def stopped_before_training(trial: TrialSnapshot) -> bool:
    """Stopped by a signal (SIGTERM, Ctrl-C) before its first epoch report.  A silent
    death (``heartbeat_timeout``: SIGKILL, the host's OOM killer) is not this: when it
    repeats, it may well be the size's fault."""
    return trial.stop_reason is StopReason.INTERRUPTED and trial.epochs == 0


def outcome_of(trial: TrialSnapshot) -> Outcome:
    return outcome_from(trial.status, trial.stop_reason)


def outcome_from(status: TrialStatus, stop_reason: StopReason | None) -> Outcome:
    """The outcome of a trial with this status and stop reason: all it depends on, so
    that trials counted by these two (the metrics) name the same outcomes as
    ``bso status``."""
    if status is TrialStatus.RUNNING:
        return Outcome.RUNNING
    if status is TrialStatus.CONVERGED:
        return Outcome.CONVERGED
    if status is TrialStatus.INTERRUPTED:
        return Outcome.INTERRUPTED
    if stop_reason is StopReason.OUT_OF_MEMORY:
        return Outcome.OUT_OF_MEMORY
    if stop_reason in CENSORING_REASONS:
        return Outcome.STOPPED
    if stop_reason is StopReason.ABANDONED:
        return Outcome.SCRIPT_ERROR  # is_script_error
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
    unproven = _unproven_divergences(snapshot.trials)
    listed = set(snapshot.spec.batch_sizes)
    for trial in snapshot.trials:
        if limit is not None and trial.batch_size >= limit:
            continue
        if trial.batch_size not in listed:  # the lane's sizes were changed since
            continue
        if trial.out_of_memory:  # re-probed since: the size is a candidate again
            continue
        if is_script_error(trial) or stopped_before_training(trial):
            continue  # neither counts nor breaks a run of interruptions
        if trial.interrupted or trial.trial_number in unproven:
            count = interruptions.get(trial.batch_size, 0) + 1
            interruptions[trial.batch_size] = count % MAX_INTERRUPTIONS
            if count == MAX_INTERRUPTIONS:  # a failure, still of its own stop reason
                kept.append(dataclasses.replace(trial, status=TrialStatus.FAILED))
            continue
        if not trial.running:
            interruptions[trial.batch_size] = 0
        kept.append(trial)
    return dataclasses.replace(snapshot, trials=tuple(kept), memory_limit=limit)


def interrupted_retry(snapshot: JobSnapshot, view: JobSnapshot) -> tuple[int, TrialPhase] | None:
    """The size (and phase) of the lane's latest finished trial when it was
    interrupted (or an :func:`unproven_divergence`) and still counts as such, or ended
    in a script error: it gets the next trial again, so a relaunch (or the fixed
    script) runs the same size."""
    finished = [t for t in snapshot.trials if not t.running]
    if not finished:
        return None
    last = finished[-1]
    ignored = last.interrupted or is_script_error(last)
    if not (ignored or last.trial_number in _unproven_divergences(snapshot.trials)):
        return None
    if last.batch_size not in view.candidate_sizes:
        return None
    counted_as_failure = any(t.trial_number == last.trial_number and t.failed for t in view.trials)
    if counted_as_failure:
        return None
    return last.batch_size, last.phase


def script_errors_in_a_row(snapshot: JobSnapshot) -> int:
    """How many of the lane's latest finished trials in a row were script errors."""
    return len(_latest_script_errors(snapshot))


def _latest_script_errors(snapshot: JobSnapshot) -> list[TrialSnapshot]:
    """The lane's latest finished trials that were script errors, in a row (newest first)."""
    latest = []
    for trial in reversed(snapshot.trials):
        if trial.running:
            continue
        if not is_script_error(trial):
            break
        latest.append(trial)
    return latest


def script_error_notice(job_id: str, snapshot: JobSnapshot) -> str | None:
    """What the next trial's reply says once :data:`SCRIPT_ERROR_NOTICE_AFTER` runs in a
    row were ended by the script itself (:func:`is_script_error`); None before that.
    It names their sizes: a script that fails at one size only is the user's to
    judge (``bso jobs set-sizes`` drops the size)."""
    errors = _latest_script_errors(snapshot)
    count = len(errors)
    if count < SCRIPT_ERROR_NOTICE_AFTER:
        return None
    sizes = sorted({t.batch_size for t in errors})
    at = f"batch size{'s' if len(sizes) > 1 else ''} {', '.join(map(str, sizes))}"
    return (
        f"the last {count} runs of job {job_id} on {snapshot.hardware.key} were ended by "
        f"the training script itself (it raised, or stopped short of the target), at {at}: "
        "a bug in the script, not held against the batch size (see the run's traceback); "
        "bso still hands out sizes"
    )


def ruled_out(snapshot: JobSnapshot) -> str:
    """The sizes the lane's trials ruled out and by which outcomes, e.g.
    ``64: failed (max_epochs) x2; 128: out_of_memory``: what ``NoFeasibleBatchSize``
    names.  Interruptions are listed (:data:`MAX_INTERRUPTIONS` in a row count as a
    failure); running trials, script errors and stops before training are not."""
    per_size: dict[int, dict[str, int]] = {}
    for trial in snapshot.trials:
        outcome = outcome_of(trial)
        if outcome in (Outcome.RUNNING, Outcome.SCRIPT_ERROR) or stopped_before_training(trial):
            continue
        word = outcome.value
        if outcome in (Outcome.FAILED, Outcome.STOPPED) and trial.stop_reason is not None:
            word = f"{word} ({trial.stop_reason.value})"
        counts = per_size.setdefault(trial.batch_size, {})
        counts[word] = counts.get(word, 0) + 1
    parts = []
    for size in sorted(per_size):
        words = ", ".join(word if n == 1 else f"{word} x{n}" for word, n in per_size[size].items())
        parts.append(f"{size}: {words}")
    return "; ".join(parts) or "no finished trial"
