"""Policies: which batch size a new trial gets, and when a running trial stops.

A policy is a pure object: it reads a :class:`JobSnapshot`, draws from the
``numpy`` generator it is given, and returns a decision.  The service persists
the decision and the generator state.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

from bso.core import bandit, budget
from bso.core.outcomes import interrupted_retry, learning_view, ruled_out
from bso.core.state import JobSnapshot, TrialSnapshot
from bso.core.vocabulary import StopReason, TrialPhase
from bso.errors import NoFeasibleBatchSize
from bso.spec import JobSpec

# A size that failed this many exploitation trials in a row is dropped for good.
MAX_CONSECUTIVE_FAILURES = 2
# Penalty cost, in multiples of the best mean cost, for a failed exploitation run
# when beta_knob is disabled.
DEFAULT_FAILURE_PENALTY = 2.0


@dataclass(frozen=True, slots=True)
class Assignment:
    batch_size: int
    phase: TrialPhase


@dataclass(frozen=True, slots=True)
class Verdict:
    stop: bool
    converged: bool = False
    reason: StopReason | None = None
    message: str = ""


CONTINUE = Verdict(stop=False)


def metric_reached(snapshot: JobSnapshot, metric: float) -> bool:
    return snapshot.spec.metric_reached(metric)


class Policy(ABC):
    """Shared stop rules; subclasses decide batch sizes and may stop earlier."""

    name: str

    def assign(self, snapshot: JobSnapshot, rng: np.random.Generator) -> Assignment:
        """Batch size and phase of a new trial, from the lane's stored trials.

        The policy decides from :func:`~bso.core.outcomes.learning_view`; an
        interrupted run's size is handed out again first (not its fault).
        """
        view = learning_view(snapshot)
        try:
            if not view.candidate_sizes:
                raise NoFeasibleBatchSize(
                    f"every batch size from {view.memory_limit} up ran out of memory, and "
                    "no smaller size is configured (or re-probe memory with "
                    "reprobe_memory=True if it changed)"
                )
            retry = interrupted_retry(snapshot, view)
            if retry is not None:
                return Assignment(*retry)
            return within_budget(view, self.next_trial(view, rng))
        except NoFeasibleBatchSize as exc:
            raise NoFeasibleBatchSize(way_out(snapshot, exc.message)) from None

    def judge_epoch(self, snapshot: JobSnapshot, trial: TrialSnapshot, metric: float) -> Verdict:
        """:meth:`on_epoch` on the learning view of the lane's stored trials."""
        return self.on_epoch(learning_view(snapshot), trial, metric)

    @abstractmethod
    def next_trial(self, snapshot: JobSnapshot, rng: np.random.Generator) -> Assignment:
        """Batch size and phase for a new trial, from the learning view of the lane."""

    def on_epoch(self, snapshot: JobSnapshot, trial: TrialSnapshot, metric: float) -> Verdict:
        """Verdict after ``trial`` (already holding this epoch's totals) reported ``metric``."""
        spec = snapshot.spec
        if metric_reached(snapshot, metric):
            return Verdict(True, True, StopReason.TARGET_REACHED, "target metric reached")
        if trial.epochs >= spec.max_epochs:
            return Verdict(
                True,
                False,
                StopReason.MAX_EPOCHS,
                f"target not reached in {spec.max_epochs} epochs",
            )
        base = self.cost_bound_base(snapshot)
        if spec.beta_knob is not None and base is not None:
            bound = spec.beta_knob * base
            if trial.cost > bound:
                return Verdict(
                    True,
                    False,
                    StopReason.COST_BOUND,
                    f"cost {trial.cost:.4g} passed beta_knob x best cost = {bound:.4g}",
                )
        ledger = None
        if spec.exploration_budget is not None:
            ledger = budget.budget_stop(snapshot, trial, self.cost_ceiling(snapshot, trial))
        if ledger is not None:
            return Verdict(
                True,
                False,
                StopReason.EXPLORATION_BUDGET,
                f"finishing batch size {trial.batch_size} would overdraw the exploration "
                f"budget ({snapshot.spec.exploration_budget:g}); a run of "
                f"{ledger.cheapest_safe_size} costs less",
            )
        return self.early_stop(snapshot, trial)

    def cost_bound_base(self, snapshot: JobSnapshot) -> float | None:
        """The "best cost so far" that ``beta_knob`` multiplies: Zeus takes the
        cheapest single converged run."""
        return snapshot.min_cost

    def early_stop(self, snapshot: JobSnapshot, trial: TrialSnapshot) -> Verdict:
        """Policy-specific stop rule, consulted when the shared rules say continue."""
        return CONTINUE

    def cost_ceiling(self, snapshot: JobSnapshot, trial: TrialSnapshot) -> float:
        """A cost at which this policy's own rules will have stopped ``trial``
        unconverged (``beta_knob`` times the best cost; unbounded without it; they
        may stop it sooner, on a prediction).  The exploration budget lets a run
        go on past its last budget-keeping epoch only if it is likely to converge
        below this: a run stopped later costs its whole spend and a fallback run."""
        base = self.cost_bound_base(snapshot)
        if snapshot.spec.beta_knob is None or base is None:
            return math.inf
        return snapshot.spec.beta_knob * base


def within_budget(view: JobSnapshot, assignment: Assignment) -> Assignment:
    """The policy's ``assignment``, or a safe size when the job's exploration budget
    cannot pay for it (:mod:`bso.core.budget`); the baseline first, while its cost,
    which the budget is relative to, is unknown."""
    if budget.baseline_pending(view):
        start = view.start_batch_size
        assert start is not None, "Policy.assign refuses a lane without candidates"
        if assignment.batch_size == start:
            return assignment
        return Assignment(start, TrialPhase.EXPLORATION)
    ledger = budget.ledger(view)
    if ledger is None or assignment.batch_size in ledger.safe_sizes:
        return assignment
    expected = budget.expected_cost(view, assignment.batch_size)
    if expected is not None and ledger.affords(expected):
        return assignment
    return Assignment(ledger.cheapest_safe_size, TrialPhase.EXPLOITATION)


FIXES = {
    StopReason.MAX_EPOCHS: "raise max_epochs or relax target_metric if no size can reach it",
    StopReason.DIVERGED: (
        "a diverged metric (NaN or infinite) is often a learning rate too high for the "
        "size: lower it, or scale it with the batch (bso.scale_lr)"
    ),
    StopReason.OUT_OF_MEMORY: (
        "list smaller sizes, or re-probe memory with reprobe_memory=True if it changed"
    ),
}
"""What to change for each outcome that rules a size out by what the size did, as
``NoFeasibleBatchSize`` suggests it (in this order)."""


def way_out(snapshot: JobSnapshot, why: str) -> str:
    """``NoFeasibleBatchSize``'s message: why, which sizes were ruled out by which
    outcomes (and which the search never tried, or a memory limit keeps out), what
    those outcomes suggest changing, and the commands that get the job going again."""
    job, lane = snapshot.spec.job_id or "JOB", snapshot.hardware.key
    sizes = ",".join(str(b) for b in snapshot.spec.batch_sizes)
    ran = {t.batch_size for t in snapshot.trials}
    view = learning_view(snapshot)
    untried = [b for b in view.candidate_sizes if b not in ran]
    not_tried = (
        f"; not tried: {', '.join(map(str, untried))} (the search does not go past a "
        "size that failed)"
        if untried
        else ""
    )
    too_large = [
        b for b in snapshot.spec.batch_sizes if b not in view.candidate_sizes and b not in ran
    ]
    if too_large and view.candidate_sizes:
        not_tried += (
            f"; {', '.join(map(str, too_large))}: do not fit (out of memory from "
            f"{view.memory_limit} up)"
        )
    reasons = {t.stop_reason for t in snapshot.trials if not t.converged}
    if not view.candidate_sizes:
        reasons.discard(StopReason.OUT_OF_MEMORY)  # ``why`` says it already
    fixes = [fix for reason, fix in FIXES.items() if reason in reasons]
    to_change = f" What to change: {'; '.join(fixes)}." if fixes else ""
    return (
        f"job {job} has no feasible batch size on {lane}: {why}. Ruled out: "
        f"{ruled_out(snapshot)}{not_tried}.{to_change} To start over with the same sizes: "
        f"bso jobs reset {job}; "
        f"to try other sizes: bso jobs set-sizes {job} --lane '{lane}' --batch-sizes "
        f"{sizes} (edit the list; trials at sizes kept still count), then list the "
        "same sizes in the job and relaunch"
    )


def exploration_trials(snapshot: JobSnapshot) -> dict[int, list[TrialSnapshot]]:
    per_size: dict[int, list[TrialSnapshot]] = {}
    for t in snapshot.trials:
        if t.phase is TrialPhase.EXPLORATION:
            per_size.setdefault(t.batch_size, []).append(t)
    return per_size


def concurrent(snapshot: JobSnapshot) -> Assignment:
    """While an exploration runs, other trials use the best size known so far."""
    best = snapshot.best_batch_size()
    start = snapshot.start_batch_size
    assert start is not None, "Policy.assign refuses a lane without candidates"
    return Assignment(best if best is not None else start, TrialPhase.CONCURRENT)


def failure_multiple(spec: JobSpec) -> float:
    """How many times the best mean cost a run that does not converge is counted:
    ``beta_knob``, or :data:`DEFAULT_FAILURE_PENALTY` when the job has none."""
    return spec.beta_knob or DEFAULT_FAILURE_PENALTY


def arm_observations(snapshot: JobSnapshot, arms: list[int]) -> dict[int, list[float]]:
    """Windowed cost observations per size; failed runs count as a penalty cost.

    A failed run's own cost understates it (it was cut short), so it is
    charged at least ``beta_knob`` (or 2) times the best mean cost.
    """
    spec = snapshot.spec
    means = snapshot.mean_costs()
    best = min(means.values()) if means else 0.0
    penalty = failure_multiple(spec) * best
    observations: dict[int, list[float]] = {b: [] for b in arms}
    for t in snapshot.trials:
        if t.batch_size not in observations or t.running:
            continue
        observations[t.batch_size].append(t.cost if t.converged else max(t.cost, penalty))
    return {b: bandit.windowed(c, spec.window_size) for b, c in observations.items()}


def drop_repeatedly_failing(snapshot: JobSnapshot, arms: list[int]) -> list[int]:
    """Sizes whose latest ``MAX_CONSECUTIVE_FAILURES`` finished trials all failed go."""
    keep = []
    for b in arms:
        finished = [t for t in snapshot.trials if t.batch_size == b and not t.running]
        tail = finished[-MAX_CONSECUTIVE_FAILURES:]
        if len(tail) == MAX_CONSECUTIVE_FAILURES and all(t.failed for t in tail):
            continue
        keep.append(b)
    return keep
