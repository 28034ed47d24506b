"""The exploration budget: a ledger that keeps a lane's cost near always-default's.

A job that sets ``JobSpec.exploration_budget`` (a fraction ``a``) asks that its
cumulative cost on a lane stay within ``(1 + a)`` times what always running the
default batch size would have cost over the same recurrences.  This is a
conservative bandit (Wu et al., "Conservative Bandits", 2016): the default is the
baseline action, and the policy's choice is played only while the ledger can
absorb it, else a *safe* size is played instead.

The ledger, per lane, from the learning view's trials (interruptions and script
errors are not bso's choices and are not counted), counts the *excess*: what the
lane spent beyond what always-default would have.  A run of the default costs
exactly what always-default paid in that recurrence, so it adds nothing; a
recurrence that another size finished adds that size's runs (stopped ones
included) less one default run, at a lower confidence bound on the mean cost of
the default's converged runs (``baseline_lower``: an estimate that is high by
luck must not pass for savings); a stopped run of another size, in a recurrence the default
then finished, adds its whole cost.  The excess allowed after ``n`` recurrences
is ``a * max(n, 1 / a)`` default runs (at the mean).

The ``max`` is the one thing a fraction alone cannot give: a first exploration
risks about one run, which a 2% budget only earns after 50 recurrences, so
exploration could never begin.  The budget is therefore counted from recurrence
``ceil(1 / a)`` on; before it, the excess is at most one default run's cost.

Two rules spend it:

* **A new trial** gets the policy's size when that size is safe, or when what
  the allowance has left would pay for at least half a run of it
  (:func:`expected_cost`, :data:`MIN_AFFORDED_SHARE`); otherwise the cheapest
  safe size.
* **A running trial** at an unsafe size is stopped (``exploration_budget``) at the
  last epoch where stopping still keeps the allowance, unless it is 90% sure to
  converge within it, before the policy's own rules would stop it
  (:meth:`Ledger.must_stop`).

Safe sizes cost no budget on average: the default itself, and any size that
never failed and whose mean cost is below the default's with ``SAFE_CONFIDENCE_Z``
(its upper one-sided bound below the default's lower one, with the lane's pooled
run-to-run noise; a failure, at ``max_epochs`` or a diverged metric, is the
noise that converged runs do not show).
Savings of safe runs refill the ledger, which is what lets a job explore again
later.

What it guarantees, and at what confidence, is in docs/client.md ("Exploration
budget"): only the recurrences another size finished are compared with an
estimate of the default's cost, its lower 90% bound, so the bound holds with
about that confidence, up to the noise of the epochs each run needs.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from statistics import NormalDist

from bso.core import bandit, gaussian
from bso.core.outcomes import CENSORING_REASONS
from bso.core.size_evidence import EPOCHS_STEP_SD, nearest
from bso.core.state import EpochGuess, JobSnapshot, TrialSnapshot

MIN_LOG_NOISE = 0.01
"""Floor of the run-to-run noise of log epochs: the log-normal needs a spread."""
MIN_AFFORDED_SHARE = 0.5
"""Share of a run's expected cost the allowance must have left to start it: a
median run of a size cheaper per epoch than the default (the kind an exploration
finds) converges before its budget stop; one of a size as dear is stopped halfway,
its epochs then known to exceed half the default's."""
SAFE_CONFIDENCE = 0.9
"""How sure the ledger must be: that a size is cheaper than the default to call it
safe, of the default's cost it credits, and that a run past its last budget-keeping
stop converges within the allowance."""
SAFE_CONFIDENCE_Z = NormalDist().inv_cdf(SAFE_CONFIDENCE)
"""The same, in standard errors of a normal (1.28)."""


@dataclass(frozen=True, slots=True)
class Ledger:
    """One lane's exploration budget, as the policies and ``bso status`` read it."""

    budget: float
    """The job's ``exploration_budget``: a fraction of always-default's cost."""
    baseline_size: int
    """The size whose cost the budget is relative to: the default (or the largest
    candidate below it, when the default does not fit)."""
    baseline_cost: float
    """Mean cost of the baseline's converged runs: always-default's cost per recurrence."""
    baseline_lower: float
    """A lower one-sided ``SAFE_CONFIDENCE_Z`` bound on that mean (from its runs and the
    lane's pooled noise): what a recurrence another size finished is credited with,
    so that a lucky-high estimate of the default does not pass for savings."""
    recurrences: int
    """Recurrences begun: one per converged run, plus the running ones."""
    converged_runs: int
    """Recurrences that ended with a converged run."""
    other_spent: float
    """Cost of the runs at other sizes (running ones up to their last epoch)."""
    other_recurrences: int
    """Runs at other sizes that converged, and the running trial being judged: the
    recurrences they finish."""
    other_finished_spent: float
    """What ``other_spent`` holds of runs that ended."""
    other_converged: int
    reserved: float
    """What other running trials at unsafe sizes may still cost (their size's expected
    cost less their cost so far): room that concurrent requests may not spend."""
    safe_sizes: tuple[int, ...]
    """The baseline and the sizes known (with ``SAFE_CONFIDENCE_Z``) to cost less,
    cheapest first."""
    fallback_cost: float
    """Mean cost of the cheapest safe size: what a run after a budget stop costs."""

    def allowed_excess(self, recurrences: int) -> float:
        """The most the lane may have spent beyond always-default after ``recurrences``:
        ``budget`` of them, and at least one default run."""
        if self.budget <= 0:
            return 0.0
        return self.budget * max(recurrences, math.ceil(1 / self.budget)) * self.baseline_cost

    @property
    def excess(self) -> float:
        """Spent beyond always-default: other sizes' runs (running ones at their cost
        so far) less one default run per recurrence they finished."""
        return self.other_spent - self.other_recurrences * self.baseline_lower

    @property
    def used(self) -> float:
        """Excess of the ended runs, in default runs (negative: savings)."""
        ended = self.other_finished_spent - self.other_converged * self.baseline_lower
        return ended / self.baseline_cost

    @property
    def allowed(self) -> float:
        """Excess allowed by the end of the next recurrence, in default runs."""
        return self.allowed_excess(self.converged_runs + 1) / self.baseline_cost

    def affords(self, expected_cost: float) -> bool:
        """Whether a new recurrence's run at another size, expected to cost
        ``expected_cost``, is worth starting: its budget stop (:meth:`must_stop`)
        comes once it has cost what the allowance has left, so that must be at
        least ``MIN_AFFORDED_SHARE`` of the run.  A run cut sooner would buy a bound,
        not a measurement, and a budget refilling a little every recurrence would
        spend itself on such stubs."""
        room = self.allowed_excess(self.recurrences + 1) - self.excess - self.reserved
        return room >= MIN_AFFORDED_SHARE * expected_cost

    def must_stop(self, trial: TrialSnapshot, outlook: Outlook) -> bool:
        """Whether ``trial`` (running at an unsafe size, its newest figures in the
        ledger) must stop now, given the ``outlook`` of finishing it.

        It goes on while stopping after one more epoch would stay within the
        allowance (the run then finishes no recurrence; a run of a safe size does,
        costing no budget), or while it is ``SAFE_CONFIDENCE`` sure to converge
        before its cost uses up what is left of the allowance and within the
        outlook's horizon, where the policy's own rules stop it unconverged (a run
        stopped there costs its whole spend and a fallback run: the held-out
        ``shelf-0`` landscape's 512, let go on as nearly done, was cut by bso's
        overrun stop at 1.7 default runs, and a 0.02 budget allows one), and
        finishing is expected to stay within it: a size cheaper per epoch than
        the default, near its end.  (Refusing that bet to a run past the
        ``SAFE_CONFIDENCE`` quantile of its predicted epochs, whose prediction was
        wrong, cost imagenet's budgeted replays up to 2.6 points, at eta 1 1.036 ->
        1.062 of the oracle, in ``scripts/bench_decisions.py --budgets 0.02``: such
        runs were often nearly done, and the horizon already bounds the bet.)
        Otherwise it stops at the last epoch where stopping keeps the budget.
        Past that point (the allowance was already overdrawn, by a safe size's
        failure or a cost per epoch that jumped) the cheaper way out is taken:
        finishing (the rest of its epochs, and, should it reach its horizon first,
        a run of the cheapest safe size still owed), or stopping and running that
        size, unless it has run past the
        ``SAFE_CONFIDENCE`` quantile of its predicted epochs: that prediction, which
        would call it nearly done every epoch, was wrong, and it stops.  Safe sizes
        are never stopped.
        """
        if trial.batch_size in self.safe_sizes or trial.epochs == 0:
            return False
        allowed = self.allowed_excess(self.recurrences)
        per_epoch = trial.cost / trial.epochs
        # This run finishing nothing, and the other unsafe runs costing what they may.
        stop_now = self.excess + self.baseline_lower + self.reserved
        if stop_now + per_epoch <= allowed:
            return False
        fails = 1.0 - outlook.converges
        finish = self.excess + self.reserved + outlook.remaining_cost + fails * self.baseline_lower
        # Finishing credits the recurrence's default run (in ``excess`` already), so
        # the run may cost what is left of the allowance beyond what it has spent.
        left = allowed - self.excess - self.reserved
        affordable = trial.epochs + left / per_epoch if per_epoch > 0 else math.inf
        if outlook.converges_by(affordable) >= SAFE_CONFIDENCE and finish <= allowed:
            return False
        if stop_now <= allowed or outlook.overran:
            # Past its last budget-keeping stop, a run that overran its predicted
            # epochs is not weighed on that prediction: it would call it nearly done
            # every epoch, to max_epochs.
            return True
        return outlook.remaining_cost + fails * self.fallback_cost > self.fallback_cost

    @property
    def cheapest_safe_size(self) -> int:
        return self.safe_sizes[0]


def ledger(snapshot: JobSnapshot, current: TrialSnapshot | None = None) -> Ledger | None:
    """The lane's ledger, from its learning view (with ``current``, a running trial's
    newest figures, in place of its stored ones); None when the job has no budget or
    its baseline has not converged yet (see :func:`baseline_pending`)."""
    budget = snapshot.spec.exploration_budget
    baseline = snapshot.start_batch_size
    if budget is None or baseline is None:
        return None
    trials = _with_current(snapshot, current)
    per_size: dict[int, list[float]] = {}
    for t in trials:
        if t.converged:
            per_size.setdefault(t.batch_size, []).append(t.cost)
    if not per_size.get(baseline):
        return None
    baseline_cost = statistics.fmean(per_size[baseline])
    if baseline_cost <= 0:
        return None  # nothing measured (eta_knob=1 without energy): nothing to budget
    log_noise = math.log1p(bandit.pooled_cost_cv(per_size))
    baseline_lower = baseline_cost * math.exp(
        -SAFE_CONFIDENCE_Z * log_noise / math.sqrt(len(per_size[baseline]))
    )
    means = {b: statistics.fmean(costs) for b, costs in per_size.items()}
    failing = {t.batch_size for t in trials if t.failed and t.stop_reason not in CENSORING_REASONS}
    safe = {baseline} | {
        b
        for b, costs in per_size.items()
        if b in snapshot.candidate_sizes
        and b not in failing
        and means[b] * math.exp(SAFE_CONFIDENCE_Z * log_noise / math.sqrt(len(costs)))
        < baseline_lower
    }
    ordered = tuple(sorted(safe, key=lambda b: (means[b], b)))
    others = [t for t in trials if t.batch_size != baseline]
    # The trial being judged is credited as finishing its recurrence (its stop is
    # weighed against that); other running trials are not: they have cost little
    # yet, and crediting them would hand concurrent requests room they may not have.
    credited = int(current is not None and current.running and current.batch_size != baseline)
    reserved = sum(
        max((expected_cost(snapshot, t.batch_size) or 0.0) - t.cost, 0.0)
        for t in others
        if t.running and t.batch_size not in safe and t is not current
    )
    return Ledger(
        budget=budget,
        baseline_size=baseline,
        baseline_cost=baseline_cost,
        baseline_lower=baseline_lower,
        recurrences=sum(t.converged or t.running for t in trials),
        converged_runs=sum(t.converged for t in trials),
        other_spent=sum(t.cost for t in others),
        other_recurrences=sum(t.converged for t in others) + credited,
        other_finished_spent=sum(t.cost for t in others if not t.running),
        other_converged=sum(t.converged for t in others),
        reserved=reserved,
        safe_sizes=ordered,
        fallback_cost=means[ordered[0]],
    )


def baseline_pending(snapshot: JobSnapshot) -> bool:
    """A budgeted lane whose baseline has no finished run yet: its cost, which the
    budget is relative to, must be measured before anything else is tried.  (A
    baseline that only failed cannot be measured; always-default would fail too,
    so the budget then constrains nothing.)"""
    baseline = snapshot.start_batch_size
    if snapshot.spec.exploration_budget is None or baseline is None:
        return False
    return not any(t.batch_size == baseline and not t.running for t in snapshot.trials)


def expected_cost(snapshot: JobSnapshot, batch_size: int) -> float | None:
    """What a run of ``batch_size`` is expected to cost: its converged runs' mean, else
    the nearest converged size's (a neighbour needs about as many epochs at a
    similar cost per epoch); None before anything converged."""
    means = snapshot.mean_costs()
    if batch_size in means:
        return means[batch_size]
    if not means:
        return None
    return means[nearest(means, batch_size)]


def budget_stop(
    snapshot: JobSnapshot, trial: TrialSnapshot, cost_ceiling: float = math.inf
) -> Ledger | None:
    """The ledger when the running ``trial`` (its newest figures) must stop for the
    budget (:meth:`Ledger.must_stop`), else None.  ``cost_ceiling``: a cost at
    which the policy's own rules will have stopped the run unconverged."""
    found = ledger(snapshot, current=trial)
    if found is None or trial.batch_size in found.safe_sizes or trial.epochs == 0:
        return None
    trials = _with_current(snapshot, trial)
    guess = snapshot.other_lanes_epochs.get(trial.batch_size)
    seen = outlook(trials, trial, snapshot.spec.max_epochs, cost_ceiling, guess)
    return found if found.must_stop(trial, seen) else None


@dataclass(frozen=True, slots=True)
class Outlook:
    """What finishing a running trial is expected to bring."""

    remaining_cost: float
    """Cost of the epochs it is expected to still run, up to its ``horizon``."""
    overran: bool = False
    """It has run past the ``SAFE_CONFIDENCE`` quantile of its predicted epochs."""
    log_centre: float = math.nan
    """Mean of the log of its epochs to target (before conditioning on ``ran``)."""
    log_spread: float = math.nan
    """Standard deviation of the same."""
    ran: float = 0.0
    """Epochs it has run."""
    horizon: float = 0.0
    """Epochs at which it ends unconverged: ``max_epochs``, or sooner where the
    policy's own rules stop it (its cost ceiling)."""

    @property
    def converges(self) -> float:
        """Probability that it reaches the target within its ``horizon``."""
        return self.converges_by(self.horizon)

    def converges_by(self, epochs: float) -> float:
        """Probability that it reaches the target within ``epochs`` (and its horizon),
        given that it has not in the epochs it ran; 0 where the prediction has no
        room left (a run far past it, whose normal tail underflows)."""
        cap = min(epochs, self.horizon)
        if not math.isfinite(self.log_centre) or cap <= self.ran:
            return 0.0
        surviving = gaussian.lognormal_survival(self.log_centre, self.log_spread, self.ran)
        if surviving <= 0:
            return 0.0
        beyond = gaussian.lognormal_survival(self.log_centre, self.log_spread, cap)
        return 1.0 - beyond / surviving


def outlook(
    trials: list[TrialSnapshot],
    trial: TrialSnapshot,
    max_epochs: int,
    cost_ceiling: float = math.inf,
    other_lane: EpochGuess | None = None,
) -> Outlook:
    """The :class:`Outlook` of the running ``trial``.

    Its epochs to target are log-normal around its own converged runs' mean, else
    around ``other_lane``'s (what the job's other lanes measured at the size),
    else the nearest converged size's, with the lane's pooled run-to-run noise
    and, for another lane's, how far lanes differ; for a neighbour's,
    ``EPOCHS_STEP_SD`` per doubling of the batch between them
    (how epochs change with the batch is unknown); conditioned on having passed the
    epochs it ran, and cut at its horizon, where the run ends unconverged:
    ``max_epochs``, or the epoch where its cost reaches ``cost_ceiling``.
    """
    epochs: dict[int, list[int]] = {}
    costs: dict[int, list[float]] = {}
    for t in trials:
        if t.converged:
            epochs.setdefault(t.batch_size, []).append(t.epochs)
            costs.setdefault(t.batch_size, []).append(t.cost)
    ran = float(trial.epochs)
    per_epoch = trial.cost / trial.epochs
    horizon = float(max_epochs)
    if per_epoch > 0:
        horizon = min(horizon, cost_ceiling / per_epoch)
    if not epochs or ran >= horizon:
        return Outlook(0.0 if ran >= horizon else math.inf)
    b = trial.batch_size
    noise = math.log1p(bandit.pooled_cost_cv(costs))
    if b not in epochs and other_lane is not None:
        centre = other_lane.log_mean
        spread = max(other_lane.run_log_sd, MIN_LOG_NOISE)
    else:
        ref = b if b in epochs else nearest(epochs, b)
        centre = statistics.fmean(math.log(n) for n in epochs[ref])
        doublings = abs(math.log2(b / ref))
        spread = max(math.hypot(noise, EPOCHS_STEP_SD * doublings), MIN_LOG_NOISE)
    remaining = gaussian.lognormal_remaining(centre, spread, ran, horizon)
    overran = math.log(ran) > centre + SAFE_CONFIDENCE_Z * spread
    return Outlook(
        per_epoch * remaining,
        overran,
        log_centre=centre,
        log_spread=spread,
        ran=ran,
        horizon=horizon,
    )


def _with_current(snapshot: JobSnapshot, current: TrialSnapshot | None) -> list[TrialSnapshot]:
    """The snapshot's trials, ``current`` (newer figures of one of them) in its place."""
    if current is None:
        return list(snapshot.trials)
    kept = [t for t in snapshot.trials if t.trial_number != current.trial_number]
    return [*kept, current]
