"""Where a job's new lane starts: from what its other lanes learned.

A lane is one hardware configuration (another GPU model or count).  The cost
curve over batch sizes moves between GPUs (a faster GPU gains more at large
sizes, a lower-power one at small sizes), but rarely far: the best size on one
lane is usually the best, or a neighbour of it, on another.  So a new lane's
first run is not the job's default but the recommendation of the lane that
knows the job best (the most converged runs), moved to this lane's nearest
candidate, when that lane's curve puts the default clearly above it (beyond how
far curves differ between GPUs; a flat curve's optimum may well be elsewhere
on other hardware, and the default is then as good a start); bso's walk then
measures the neighbours of wherever that lands, as it does from the default,
so a lane whose optimum did move still finds it.

What transfers is where to begin and the *shape* of the cost curve, not its
scale: another GPU's joules and seconds say nothing certain about this one's,
but its cost ratios between sizes are close.  The walk still measures the best
size's neighbours, but does not spend a run on a size beyond them that the
other lane's curve puts clearly above the best (:func:`prior_says_worse`),
where "clearly" is the prior spread of how curves differ between GPUs, learnt
from the sizes both lanes measured (:func:`shape_noise`): a lane whose curve
turns out to differ trusts the other's less and explores like a cold start.
The start is only taken from a lane whose recommendation has converged runs
behind it.

What transfers most surely is the epochs to target: the same model, data and
batch size take the same optimisation steps on any GPU, so the epochs a size
needed on the other lane predict its epochs here, up to run-to-run noise and how
far lanes differ (another GPU count's data sharding, kernels' numerics), learnt
like the shape's from the sizes both lanes converged at
(:func:`lane_epochs_sd`).  An epoch's cost here is known after one epoch, so a
size's run is then judged on a predicted cost after its first epoch, as well
as on the bound its neighbour's epochs set (:func:`epoch_guesses`,
:class:`~bso.core.state.EpochGuess`, read by :mod:`bso.core.bso_policy` and the
budget's outlook).

Those epochs also make a size far from this lane's walk cheap to look at: its
cost here is known after one epoch, so a size the walk would not reach, which
the other lane's curve gives a fair chance of beating this lane's best, is run
for that one epoch when the look is expected to pay for itself within the run
it is made in (:func:`one_epoch_look`); a look that loses is cut then.

The start is computed from the other lanes' trials that had ended when the lane's
first trial began (:func:`bso.lane_snapshots.started_from`), so it does not change under
a lane once it has begun, and ``bso status`` can say what each lane started from.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from statistics import NormalDist

from bso.core.bandit import pooled_cost_cv
from bso.core.confidence import recommend
from bso.core.epoch_predictions import EPOCH_GUESS_Z
from bso.core.outcomes import CENSORING_REASONS, learning_view
from bso.core.size_evidence import SizeEvidence, nearest
from bso.core.state import EpochFloor, EpochGuess, JobSnapshot, LanePrior

SHAPE_LOG_SD = 0.15
"""Prior of :func:`shape_noise`: a GPU's cost ratio between two sizes differs from
another's by about this much (log) per doubling between them (a newer GPU that is
2^0.15 = 11% faster per doubling at large sizes, relatively)."""
SHAPE_PRIOR_WEIGHT = 2.0
"""Observations the prior is worth: two sizes measured on both lanes weigh as much."""
SHAPE_Z = 1.2816
"""One-sided 90%: a size is skipped only when the other lane's curve puts it that
far above the best."""
LANE_EPOCHS_LOG_SD = 0.1
"""Prior of :func:`lane_epochs_sd`: a size's mean log epochs to target on one lane
is that far from another's (10%) beyond run-to-run noise; none in expectation."""
LANE_EPOCHS_PRIOR_WEIGHT = 2.0
"""Sizes the prior is worth: two sizes converged on both lanes weigh as much."""
NORMAL = NormalDist()


@dataclass(frozen=True, slots=True)
class LaneStart:
    """What a lane's first run was taken from."""

    from_lane: str
    """The other lane's hardware key."""
    recommended: int
    """That lane's recommendation when this lane began."""
    batch_size: int
    """This lane's candidate nearest to it (on a log scale): where this lane starts."""
    converged_runs: int
    """Converged runs of the other lane behind the recommendation."""
    relative_costs: Mapping[int, float]
    """The other lane's mean cost per converged size, over its cheapest mean."""


def lane_start(lane: JobSnapshot, others: Sequence[JobSnapshot]) -> LaneStart | None:
    """Where ``lane`` starts, from the ``others`` lanes of its job as they were when it
    began (the caller keeps only their trials that had ended by then); None: at the
    default.  The lane whose learning view has the most converged runs is followed
    (ties: the higher confidence).
    """
    candidates = lane.candidate_sizes
    if not candidates:
        return None
    best: tuple[int, float, str, int, dict[int, float]] | None = None
    for other in others:
        if other.hardware.key == lane.hardware.key:
            continue
        view = learning_view(other)
        converged = sum(t.converged for t in view.trials)
        if not converged:
            continue
        found = recommend(view)
        if found is None:
            continue
        means = view.mean_costs()
        cheapest = min(means.values())
        shape = {b: m / cheapest for b, m in means.items()} if cheapest > 0 else {}
        key = (converged, found.confidence, other.hardware.key, found.batch_size, shape)
        if best is None or key[:2] > best[:2]:
            best = key
    if best is None:
        return None
    converged, _, from_lane, recommended, shape = best
    start = nearest(candidates, recommended)  # sorted: a tie goes to the smaller size
    default = lane.start_batch_size
    assert default is not None, "a lane with candidates has a start size"
    if not clearly_above(shape, default, recommended, SHAPE_LOG_SD):
        start = default  # the other GPU's evidence against the default is within noise
    return LaneStart(from_lane, recommended, start, converged, shape)


def clearly_above(
    relative_costs: Mapping[int, float], size: int, best_size: int, log_sd: float
) -> bool:
    """Whether a curve puts ``size`` above ``best_size`` by more than another GPU's
    curve may differ from it (one-sided ``SHAPE_Z``, ``log_sd`` per doubling
    between them).  Unknown sizes are not."""
    if size not in relative_costs or best_size not in relative_costs:
        return False
    predicted = math.log(relative_costs[size] / relative_costs[best_size])
    return predicted > SHAPE_Z * log_sd * abs(math.log2(size / best_size))


def lane_prior(lane: JobSnapshot, start: LaneStart) -> LanePrior:
    """The prior ``lane`` explores with: where it starts, and the other lane's cost
    curve with how far this lane's may differ from it (:func:`shape_noise`)."""
    return LanePrior(start.batch_size, start.relative_costs, shape_noise(lane, start))


def epoch_guesses(lane: JobSnapshot, others: Sequence[JobSnapshot]) -> dict[int, EpochGuess]:
    """Per size the ``others`` lanes of the job converged at, their epochs to target as
    a guess of ``lane``'s: their mean log epochs, uncertain by their run-to-run noise
    over their runs and by how far lanes differ (:func:`lane_epochs_sd`).  Every
    other lane's runs count, pooled: epochs belong to the optimisation, not to the
    GPU."""
    theirs = _others_converged_epochs(lane, others)
    if not theirs:
        return {}
    noise, between = _epochs_noise(lane, theirs)
    return {
        b: EpochGuess(
            statistics.fmean(math.log(n) for n in runs),
            math.sqrt(noise**2 / len(runs) + between**2),
            noise,
        )
        for b, runs in theirs.items()
    }


def epoch_floors(lane: JobSnapshot, others: Sequence[JobSnapshot]) -> dict[int, EpochFloor]:
    """Per size the ``others`` lanes of the job stopped for cost (learning view), the
    epochs the longest such run proved it needs, uncertain for one run here by the
    job's run-to-run noise and by how far lanes differ (:func:`lane_epochs_sd`).

    A size past the critical batch that another GPU cut, without ever converging,
    says nothing of its cost here (an epoch's cost differs) but much of its epochs:
    the same optimisation did not reach the target in that many.  Without them a
    new lane pays again, in full, for what the first lane learnt there (cliff-jump
    in docs/benchmarks.md: two runs of a size needing several times the epochs).
    """
    ran: dict[int, int] = {}
    for other in others:
        if other.hardware.key == lane.hardware.key:
            continue
        for t in learning_view(other).trials:
            if not t.running and t.grown_to is None and t.stop_reason in CENSORING_REASONS:
                ran[t.batch_size] = max(ran.get(t.batch_size, 0), t.epochs)
    if not ran:
        return {}
    noise, between = _epochs_noise(lane, _others_converged_epochs(lane, others))
    spread = math.hypot(noise, between)
    return {b: EpochFloor(epochs + 1, spread) for b, epochs in ran.items()}


def _others_converged_epochs(
    lane: JobSnapshot, others: Sequence[JobSnapshot]
) -> dict[int, list[int]]:
    """Epochs to target of the ``others`` lanes' converged runs per size, pooled."""
    theirs: dict[int, list[int]] = {}
    for other in others:
        if other.hardware.key != lane.hardware.key:
            for b, runs in _converged_epochs(other).items():
                theirs.setdefault(b, []).extend(runs)
    return theirs


def _epochs_noise(lane: JobSnapshot, theirs: Mapping[int, Sequence[int]]) -> tuple[float, float]:
    """The job's run-to-run noise of log epochs, and how far lanes differ beyond it."""
    own = _converged_epochs(lane)
    # A run's cost noise is its epochs' (an epoch's cost is close to fixed), so the
    # pooled relative noise of the epochs per size and lane is the job's.
    noise = math.log1p(pooled_cost_cv(dict(enumerate([*theirs.values(), *own.values()]))))
    return noise, lane_epochs_sd(own, theirs, noise)


def _converged_epochs(lane: JobSnapshot) -> dict[int, list[int]]:
    """Epochs to target of the lane's converged runs per size (learning view).  A grown
    run's belong to no single size, so it has none."""
    epochs: dict[int, list[int]] = {}
    for t in learning_view(lane).trials:
        if t.converged and t.grown_to is None:
            epochs.setdefault(t.batch_size, []).append(t.epochs)
    return epochs


def lane_epochs_sd(
    own: Mapping[int, Sequence[int]], other: Mapping[int, Sequence[int]], noise: float
) -> float:
    """How far a size's mean log epochs to target on this lane is from the other's,
    beyond the run-to-run ``noise`` (log) of both means: ``LANE_EPOCHS_LOG_SD`` as a
    prior worth ``LANE_EPOCHS_PRIOR_WEIGHT`` sizes, updated with every size both
    lanes converged at.  A lane whose epochs turn out to differ (another GPU count
    that changes the optimisation) so leans on the other's less."""
    squares, count = 0.0, 0
    for b, runs in own.items():
        if b not in other:
            continue
        gap = statistics.fmean(math.log(n) for n in runs) - statistics.fmean(
            math.log(n) for n in other[b]
        )
        sampling = noise**2 * (1 / len(runs) + 1 / len(other[b]))
        squares += max(0.0, gap**2 - sampling)
        count += 1
    prior = LANE_EPOCHS_PRIOR_WEIGHT * LANE_EPOCHS_LOG_SD**2
    return math.sqrt((prior + squares) / (LANE_EPOCHS_PRIOR_WEIGHT + count))


def shape_noise(lane: JobSnapshot, start: LaneStart) -> float:
    """How far this lane's cost ratios are from the other lane's, in log per doubling
    of the batch between the two sizes compared: ``SHAPE_LOG_SD`` as a prior worth
    ``SHAPE_PRIOR_WEIGHT`` observations, updated with every size both lanes
    converged at, against this lane's cheapest such size.  A lane whose curve
    turns out to differ (a GPU that favours other sizes) so trusts the other
    lane's less, and explores more."""
    means = learning_view(lane).mean_costs()
    shared = [b for b in means if b in start.relative_costs]
    squares, count = 0.0, 0
    if len(shared) >= 2:
        ref = min(shared, key=lambda b: means[b])
        for b in shared:
            if b == ref:
                continue
            here = math.log(means[b] / means[ref]) if means[ref] > 0 and means[b] > 0 else 0.0
            there = math.log(start.relative_costs[b] / start.relative_costs[ref])
            squares += ((here - there) / abs(math.log2(b / ref))) ** 2
            count += 1
    prior = SHAPE_PRIOR_WEIGHT * SHAPE_LOG_SD**2
    return math.sqrt((prior + squares) / (SHAPE_PRIOR_WEIGHT + count))


def prior_says_worse(snapshot: JobSnapshot, batch_size: int, best_size: int) -> bool:
    """Whether the other lane's curve says ``batch_size`` costs more than ``best_size``
    here too, beyond how far the curves may differ (one-sided ``SHAPE_Z``): the walk
    then does not spend a run on it.

    Never for the best size's own neighbours: they are what shows whether this
    lane's curve tilts away from the other's (a GPU faster at large sizes moves
    the optimum up), and, measured, they teach :func:`shape_noise` how far to
    trust the rest of it.
    """
    prior = snapshot.prior
    if prior is None:
        return False
    sizes = snapshot.candidate_sizes
    if abs(sizes.index(batch_size) - sizes.index(best_size)) <= 1:
        return False
    return clearly_above(prior.relative_costs, batch_size, best_size, prior.log_sd)


def one_epoch_look(snapshot: JobSnapshot, evidence: Mapping[int, SizeEvidence]) -> int | None:
    """An untried size worth one epoch of a run, after bso's walk has ended; None: none.

    Only a size the job's other lanes converged at qualifies: their epochs to target
    make its cost here known after its first epoch, and the first epoch's
    projection (:func:`bso.core.epoch_predictions.least_epochs`) cuts it then
    unless it may still win.  The walk steps one size at a time and ends at a size
    no cheaper than the best within noise, so on a curve that is flat near the
    default and falls further away it never reaches the fall, even where another
    GPU's curve shows it.  Its cost here is predicted from this lane's mean at the
    nearest size both lanes converged at, times the other lane's cost ratio between
    the two, uncertain by how far the curves may differ per doubling between them
    (:func:`shape_noise`) and by how far the epochs may (``EpochGuess.log_sd``).

    The size is looked at when that is expected to pay for itself within the run it
    is made in (:func:`look_value`): what it saves where it beats the best, less
    what a run that is not cut but loses costs over the best, less the epoch a cut
    run wastes.  Later runs' savings are not counted, so a look is taken only where
    the other lane's curve makes a win likely or large.  The size with the highest
    value is taken.
    """
    prior = snapshot.prior
    if prior is None or not snapshot.other_lanes_epochs:
        return None
    means = {b: e.mean_cost for b, e in evidence.items() if e.epochs}
    shared = [b for b in means if b in prior.relative_costs and means[b] > 0]
    if not shared:
        return None
    best = min(means.values())
    choice, highest = None, 0.0
    for b, e in sorted(evidence.items()):
        guess = snapshot.other_lanes_epochs.get(b)
        if e.tried or guess is None or b not in prior.relative_costs:
            continue
        ref = nearest(shared, b)
        centre = math.log(means[ref] * prior.relative_costs[b] / prior.relative_costs[ref])
        spread = math.hypot(prior.log_sd * abs(math.log2(b / ref)), guess.log_sd)
        value = look_value(best, centre, spread, guess)
        if value > highest:
            choice, highest = b, value
    return choice


def look_value(best: float, centre: float, spread: float, guess: EpochGuess) -> float:
    """Expected saving, within the run, of running a size whose mean cost here is
    log-normal (``centre``, ``spread``) instead of a run of the best (mean ``best``).

    A run whose cost is under ``best`` times the first epoch's cut-off ratio
    (``EPOCH_GUESS_Z`` run standard deviations of the other lanes' epochs: what its
    projection allows) runs to the target and saves ``best`` less its cost, or
    loses the difference; a dearer one is cut after its first epoch, which costs
    its cost over its epochs (the other lanes' mean).  ``spread`` is positive: both
    its parts have priors."""
    cut = math.log(best) + EPOCH_GUESS_Z * guess.run_log_sd
    z = (cut - centre) / spread
    mean = math.exp(centre + spread**2 / 2)
    finished = NORMAL.cdf(z - spread)  # E[C; C < cut] / E[C]
    kept = best * NORMAL.cdf(z) - mean * finished
    wasted = mean * (1 - finished) / math.exp(guess.log_mean)
    return kept - wasted
