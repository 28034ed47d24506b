"""The batch size a run trains at right now: its split over devices, and online growth.

A trial starts at the size the service chose.  With a
:class:`~bso.core.growth.BatchGrowth` schedule it may grow at epoch
boundaries, to sizes of the job's own list (the service refuses others) below
the lane's memory limit; every epoch report then says which size the epoch ran
at, and an end says which size was running (an out-of-memory error is charged
to that size, not the one the trial started at).  Optimizers the script had
bso scale (:meth:`BatchSizeOptimizer.scale_lr`) are rescaled by the same rule
when the batch grows.
"""

from __future__ import annotations

import logging

from bso.core.growth import BatchGrowth
from bso.spec import BatchSplit, JobSpec, split_batch
from bso.wire.micro_batch_timings import MicroBatchTiming
from bso_client.lr import OptimizerLike, ScalingRule, grow_optimizer_lr, rule_for

logger = logging.getLogger(__name__)


class RunningBatch:
    """One trial's current batch size; see the module docstring."""

    def __init__(
        self,
        spec: JobSpec,
        start: int,
        growth: BatchGrowth | None,
        memory_limit: int | None = None,
    ) -> None:
        """``memory_limit``: the lane's smallest size that ran out of memory (bso
        status): growth stays below it."""
        self.spec = spec
        self.start = start
        self.current = start
        self.growth = growth
        self.sizes = [s for s in spec.batch_sizes if memory_limit is None or s < memory_limit]
        self._scaled: list[tuple[OptimizerLike, ScalingRule | str]] = []
        self.micro_batch: int | None = None
        """The micro-batch chosen for the starting size (:mod:`bso_client.micro_batch_run`);
        None: the lane's own split."""
        self.unsent_timings: list[MicroBatchTiming] | None = None
        """The run's micro-batch exploration until an epoch report has carried it."""
        self.explored = False
        """The run made its micro-batch exploration (once a run)."""

    @property
    def split(self) -> BatchSplit:
        """How the current size runs per device; a chosen micro-batch holds for the
        size it was chosen at (online growth returns to the lane's split)."""
        if self.micro_batch is not None and self.current == self.start:
            return split_batch(self.current, self.micro_batch, self.spec.devices)
        return self.spec.split(self.current)

    @property
    def reported_size(self) -> int | None:
        """What an epoch report says the epoch ran at: only sent when growth is on."""
        return self.current if self.growth is not None else None

    def track(self, optimizer: OptimizerLike, rule: ScalingRule | str | None) -> None:
        """Rescale ``optimizer`` too whenever the batch grows."""
        self._scaled.append((optimizer, rule_for(optimizer) if rule is None else rule))

    def after_epoch(self, epochs_done: int) -> bool:
        """Apply the schedule after ``epochs_done`` epochs; True if the batch grew."""
        if self.growth is None:
            return False
        grown = self.growth.size_after(epochs_done, self.current, self.sizes)
        if grown == self.current:
            return False
        for optimizer, rule in self._scaled:
            grow_optimizer_lr(optimizer, self.current, grown, rule)
        logger.info(
            "bso grows the batch from %d to %d after epoch %d (%s)",
            self.current,
            grown,
            epochs_done,
            "learning rate rescaled" if self._scaled else "learning rate untouched",
        )
        self.current = grown
        return True
