"""What a size's run will likely take, in epochs to target, for bso's stops and revisits.

A run's cost per epoch is known after its first epoch; what is uncertain is how
many epochs it needs.  :mod:`bso.core.bso_policy` judges an exploration against
an optimistic bound on them (:func:`least_epochs`), finishes or cuts a smaller
size that overran it on their predicted distribution (:func:`epochs_to_target`),
and revisits a size that was only ever stopped as often as the guess of
:func:`revisit_guesses` says it may be the cheapest.  Each rests on the size's own
runs, the nearest converged size's epochs, or the epochs the job's other lanes
measured at it (:class:`~bso.core.state.EpochGuess`).
"""

from __future__ import annotations

import math
import statistics

from bso.core import bandit, confidence
from bso.core.size_evidence import EPOCHS_STEP_SD, SizeEvidence, cost_cv, nearest

# Epochs a larger batch may need fewer than the nearest smaller converged size's
# mean: epochs are integers, and a mean of one or two runs is off by about one.
UPWARD_EPOCH_SLACK = 1.0
# Epochs to target shrink at most like (batch ratio) ** this when the batch
# shrinks: halving the batch doubles the steps per epoch, and the steps needed to
# reach the target never fall as the batch falls (McCandlish et al. 2018), so at
# best (perfect scaling) epochs halve.  An optimistic bound must allow that: a
# tighter exponent (0.6 before) stopped smaller sizes that were truly cheaper on
# landscapes scaling almost perfectly, and the walk never went past them
# (edge-small-2 in docs/benchmarks.md).
EPOCH_SHRINK_EXPONENT = 1.0
# A size whose epochs another lane of the job measured (SizeEvidence.other_lane)
# is bounded below by that guess, this many standard deviations under it (one-sided
# 97.7%): a run is cut on another GPU's epochs only when they leave it little hope.
EPOCH_GUESS_Z = 2.0


def least_epochs(evidence: dict[int, SizeEvidence], batch_size: int) -> float | None:
    """Fewest epochs ``batch_size`` plausibly needs: an optimistic bound.

    Epochs to target do not shrink with larger batches (less one epoch of
    integer noise, ``UPWARD_EPOCH_SLACK``) and shrink at most like
    ``(ratio) ** EPOCH_SHRINK_EXPONENT`` when the batch shrinks, so the
    nearest other converged size bounds them.  Where the job's other lanes
    measured the size itself, their epochs bound it too, ``EPOCH_GUESS_Z``
    standard deviations under that guess, and so do the epochs their runs of it
    that bso stopped had run short of the target (the higher bound holds): an
    epoch's cost here is known after one epoch, so a size another GPU showed
    to be dear, or to need more epochs than it ran, is cut then.  The size's
    own mean is used when lower still: a re-measured size must not be cut
    short by the unlucky draw it is re-measured for.
    """
    others = [b for b, e in evidence.items() if e.epochs and b != batch_size]
    own = evidence[batch_size].epochs
    if not others:
        return statistics.fmean(own) if own else None
    ref = nearest(others, batch_size)
    ref_epochs = statistics.fmean(evidence[ref].epochs)
    if batch_size > ref:
        bound = max(1.0, ref_epochs - UPWARD_EPOCH_SLACK)
    else:
        bound = ref_epochs * (batch_size / ref) ** EPOCH_SHRINK_EXPONENT
    guess, floor = evidence[batch_size].other_lane, evidence[batch_size].other_lane_floor
    if guess is not None:
        bound = max(bound, math.exp(guess.log_mean - EPOCH_GUESS_Z * guess.run_log_sd))
    if floor is not None:
        bound = max(bound, floor.epochs * math.exp(-EPOCH_GUESS_Z * floor.log_sd))
    return min(bound, statistics.fmean(own)) if own else bound


def revisit_guesses(evidence: dict[int, SizeEvidence]) -> dict[int, bandit.Prediction]:
    """What sizes that were only ever stopped for cost may cost, for revisits.

    A stop is a projection: the size's cost per epoch is measured, its epochs
    were guessed.  Where the job's other lanes measured the size, its epochs
    are predicted as theirs, uncertain as :class:`~bso.core.state.EpochGuess`
    says, and never below what its longest stopped run proved (the bound that
    stopped it is statistical, not a floor).  Otherwise they are predicted as
    the nearest converged size's mean, uncertain by the run-to-run noise and
    by ``EPOCHS_STEP_SD`` per doubling of the batch between them, and never
    below what its longest stopped run proved nor below the optimistic bound
    of :func:`least_epochs` (the rule that stopped it: a larger size needs
    no fewer epochs than its neighbour less one, a smaller one at best fewer
    in proportion to the batch).  Exploitation draws from this like from any
    size, so a stop that was wrong is revisited as often as the size may be
    the cheapest.
    """
    converged = {b: e for b, e in evidence.items() if e.epochs}
    if not converged:
        return {}
    noise = math.log1p(cost_cv(converged))
    guesses = {}
    for b, e in evidence.items():
        if not e.only_stopped or e.hard_failures or not math.isfinite(e.epoch_cost):
            continue
        if e.other_lane is not None:
            guesses[b] = bandit.Prediction(
                log_median=math.log(e.epoch_cost) + e.other_lane.log_mean,
                log_sd=e.other_lane.log_sd,
                log_floor=math.log(e.epoch_cost * e.proven_epochs),
            )
            continue
        ref = nearest(converged, b)
        ref_epochs = statistics.fmean(converged[ref].epochs)
        doublings = abs(math.log2(b / ref))
        sd = math.sqrt(noise**2 / len(converged[ref].epochs) + EPOCHS_STEP_SD**2 * doublings)
        # Never fewer epochs than its stopped runs proved, nor than the
        # optimistic bound that stopped it.
        fewest = max(e.proven_epochs, least_epochs(evidence, b) or 1.0)
        guesses[b] = bandit.Prediction(
            log_median=math.log(e.epoch_cost * ref_epochs),
            log_sd=sd,
            log_floor=math.log(e.epoch_cost * fewest),
        )
    return guesses


def plausible_low(guess: bandit.Prediction, e: SizeEvidence) -> float:
    """The log cost a stopped size is judged by for a place in exploitation's draw:
    its predicted median, or, where the job's other lanes measured its epochs,
    ``EPOCH_GUESS_Z`` standard deviations under it.  Such a size was cut after
    its first epoch on a prediction that is itself that far under the median,
    and the walk does not retry a first-epoch cut (a deterministic per-epoch
    cost); without this, every such cut would be final (its median is then
    over the margin)."""
    if e.other_lane is None:
        return guess.log_median
    return max(guess.log_floor, guess.log_median - EPOCH_GUESS_Z * guess.log_sd)


def epochs_to_target(evidence: dict[int, SizeEvidence], batch_size: int) -> tuple[float, float]:
    """Mean and standard deviation of the log epochs a run of ``batch_size`` needs:
    around its own converged runs' mean, or else the mean of the job's other lanes
    at the size (with :class:`~bso.core.state.EpochGuess`'s uncertainty), or else
    the nearest converged size's moved by the prior slope of epochs per doubling
    (:data:`bso.core.confidence.EPOCH_SLOPE`), with the pooled run-to-run noise,
    the uncertainty of that mean and, for a neighbour's, ``EPOCHS_STEP_SD`` times
    the doublings between them (an unknown slope).  Needs a converged size."""
    converged = {b: e for b, e in evidence.items() if e.epochs}
    noise = math.log1p(cost_cv(converged))
    own, guess = evidence[batch_size].epochs, evidence[batch_size].other_lane
    if not own and guess is not None:
        return guess.log_mean, guess.run_log_sd
    ref = batch_size if own else nearest(converged, batch_size)
    runs = converged[ref].epochs
    doublings = abs(math.log2(batch_size / ref))
    slope = confidence.EPOCH_SLOPE[0]
    centre = statistics.fmean(math.log(n) for n in runs) + slope * math.log2(batch_size / ref)
    spread = math.sqrt(noise**2 * (1 + 1 / len(runs)) + (EPOCHS_STEP_SD * doublings) ** 2)
    return centre, spread
