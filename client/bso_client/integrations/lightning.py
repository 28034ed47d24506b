"""PyTorch Lightning: a callback that drives a :class:`~bso_client.BatchSizeOptimizer`.

Wiring (the batch size goes in through the DataLoader, the reports come out
by themselves)::

    bso = BsoLightningCallback(job, "redis://bso-host:6379/0", metric="val_acc")

    class Model(pl.LightningModule):
        def train_dataloader(self):
            return DataLoader(train_set, batch_size=bso.micro_batch_size, shuffle=True)
        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
            bso.bso.scale_lr(optimizer)          # opt-in
            return optimizer

    with bso:                                    # SIGTERM ends the trial too
        pl.Trainer(max_epochs=job.max_epochs, callbacks=[bso]).fit(Model())

bso's batch size is the global batch (samples per optimizer step over every
device).  Each DDP process loads :attr:`micro_batch_size` samples per pass,
and the callback sets the Trainer's ``accumulate_grad_batches`` to
:attr:`accumulation_steps`, so that passes x accumulation x devices is bso's
size; a DataLoader of another batch size is refused (``ValueError`` at
``on_train_start``) rather than let bso learn from runs of another size.

What the callback does, hook by hook:

* ``setup`` (fit): creates the optimizer, i.e. registers the job, sets
  ``trainer.accumulate_grad_batches``, and has ``run_status`` watch it.  This
  runs after Lightning initialized ``torch.distributed``, so under DDP every
  rank gets the batch size rank 0 got.  Reading :attr:`batch_size` earlier
  creates it then (fine in a single process).
* ``on_train_start``: checks the batch arithmetic, then ``on_train_begin``
  (the measurement starts).
* ``on_train_epoch_end``: reports the epoch with ``trainer.callback_metrics
  [metric]``, the value logged during the epoch's validation (Lightning runs
  an epoch's validation before this hook), and sets ``trainer.should_stop``
  when bso says stop.
* ``on_fit_end``: a run bso stopped without convergence raises
  :class:`~bso_client.errors.TrainFailError` out of ``fit``: relaunch.  Raised
  here, not where bso said stop, Lightning first ends the epoch and training as
  it would have: the module's ``on_train_epoch_end`` and ``on_train_end`` run,
  and ``ModelCheckpoint`` (which Lightning runs after the other callbacks)
  saves that epoch.
* ``on_exception`` and ``teardown``: end the trial (once).
* ``state_dict``: the run's :meth:`~bso_client.BatchSizeOptimizer.state_dict`,
  which Lightning saves in every checkpoint; read it back with
  :meth:`BsoLightningCallback.resume_state` for ``resume=`` (Lightning restores
  a callback's state only after ``setup``, where the run already began)::

      bso = BsoLightningCallback(job, url, metric="val_acc",
                                 resume=BsoLightningCallback.resume_state(ckpt))
      checkpoints = ModelCheckpoint(..., save_on_train_epoch_end=True)
      pl.Trainer(callbacks=[bso, checkpoints]).fit(model, ckpt_path=ckpt)

  ``save_on_train_epoch_end=True`` saves after bso's report of the epoch; saved
  at the end of validation (``False``, or Lightning's default when it validates
  other than once an epoch), the state lags one epoch (it keeps that validation's
  metric), and the resumed ``fit`` ends that epoch again without validating it:
  ``on_train_epoch_end`` reports it with the kept metric when the run resumed
  with ``resume=``, else skips it, with one WARNING (``on_validation_end`` tells
  it from an epoch that logged no metric, whose ``KeyError`` stays).

One bso "epoch" is one Lightning training epoch; with ``val_check_interval``
below 1 the last validation of the epoch is the one reported.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from functools import partial
from types import TracebackType
from typing import Any, Self

import pytorch_lightning as pl
import torch

from bso.spec import JobSpec
from bso_client.errors import TrainFailError
from bso_client.integrations.batch_check import check_global_batch, refuse_growth
from bso_client.optimizer import BatchSizeOptimizer
from bso_client.run_status import RunStatus

logger = logging.getLogger(__name__)


class BsoLightningCallback(pl.Callback):
    """Drives a :class:`~bso_client.BatchSizeOptimizer` from a Lightning ``Trainer``.

    Args:
        job, broker_url: as for :class:`~bso_client.BatchSizeOptimizer`.
        metric: the logged metric bso judges convergence by (``self.log(metric, ...)``
            in ``validation_step``); compared to the job's ``target_metric``.
        run_status: a :class:`~bso_client.run_status.RunStatus` to watch the optimizer
            once the callback has created it in ``setup``: under DDP, calling
            ``watch`` before ``fit`` would create it before Lightning initialized
            ``torch.distributed`` (a ``DistributedSetupError``).
        optimizer_options: the other keyword arguments of
            :class:`~bso_client.BatchSizeOptimizer` (``service``, ``monitor``, timeouts...).
    """

    def __init__(
        self,
        job: JobSpec | Mapping[str, Any],
        broker_url: str | None = None,
        *,
        metric: str,
        run_status: RunStatus | None = None,
        **optimizer_options: Any,
    ) -> None:
        super().__init__()
        self.metric = metric
        self._run_status = run_status
        refuse_growth(optimizer_options)
        self._make = partial(BatchSizeOptimizer, job, broker_url, **optimizer_options)
        self._bso: BatchSizeOptimizer | None = None
        self._in_with = False
        self._stopped: TrainFailError | None = None
        """bso's stop without convergence, raised once Lightning has ended training."""
        self._validated = False
        """A validation ran in this process's fit (the sanity check aside)."""
        self._unreported = False
        """A validation ended whose epoch is not reported yet (a checkpoint saved now
        lags one epoch: :meth:`state_dict` keeps the metric)."""
        self._trainer: pl.Trainer | None = None
        self._restored_metric: float | None = None
        """The metric a lagging checkpoint kept, once Lightning restored this state."""

    @property
    def bso(self) -> BatchSizeOptimizer:
        """The optimizer, created (and the job registered) on first use."""
        if self._bso is None:
            self._bso = self._make()
            if self._in_with:
                self._bso.__enter__()
        return self._bso

    @property
    def batch_size(self) -> int:
        """The batch size of this run: the global batch, per optimizer step."""
        return self.bso.get_batch_size()

    @property
    def micro_batch_size(self) -> int:
        """One process's pass: the DataLoader's ``batch_size`` (read it in ``train_dataloader``)."""
        return self.bso.micro_batch_size

    @property
    def accumulation_steps(self) -> int:
        """Passes per optimizer step: what the callback sets ``accumulate_grad_batches`` to."""
        return self.bso.accumulation_steps

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._trainer = trainer
            trainer.accumulate_grad_batches = self.accumulation_steps
            if self._run_status is not None:
                self._run_status.watch(self.bso)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        per_pass = getattr(trainer.train_dataloader, "batch_size", None)
        if per_pass is not None:  # None: a custom batch sampler, nothing to compare
            check_global_batch(
                self.batch_size,
                per_pass,
                trainer.accumulate_grad_batches,
                trainer.world_size,
                "DataLoader(..., batch_size=bso.micro_batch_size) in train_dataloader",
            )
        self.bso.on_train_begin()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._validated = self._unreported = True

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        bso = self.bso
        if not bso.training_finished:  # min_epochs may keep Lightning going after a stop
            value: torch.Tensor | float | None = trainer.callback_metrics.get(self.metric)
            if value is None and not self._validated and trainer.ckpt_path is not None:
                value = self._replayed_epoch_end(trainer)
                if value is None:
                    return
            if value is None:
                logged = ", ".join(sorted(trainer.callback_metrics)) or "nothing"
                raise KeyError(
                    f"bso needs the metric {self.metric!r} at the end of every epoch, but "
                    f"the model logged {logged}; log it with self.log({self.metric!r}, ...)"
                )
            self._unreported = False
            try:
                bso.on_evaluate(value)  # a 0-d tensor; MetricTypeError for anything else
            except TrainFailError as stop:
                self._stopped = stop
        if bso.training_finished:
            trainer.should_stop = True

    def _replayed_epoch_end(self, trainer: pl.Trainer) -> float | None:
        """``fit(ckpt_path=...)`` from a checkpoint saved at the end of an epoch's
        validation (``save_on_train_epoch_end=False``, or several validations an epoch),
        before bso's report of that epoch, ends that epoch again without validating it.
        A resumed run reports it with the metric the checkpoint kept (its time went with
        the killed run), so that its epochs stay Lightning's; a new run's trial begins
        after it.  Returns the metric to report, or None: nothing to report."""
        resumed = self._make.keywords.get("resume") is not None
        value = self._restored_metric if resumed else None
        logger.warning(
            "bso: Lightning restored %s, saved at the end of epoch %d's validation, before "
            "bso's report of that epoch, and ends that epoch again without validating it: "
            "%s (checkpoint with ModelCheckpoint(save_on_train_epoch_end=True) to save "
            "after the report)",
            trainer.ckpt_path,
            trainer.current_epoch + 1,
            "bso does not count it for this run"
            if value is None
            else f"bso reports it with the metric that validation logged, {value:g}, and "
            "without its time, which went with the killed run",
        )
        return value

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        stopped, self._stopped = self._stopped, None
        if stopped is not None:
            raise stopped

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self.close(exception)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self.close()

    def state_dict(self) -> dict[str, Any]:
        """Saved by Lightning in each checkpoint: the run's state, once it has a size,
        and, saved after a validation whose epoch is not reported yet, its metric."""
        bso = self._bso
        if bso is None or bso.batch_size is None:
            return {}
        state: dict[str, Any] = {"bso": bso.state_dict()}
        value = self._trainer.callback_metrics.get(self.metric) if self._trainer else None
        if self._unreported and value is not None and value.numel() == 1:
            state["metric"] = float(value)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Lightning restores the state of the checkpoint ``fit`` resumes from."""
        metric = state_dict.get("metric")
        self._restored_metric = float(metric) if isinstance(metric, int | float) else None

    @staticmethod
    def resume_state(ckpt_path: str | os.PathLike[str] | None) -> dict[str, Any] | None:
        """What to pass as ``resume=`` for a run resumed with ``fit(ckpt_path=...)``; None
        when there is no checkpoint or it holds no bso state (a new run then)."""
        if ckpt_path is None or not os.path.exists(ckpt_path):
            return None
        checkpoint = torch.load(ckpt_path, map_location="cpu", weights_only=False, mmap=True)
        for key, value in checkpoint.get("callbacks", {}).items():
            if key.startswith(BsoLightningCallback.__qualname__) and isinstance(value, dict):
                state = value.get("bso")
                if isinstance(state, dict):
                    return state
        return None

    def close(self, exc: BaseException | None = None) -> None:
        """End the trial if it still runs, with the reason ``exc`` gives (see
        :meth:`BatchSizeOptimizer.close`)."""
        if self._bso is not None:
            self._bso.close(exc)

    def __enter__(self) -> Self:
        """Within the block, the optimizer ends the trial on SIGTERM and on exit.

        The optimizer is not created here but in ``setup``, once Lightning has
        initialized ``torch.distributed``; it enters the block then.
        """
        self._in_with = True
        if self._bso is not None:
            self._bso.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._in_with = False
        if self._bso is not None:
            self._bso.__exit__(exc_type, exc, tb)
