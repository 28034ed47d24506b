"""What a lane has learned, as ``bso status`` shows it: computed here, in the core.

The service reads the lane's stored trials into a snapshot and hands it over;
the outcomes come from :mod:`bso.core.outcomes`, the recommendation and its
confidence from :mod:`bso.core.confidence`.  The result is the read model of
:mod:`bso.status` that travels to callers.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from bso.core import budget
from bso.core.confidence import recommend
from bso.core.micro_batch import learned_choice, split_candidates
from bso.core.outcomes import Outcome, learning_view, outcome_of
from bso.core.policies import policy_for
from bso.core.state import JobSnapshot
from bso.core.transfer import LaneStart
from bso.core.vocabulary import TrialPhase
from bso.errors import NoFeasibleBatchSize
from bso.status import (
    HISTORY_LIMIT,
    BudgetStatus,
    LaneStatus,
    MicroBatchStatus,
    SizeStatus,
    StartStatus,
    TrialPoint,
    percent,
)


def lane_status(stored: JobSnapshot, start: LaneStart | None = None) -> LaneStatus:
    """Per-size outcomes of the stored trials, and the recommendation, which comes
    from the learning view (:mod:`bso.core.outcomes`) among the sizes still handed
    out; ``start``: what the lane started from, if another lane (:mod:`bso.core.transfer`)."""
    snapshot = learning_view(stored)
    all_means = snapshot.mean_costs()
    found = recommend(snapshot)
    chances = found.probability_best if found else {}
    sizes = []
    for b in sorted({t.batch_size for t in stored.trials}):
        outcomes = Counter(outcome_of(t).value for t in stored.trials if t.batch_size == b)
        sizes.append(
            SizeStatus(
                batch_size=b,
                trials=outcomes.total(),
                converged=outcomes[Outcome.CONVERGED],
                failed=outcomes[Outcome.FAILED],
                not_converged=outcomes.total()
                - outcomes[Outcome.CONVERGED]
                - outcomes[Outcome.RUNNING],
                outcomes=dict(sorted(outcomes.items())),
                mean_cost=all_means.get(b),
                probability_best=chances.get(b),
            )
        )
    ledger = budget.ledger(snapshot)
    exploiting = any(t.phase is TrialPhase.EXPLOITATION for t in stored.trials)
    stuck = no_feasible_size(stored)
    return LaneStatus(
        hardware=stored.hardware,
        stage="stuck" if stuck else "exploiting" if exploiting else "exploring",
        stuck=stuck,
        trials=len(stored.trials),
        running_trials=sum(t.running for t in stored.trials),
        detached_trials=sum(t.detached for t in stored.trials),
        memory_limit=snapshot.memory_limit,
        history=[
            TrialPoint(
                trial_number=t.trial_number,
                batch_size=t.batch_size,
                outcome=outcome_of(t).value,
                epochs=t.epochs,
                cost=t.cost,
                detached=t.detached,
            )
            for t in stored.trials[-HISTORY_LIMIT:]
        ],
        recommended_batch_size=found.batch_size if found else None,
        confidence=percent(found.confidence) if found else None,
        gain_over_default=found.gain_over_default if found else None,
        converged_sizes=found.converged_sizes if found else 0,
        expected_cost=found.expected_cost if found else None,
        sizes=sizes,
        batch_sizes=stored.spec.batch_sizes,
        default_batch_size=stored.spec.default_batch_size,
        started_from=StartStatus(
            from_lane=start.from_lane,
            recommended=start.recommended,
            batch_size=start.batch_size,
            converged_runs=start.converged_runs,
        )
        if start is not None and started_there(stored, start)
        else None,
        micro_batches=micro_batch_choices(stored),
        exploration_budget=None
        if ledger is None
        else BudgetStatus(
            budget=ledger.budget,
            baseline_batch_size=ledger.baseline_size,
            baseline_cost=ledger.baseline_cost,
            recurrences=ledger.converged_runs,
            used_runs=ledger.used,
            allowed_runs=ledger.allowed,
        ),
    )


def micro_batch_choices(stored: JobSnapshot) -> list[MicroBatchStatus]:
    """Per global batch that runs explored, the micro-batch their timings favour."""
    found = []
    for b in sorted({t.batch_size for t in stored.trials if t.micro_batches}):
        timings = stored.micro_batch_timings(b)
        choice = learned_choice(timings, split_candidates(stored.spec.split(b)))
        if choice is None:  # timings of micro-batches the lane's pass no longer allows
            continue
        found.append(
            MicroBatchStatus(
                batch_size=b,
                micro_batch_size=choice.micro_batch,
                confidence=choice.score,
                runs=len(stored.micro_batch_runs(b)),
                timed_steps=sum(t.steps for t in timings.values()),
            )
        )
    return found


def started_there(stored: JobSnapshot, start: LaneStart) -> bool:
    """Whether the lane's first run was at the size ``start`` transferred (a budget may
    have run the default first instead: :mod:`bso.core.budget`)."""
    return bool(stored.trials) and stored.trials[0].batch_size == start.batch_size


def no_feasible_size(stored: JobSnapshot) -> str | None:
    """Why the lane's next run would get ``NoFeasibleBatchSize`` (its message: what ruled
    each size out, and the way out), or None while it would get a size.  Asked of the
    job's policy as a trial request would (the draw's seed does not matter: only
    whether a size is left)."""
    try:
        policy_for(stored).assign(stored, np.random.default_rng(0))
    except NoFeasibleBatchSize as exc:
        return exc.message
    return None
