"""What a trial's epochs cost so far, in time and energy, summed over the job's ranks.

After every epoch the optimizer reports the trial's elapsed time and energy
since ``on_train_begin``.  Each measuring rank (``energy_scope``, see
:mod:`bso_client.distributed`) has an energy monitor; at each epoch's end every
rank's energy is all-gathered and summed, and the elapsed time is the rank's
own (rank 0's is the one sent).  An epoch's window closes when ``on_evaluate``
is called and the next one opens once the service answered, so the time spent
waiting for bso is not counted as training.

When the report fails (service unreachable) and the script calls
``on_evaluate`` again, the measurement taken the first time is reported again
rather than taken anew: the retry is the same event, with the same figures.
"""

from __future__ import annotations

from typing import NamedTuple

from bso_client.distributed import Collective
from bso_client.energy.base import EnergyMonitor

WINDOW = "bso-epoch"
"""Name of the optimizer's measurement window, apart from any the user opens."""


class TrialTotals(NamedTuple):
    """A trial's figures up to the end of epoch ``epoch``, as reported to the service."""

    epoch: int
    time_s: float
    energy_j: float


class EpochMeter:
    """A trial's totals so far, and the next epoch's until the service has them.

    ``monitor`` is this rank's (None on a rank that does not measure); the
    meter opens and closes its own window on it and never closes the monitor.
    """

    def __init__(self, collective: Collective, monitor: EnergyMonitor | None) -> None:
        self._collective = collective
        self._monitor = monitor
        self._reported = TrialTotals(0, 0.0, 0.0)
        self._pending: TrialTotals | None = None
        self._carried = (0.0, 0.0)

    @property
    def epochs(self) -> int:
        """Epochs reported so far."""
        return self._reported.epoch

    @property
    def totals(self) -> TrialTotals:
        """The trial's totals the service has (what a checkpoint saves)."""
        return self._reported

    def resume(self, totals: TrialTotals) -> None:
        """Go on from a checkpoint's totals: the next epoch is the one after them, and
        time and energy add to them (:mod:`bso_client.resume`)."""
        self._reported = totals

    def start_epoch(self) -> None:
        """Open the next epoch's window."""
        if self._monitor is not None:
            self._monitor.begin_window(WINDOW)

    def carry(self, time_s: float, energy_j: float) -> None:
        """Training done before the first epoch's window opened (a micro-batch
        exploration run before ``on_train_begin``): counted in the next epoch.
        ``energy_j`` is the job's (every rank's, summed already)."""
        self._carried = (self._carried[0] + time_s, self._carried[1] + energy_j)

    def end_epoch(self) -> TrialTotals:
        """The totals with the epoch that just ended; measured once, whatever the retries.

        Collective the first time (every rank's energy is gathered): every
        rank must call it.
        """
        if self._pending is None:
            elapsed_s, energy_j = (
                (0.0, 0.0) if self._monitor is None else self._monitor.end_window(WINDOW)
            )
            energies = self._collective.all_gather(energy_j)
            carried_s, carried_j = self._carried
            self._carried = (0.0, 0.0)
            self._pending = TrialTotals(
                self._reported.epoch + 1,
                self._reported.time_s + elapsed_s + carried_s,
                self._reported.energy_j + sum(energies) + carried_j,
            )
        return self._pending

    def reported(self) -> None:
        """The service has the totals :meth:`end_epoch` gave: they are the trial's now."""
        assert self._pending is not None
        self._reported, self._pending = self._pending, None
