"""Online batch growth: a schedule that grows a run's batch at epoch boundaries.

Early in training a small batch makes quick progress per sample; later, when
the gradient noise matters less, a larger batch takes the same steps for less
time and energy (the torchtune RFC in the seeds, after "Don't decay the
learning rate, increase the batch size").  :class:`BatchGrowth` is the one
rule both the client (which grows a live run) and ``bso simulate --growth``
(which replays it on traces) apply, so what the replay says is what a run does.

A grown run stays one trial: its cost is charged to the size it started at,
and bso learns which starting size is cheapest under the schedule.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class BatchGrowth:
    """Grow the batch every ``every_epochs`` epochs, by up to ``factor``, within the sizes.

    The next size is the largest candidate at most ``factor`` times the current
    one (and above it), never above ``max_batch_size`` (None: the largest
    candidate, i.e. the largest size that fits).  Candidates are the lane's
    batch sizes, so every size a run grows to is one the service accepts.
    """

    every_epochs: int = 1
    factor: float = 2.0
    max_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.every_epochs < 1:
            raise ValueError(f"every_epochs must be at least 1, got {self.every_epochs}")
        if not self.factor > 1.0:
            raise ValueError(f"factor must be above 1, got {self.factor}")
        if self.max_batch_size is not None and self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be positive, got {self.max_batch_size}")

    def size_after(self, epochs_done: int, current: int, sizes: Sequence[int]) -> int:
        """The batch size of the epoch after ``epochs_done`` epochs ran, the last at ``current``."""
        if epochs_done < 1 or epochs_done % self.every_epochs:
            return current
        ceiling = current * self.factor
        if self.max_batch_size is not None:
            ceiling = min(ceiling, self.max_batch_size)
        larger = [s for s in sizes if current < s <= ceiling]
        return max(larger, default=current)

    def schedule(self, start: int, sizes: Sequence[int], epochs: int) -> list[int]:
        """The batch size of each of ``epochs`` epochs of a run that starts at ``start``."""
        out = [start]
        while len(out) < epochs:
            out.append(self.size_after(len(out), out[-1], sizes))
        return out[:epochs]
