"""Zeus's call order, which :class:`~bso_client.optimizer.BatchSizeOptimizer` enforces.

One optimizer is one run, and its methods come in one order::

    get_batch_size -> on_train_begin -> on_evaluate (once per epoch)

with nothing after the trial ended, whether the service stopped it or the
script closed it.  A call out of that order is a bug in the training script, so
it raises :class:`~bso_client.errors.OperationOrderError` at once, saying what
to call instead, rather than sending the service an event it would refuse.
"""

from __future__ import annotations

from enum import Enum

from bso_client.errors import OperationOrderError


class Stage(Enum):
    REGISTERED = "registered"
    """The job is registered; no trial yet."""
    ASSIGNED = "assigned"
    """A trial and its batch size are known; training has not begun."""
    TRAINING = "training"
    """Between on_train_begin and the end of the trial."""
    ENDED = "ended"
    """The trial is over (stopped by the service, or ended by this client)."""


class CallOrder:
    """Where one run is in the call order, and the error for a call that breaks it."""

    def __init__(self) -> None:
        self.stage = Stage.REGISTERED
        self.stopped_by_service = False
        """True once the service stopped the trial (the optimizer's ``training_finished``)."""

    def stopped(self) -> None:
        """The service stopped the trial: the run is over."""
        self.stage = Stage.ENDED
        self.stopped_by_service = True

    def require(self, stage: Stage, method: str, rule: str) -> None:
        """Raise :class:`OperationOrderError` unless the run is at ``stage``.

        ``rule`` says when ``method`` may be called ("after get_batch_size,
        once"); a call after the end says instead how to notice the end.
        """
        if self.stage is stage:
            return
        if self.stage is Stage.ENDED:
            raise OperationOrderError(
                f"{method} called after the trial ended "
                f"({'stopped by the service' if self.stopped_by_service else 'closed'}); "
                "check training_finished after each on_evaluate and stop training"
            )
        raise OperationOrderError(
            f"{method} called out of order (stage: {self.stage.value}); call it {rule}"
        )
