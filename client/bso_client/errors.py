"""Typed errors the training-loop client raises, on top of :mod:`bso.errors`.

Errors that come back from the service keep their :mod:`bso.errors` type
(:class:`~bso.errors.ConfigMismatch`, :class:`~bso.errors.ServiceUnavailable`
with its timeout in the message, ...), re-exported here so that a training
script needs one import.  The classes defined here are the client's own:

* :class:`OperationOrderError`: the script called the optimizer out of order
  (Zeus's ``ZeusBSOOperationOrderError``).  A subclass of
  :class:`~bso.errors.OutOfOrder`, the service's error for the same mistake
  seen from its side, so one ``except OutOfOrder`` catches both.
* :class:`TrainFailError`: the service stopped this run before it reached the
  target metric (Zeus's ``ZeusBSOTrainFailError``); the script should exit and
  the job be relaunched, which gets the next batch size.
* :class:`MetricTypeError`: ``on_evaluate`` got something that is not a number
  (a string, None, a dict of metrics); also a ``TypeError``.
* :class:`DistributedSetupError` and :class:`RankZeroError`: the multi-process
  cases, see :mod:`bso_client.distributed`.
* :class:`MixedGpuModels` and :class:`NoBatchSizeFits`: the job cannot run as
  configured on this hardware (subclasses of :class:`~bso.errors.InvalidSpec`).
* :class:`NvmlUnavailableError` and :class:`RaplUnavailableError`: an energy
  source cannot measure here (:mod:`bso_client.energy`).  Plain
  ``RuntimeError`` subclasses, not bso errors: the job is fine, and
  :func:`~bso_client.energy.detect.detect_monitor` falls back to the next
  source unless the caller asked for GPUs.

Every error survives pickling with its message and fields intact, because in
distributed training rank 0 hands the exception it got to the other ranks
(:func:`bso_client.distributed.on_rank_zero`) and they raise the same one.
"""

from __future__ import annotations

from typing import Any

from bso.core.vocabulary import StopReason
from bso.errors import (
    BsoError,
    ConfigMismatch,
    InvalidSpec,
    NoFeasibleBatchSize,
    OutOfOrder,
    ServiceUnavailable,
    UnknownJob,
)

__all__ = [
    "BsoError",
    "ConfigMismatch",
    "DistributedSetupError",
    "InvalidSpec",
    "MetricTypeError",
    "MixedGpuModels",
    "NoBatchSizeFits",
    "NoFeasibleBatchSize",
    "NvmlUnavailableError",
    "OperationOrderError",
    "OutOfOrder",
    "RankZeroError",
    "RaplUnavailableError",
    "ServiceUnavailable",
    "TrainFailError",
    "UnexpectedBatchSize",
    "UnknownJob",
]


class OperationOrderError(OutOfOrder):
    """The optimizer's methods were called in an order it does not allow.

    The order is ``get_batch_size`` -> ``on_train_begin`` -> ``on_evaluate``
    once per epoch, and nothing after the trial ended.
    """


class TrainFailError(BsoError):
    """The service stopped this trial without convergence: relaunch the job.

    Not a bug in the script: bso stops a run whose batch size already costs
    more than it is worth (or that hit ``max_epochs``), records it as failed,
    and hands out another batch size the next time the job runs.  The fields
    carry the service's verdict for logs and dashboards.
    """

    code = "train_failed"

    def __init__(
        self,
        job_id: str,
        trial_number: int,
        batch_size: int,
        reason: StopReason | None,
        service_message: str,
    ) -> None:
        why = reason.value if reason is not None else "stopped"
        detail = f": {service_message}" if service_message else ""
        super().__init__(
            f"bso stopped trial {trial_number} of job {job_id} (batch size {batch_size}) "
            f"before it converged ({why}{detail}). This run is over: exit and launch the job "
            "again, and bso will try another batch size."
        )
        self.job_id = job_id
        self.trial_number = trial_number
        self.batch_size = batch_size
        self.reason = reason
        self.service_message = service_message

    def __reduce__(self) -> tuple[Any, ...]:
        args = (self.job_id, self.trial_number, self.batch_size, self.reason, self.service_message)
        return (type(self), args)


class UnexpectedBatchSize(BsoError):
    """The service handed out a batch size that is not among the job's ``batch_sizes``.

    Never expected; the client refuses to train with it rather than trust it, and
    ends the trial as interrupted (not the size's fault).
    """

    code = "unexpected_batch_size"

    def __init__(self, job_id: str, trial_number: int, batch_size: int) -> None:
        super().__init__(
            f"bso assigned batch size {batch_size} to trial {trial_number} of job {job_id}, "
            "which is not one of the job's batch_sizes: refusing it (a bug in the service; "
            "please report it with this message)"
        )
        self.job_id = job_id
        self.trial_number = trial_number
        self.batch_size = batch_size

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.job_id, self.trial_number, self.batch_size))


class MetricTypeError(BsoError, TypeError):
    """``on_evaluate`` was given something that is not one number: a string, None,
    a dict of metrics, a tensor of several values.

    A :class:`TypeError` too (what ``float(None)`` raised before), so code that
    caught that still catches it.  The message says what was expected and what
    came (its type, never its contents beyond a short string).
    """

    code = "metric_type"


class DistributedSetupError(BsoError):
    """The environment says several processes train together, but they cannot talk.

    Raised when ``WORLD_SIZE`` is above 1 while ``torch.distributed`` is not
    initialized: only rank 0 may ask the service for a batch size, so without
    a process group the other ranks could never learn it.
    """

    code = "distributed_setup"


class RankZeroError(BsoError):
    """Rank 0 failed with an error that is not a bso error; other ranks raise this.

    Rank 0 itself raises the original exception; its type and message are
    carried here so that every rank stops, and says why.
    """

    code = "rank_zero_error"


class MixedGpuModels(InvalidSpec):
    """The job's GPUs are not all of one model.

    bso learns one cost per batch size and hardware model, and a trial's cost
    on mixed GPUs belongs to neither model.
    """


class NoBatchSizeFits(InvalidSpec):
    """Not even the smallest batch size tried fits in memory: the job cannot run as is.

    A subclass of :class:`~bso.errors.InvalidSpec` because no batch size list
    would make this job usable on this hardware; the fix is elsewhere (a
    smaller model, mixed precision, activation checkpointing, more memory).
    ``batch_size`` is the size that failed; the out-of-memory error is chained
    as ``__cause__``.
    """

    def __init__(self, batch_size: int, detail: str = "") -> None:
        why = f" ({detail})" if detail else ""
        super().__init__(
            f"even batch size {batch_size} does not fit in memory: one training step at that "
            f"size ran out of memory{why}. Reduce the model's memory use (mixed precision, "
            "activation checkpointing, a smaller model) or use a device with more memory"
            + ("; or start the search at a smaller batch size." if batch_size > 1 else ".")
        )
        self.batch_size = batch_size
        self.detail = detail

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.batch_size, self.detail))


class NvmlUnavailableError(RuntimeError):
    """NVML cannot measure this job: no pynvml, no driver, no GPU visible, or MIG."""


class RaplUnavailableError(RuntimeError):
    """No CPU package energy counter can be read under the powercap root."""
