"""The wire form of a run's micro-batch exploration (the timings an
:class:`~bso.wire.events.EpochReport` carries and a
:class:`~bso.wire.events.TrialAssigned` returns summed), with the bounds that keep
every figure a finite float; :mod:`bso.micro_batch_wire` translates them to and
from :class:`bso.core.micro_batch.Timings`."""

from __future__ import annotations

from typing import Annotated, Self

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from bso.spec import MAX_BATCH_SIZE, MAX_SQL_INT

MAX_MICRO_BATCH_TIMINGS = 256
"""Candidates one exploration may report: the divisors of a per-device batch of
up to 2^31 number at most 1,600, and a run times a few of them."""
MAX_LOG_COST = 60.0
"""Bound on a mean log cost per sample (joules, or joule-equivalents, per sample):
e^-60 to e^60 spans 1e-26 to 1e26, far past any real step, and the ratio of two
such costs (a performance, e^120) stays a finite float."""
MAX_TIMED_STEPS = 1_000_000
"""Counted steps one run may report per micro-batch: a run of 50 million steps
exploring for 2% of them."""
MAX_SQUARES = 1e12
"""Bound on a sum of squared log deviations: steps x (2 x MAX_LOG_COST)^2 over the
runs a lane keeps (:data:`bso.core.micro_batch.KEPT_RUNS`, 20 x 1e6 x 14,400 =
2.9e11) stays below it."""


class MicroBatchTiming(BaseModel):
    """One candidate micro-batch of a run's exploration: its counted steps as
    :class:`bso.core.micro_batch.Timings` keeps them (log cost per sample;
    :mod:`bso.micro_batch_wire` translates)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    micro_batch_size: Annotated[int, Field(ge=1, le=MAX_BATCH_SIZE)]
    steps: Annotated[int, Field(ge=1, le=MAX_SQL_INT)]
    """At most :data:`MAX_TIMED_STEPS` from one run (:class:`EpochReport`); the sum of
    the runs a lane keeps (:class:`TrialAssigned`, at most
    :data:`bso.core.micro_batch.KEPT_RUNS` runs) stays below 2^31."""
    mean_log_cost: Annotated[float, Field(ge=-MAX_LOG_COST, le=MAX_LOG_COST, allow_inf_nan=False)]
    squares: Annotated[float, Field(ge=0, le=MAX_SQUARES, allow_inf_nan=False)] = 0.0
    """Sum of the steps' squared deviations from the mean (log scale); 0 for one step."""

    @model_validator(mode="after")
    def _spread_within_the_bounds(self) -> Self:
        """Steps whose log costs lie within :data:`MAX_LOG_COST` deviate from their
        mean by at most twice it (and one step not at all)."""
        if self.squares > (self.steps - 1) * (2 * MAX_LOG_COST) ** 2:
            raise ValueError(
                f"squares {self.squares} is more than {self.steps} steps of log costs within "
                f"+-{MAX_LOG_COST:g} can spread (0 for one step)"
            )
        return self


def _distinct_micro_batches(value: list[MicroBatchTiming]) -> list[MicroBatchTiming]:
    sizes = [t.micro_batch_size for t in value]
    if len(set(sizes)) != len(sizes):
        raise ValueError("each micro_batch_size may appear once")
    return value


def one_run(value: list[MicroBatchTiming] | None) -> list[MicroBatchTiming] | None:
    if value is not None and any(t.steps > MAX_TIMED_STEPS for t in value):
        raise ValueError(f"one run reports at most {MAX_TIMED_STEPS} timed steps per micro-batch")
    return value


MicroBatchTimings = Annotated[
    list[MicroBatchTiming],
    Field(min_length=1, max_length=MAX_MICRO_BATCH_TIMINGS),
    AfterValidator(_distinct_micro_batches),
]
