"""Micro-batch timings between the core and the wire: the one translation.

The core keeps a candidate's counted steps as :class:`bso.core.micro_batch.Timings`;
events carry them as :class:`bso.wire.events.MicroBatchTiming` (the wire stands
on the core's vocabulary alone, so it cannot name the core's type).  The
service and the client both translate here.
"""

from __future__ import annotations

from collections.abc import Mapping

from bso.core.micro_batch import Timings
from bso.wire.micro_batch_timings import MicroBatchTiming


def timings_to_wire(timings: Mapping[int, Timings]) -> list[MicroBatchTiming] | None:
    """The core's timings as the events carry them; None for none."""
    return [
        MicroBatchTiming(micro_batch_size=m, steps=t.steps, mean_log_cost=t.mean, squares=t.squares)
        for m, t in sorted(timings.items())
    ] or None


def timings_from_wire(timings: list[MicroBatchTiming] | None) -> dict[int, Timings]:
    """The events' timings as the core reads them; empty for None."""
    return {t.micro_batch_size: Timings(t.steps, t.mean_log_cost, t.squares) for t in timings or []}
