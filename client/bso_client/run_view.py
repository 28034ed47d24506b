"""What a training script reads off its optimizer: the run's trial, size and state.

:class:`RunView` is the read-only half of
:class:`~bso_client.optimizer.BatchSizeOptimizer` (its base class): properties
over the state the optimizer keeps, apart from the calls that change it, and
:meth:`RunView.scale_lr`, which only follows the running batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bso.spec import Hardware, JobSpec
from bso.wire.events import TrialAssigned
from bso_client.call_order import CallOrder
from bso_client.distributed import Collective
from bso_client.energy.base import EnergyMonitor
from bso_client.epoch_meter import EpochMeter
from bso_client.errors import OperationOrderError
from bso_client.lr import OptimizerLike, ScalingRule, scale_optimizer_lr
from bso_client.resume import Checkpoint, state
from bso_client.running_batch import RunningBatch
from bso_client.shutdown import SigtermHandler


class RunView:
    """The properties a script reads; the optimizer sets the state they read."""

    spec: JobSpec
    job_id: str | None
    hardware: Hardware
    _resume: Checkpoint | None
    _collective: Collective
    _trial: TrialAssigned | None
    _batch: int | None
    _detached: bool
    _running: RunningBatch | None
    _order: CallOrder
    _meter: EpochMeter
    _monitor: EnergyMonitor | None
    _closed: bool
    _in_block: bool
    _sigterm: SigtermHandler

    def on_sigterm(self, hook: Callable[[], None]) -> None:
        """Also call ``hook`` when SIGTERM ends the run inside the optimizer's ``with``
        block, once the trial is ended and before the process dies of the signal
        (:class:`~bso_client.run_status.RunStatus` writes its file there)."""
        self._sigterm.also(hook)

    def state_dict(self) -> dict[str, Any]:
        """This run's part of a checkpoint, as plain JSON values: the job, the trial,
        its batch size and lane, and the epochs, time and energy reported so far.  Save
        it with the model's; pass it back as ``resume=`` to go on with the trial."""
        if self._batch is None:
            raise OperationOrderError("state_dict() comes after get_batch_size()")
        job_id = self.job_id or (self._resume.job_id if self._resume else "")
        return state(job_id, self.trial_number, self._batch, self.hardware, self._meter.totals)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran: the trial was ended, the connections released."""
        return self._closed

    @property
    def in_block(self) -> bool:
        """Whether the run is inside the optimizer's ``with`` block, whose end closes it
        whatever happens: no run of the job in this thread is a leftover of it then."""
        return self._in_block

    @property
    def rank(self) -> int:
        return self._collective.rank

    @property
    def world_size(self) -> int:
        return self._collective.world_size

    @property
    def trial_number(self) -> int | None:
        """This run's trial number, once :meth:`get_batch_size` got it."""
        return self._trial.trial_number if self._trial else None

    @property
    def batch_size(self) -> int | None:
        """This run's batch size, once :meth:`get_batch_size` got it."""
        return self._batch

    @property
    def detached(self) -> bool:
        """Whether this run lost the service and goes on detached (:mod:`bso_client.fail_open`)."""
        return self._detached

    # The sizes a DataLoader is built with.  Each asks for the run's batch size first
    # when get_batch_size() was not called yet: answering None would give
    # DataLoader(batch_size=None), which silently trains one sample at a time.

    @property
    def current_batch_size(self) -> int:
        """The batch size of the epoch about to run: :attr:`batch_size` unless it grew."""
        return self._running_batch().current

    @property
    def per_device_batch_size(self) -> int:
        """Samples each data-parallel device takes per optimizer step, now."""
        return self._running_batch().split.per_device

    @property
    def micro_batch_size(self) -> int:
        """Samples per device per forward/backward pass, now: the DataLoader's batch size."""
        return self._running_batch().split.micro_batch_size

    @property
    def accumulation_steps(self) -> int:
        """Passes per optimizer step, now: accumulate their gradients, then step."""
        return self._running_batch().split.accumulation_steps

    def _running_batch(self) -> RunningBatch:
        if self._running is None:
            self.get_batch_size()
        assert self._running is not None, "get_batch_size sets the running batch"
        return self._running

    def get_batch_size(self) -> int:  # the optimizer's: it asks the service
        raise NotImplementedError

    def scale_lr(self, optimizer: OptimizerLike, rule: ScalingRule | str | None = None) -> float:
        """Opt-in: scale ``optimizer``'s learning rates from the default batch size to this run's.

        Linear for SGD-family, square root for Adam-family (see
        :mod:`bso_client.lr`); returns the factor.  Call it after
        :meth:`get_batch_size` and before creating an LR scheduler.  With
        ``growth``, the optimizer is rescaled by the same rule whenever the
        batch grows.
        """
        batch_size = self.get_batch_size()
        factor = scale_optimizer_lr(optimizer, batch_size, self.spec.default_batch_size, rule)
        assert self._running is not None
        self._running.track(optimizer, rule)
        return factor

    @property
    def training_finished(self) -> bool:
        """True once the service stopped the trial (converged or not): stop training.
        Detached, only the target metric or ``max_epochs`` turn it True."""
        return self._order.stopped_by_service

    @property
    def epoch(self) -> int:
        """Epochs reported so far."""
        return self._meter.epochs

    @property
    def monitor(self) -> EnergyMonitor | None:
        """This rank's energy monitor; None on ranks that do not measure."""
        return self._monitor
