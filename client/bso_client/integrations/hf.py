"""Hugging Face ``transformers``: a Trainer callback that drives a BatchSizeOptimizer.

Wiring (the batch size goes in through ``TrainingArguments``, so read it
before building them)::

    bso = BsoHfCallback(job, "redis://bso-host:6379/0", metric="accuracy")
    args = TrainingArguments(
        output_dir="out",
        per_device_train_batch_size=bso.per_device_train_batch_size,
        gradient_accumulation_steps=bso.gradient_accumulation_steps,
        eval_strategy="epoch",                  # one report per epoch
        num_train_epochs=job.max_epochs,
    )
    trainer = Trainer(model, args, train_dataset=..., eval_dataset=...,
                      compute_metrics=..., callbacks=[bso])
    with bso:                                    # ends the trial on error and SIGTERM
        trainer.train()

bso's batch size is the global batch (samples per optimizer step over every
device); the Trainer's ``per_device_train_batch_size`` is one device's pass,
and it accumulates ``gradient_accumulation_steps`` passes on each of
``world_size`` devices.  The two properties above translate, and the callback
refuses to train (``ValueError`` at ``on_train_begin``) when the arguments do
not multiply back to bso's size, rather than let bso learn from runs of
another size than it chose.

What the callback does, hook by hook:

* ``on_train_begin``: checks the batch arithmetic, then ``on_train_begin``
  (the measurement starts).
* ``on_evaluate``: reports the epoch with ``metrics[metric]`` (``eval_`` is
  prepended when the key lacks it, as the Trainer names its metrics) and sets
  ``control.should_training_stop`` when bso says stop.  Evaluations outside
  training (``trainer.evaluate()`` afterwards) are not reported.
* ``on_train_end``: ends the trial (once); a run bso stopped without
  convergence then raises :class:`~bso_client.errors.TrainFailError` out of
  ``train()``: relaunch.  Raised here, not where bso said stop, the Trainer
  first ends training as it would have: it saves that epoch's checkpoint,
  loads the best model (``load_best_model_at_end``) and tells the callbacks
  before this one (a W&B or MLflow run) that training ended.  The Trainer has
  no hook for an exception, hence the ``with`` block (``atexit`` is the last
  resort).

* ``on_save``: writes the run's :meth:`~bso_client.BatchSizeOptimizer.state_dict`
  as ``bso_state.json`` into the checkpoint folder the Trainer just saved (the
  epoch's evaluation, reported before the save, is in it).  To resume::

      checkpoint = get_last_checkpoint("out")   # transformers.trainer_utils
      bso = BsoHfCallback(job, url, metric="accuracy",
                          resume=BsoHfCallback.resume_state(checkpoint))
      ...
      trainer.train(resume_from_checkpoint=checkpoint)

  The run goes on with the checkpoint's trial and batch size (docs/client.md,
  "Notebooks, restarts and checkpoints").

One bso "epoch" is one evaluation: use ``eval_strategy="epoch"``.  Under
``torchrun``, the process group must exist before :attr:`batch_size` is read:
build a first ``TrainingArguments`` and touch ``args.device`` (which
initializes it), or call ``torch.distributed.init_process_group()`` yourself.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from functools import partial
from types import TracebackType
from typing import Any, Self

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from bso.spec import JobSpec
from bso_client.errors import TrainFailError
from bso_client.integrations.batch_check import check_global_batch, refuse_growth
from bso_client.optimizer import BatchSizeOptimizer

STATE_FILE = "bso_state.json"
"""The run's ``state_dict()`` in each checkpoint folder the Trainer saves."""

logger = logging.getLogger(__name__)


class BsoHfCallback(TrainerCallback):
    """Drives a :class:`~bso_client.BatchSizeOptimizer` from a ``transformers.Trainer``.

    Args:
        job, broker_url: as for :class:`~bso_client.BatchSizeOptimizer`.
        metric: the evaluation metric bso judges convergence by (a key of what
            ``compute_metrics`` returns, with or without ``eval_``); compared to
            the job's ``target_metric``.
        optimizer_options: the other keyword arguments of
            :class:`~bso_client.BatchSizeOptimizer` (``service``, ``monitor``, timeouts...).
    """

    def __init__(
        self,
        job: JobSpec | Mapping[str, Any],
        broker_url: str | None = None,
        *,
        metric: str,
        **optimizer_options: Any,
    ) -> None:
        self.metric = metric
        refuse_growth(optimizer_options)
        self._make = partial(BatchSizeOptimizer, job, broker_url, **optimizer_options)
        self._bso: BatchSizeOptimizer | None = None
        self._training = False
        self._stopped: TrainFailError | None = None
        """bso's stop without convergence, raised once the Trainer has ended training."""

    @property
    def bso(self) -> BatchSizeOptimizer:
        """The optimizer, created (and the job registered) on first use."""
        if self._bso is None:
            self._bso = self._make()
        return self._bso

    @property
    def batch_size(self) -> int:
        """The batch size of this run: the global batch, per optimizer step."""
        return self.bso.get_batch_size()

    @property
    def per_device_train_batch_size(self) -> int:
        """One device's pass: the ``TrainingArguments`` field of the same name."""
        return self.bso.micro_batch_size

    @property
    def gradient_accumulation_steps(self) -> int:
        """Passes per optimizer step: the ``TrainingArguments`` field of the same name."""
        return self.bso.accumulation_steps

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        check_global_batch(
            self.batch_size,
            args.per_device_train_batch_size,
            args.gradient_accumulation_steps,
            args.world_size,
            "per_device_train_batch_size=bso.per_device_train_batch_size, "
            "gradient_accumulation_steps=bso.gradient_accumulation_steps",
        )
        if args.eval_strategy == "no" and state.is_world_process_zero:
            logger.warning(
                "bso: the Trainer does not evaluate (eval_strategy='no', TrainingArguments' "
                "default), so bso gets no %r, learns nothing from this run and cannot stop "
                'it; set eval_strategy="epoch" (one bso epoch is one evaluation) with '
                "an eval_dataset and a compute_metrics that returns it",
                self.metric,
            )
        self.bso.on_train_begin()
        self._training = True

    def on_evaluate(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        metrics: Mapping[str, float] | None = None,
        **kwargs: Any,
    ) -> None:
        if not self._training:
            return
        bso = self.bso
        if not bso.training_finished:
            try:
                bso.on_evaluate(self._metric_value(metrics or {}))
            except TrainFailError as stop:
                self._stopped = stop
        if bso.training_finished:
            control.should_training_stop = True

    def on_train_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        self._training = False
        self.close()
        stopped, self._stopped = self._stopped, None
        if stopped is not None:
            raise stopped

    def on_save(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        bso = self._bso
        if bso is None or bso.batch_size is None or not state.is_world_process_zero:
            return
        if args.output_dir is None:
            return
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if os.path.isdir(folder):  # the Trainer saved it just before this hook
            with open(os.path.join(folder, STATE_FILE), "w", encoding="utf-8") as file:
                json.dump(bso.state_dict(), file)

    @staticmethod
    def resume_state(checkpoint: str | os.PathLike[str] | None) -> dict[str, Any] | None:
        """What to pass as ``resume=`` for a run resumed from ``checkpoint`` (a folder
        the Trainer saved, as given to ``train(resume_from_checkpoint=...)``); None
        when there is none or it holds no bso state (a new run then)."""
        if checkpoint is None:
            return None
        path = os.path.join(checkpoint, STATE_FILE)
        if not os.path.exists(path):
            return None
        with open(path, encoding="utf-8") as file:
            loaded: dict[str, Any] = json.load(file)
        return loaded

    def _metric_value(self, metrics: Mapping[str, float]) -> float:
        for key in (self.metric, f"eval_{self.metric}"):
            if key in metrics:
                return metrics[key]  # on_evaluate refuses what is not a number
        found = ", ".join(sorted(metrics)) or "nothing"
        raise KeyError(
            f"bso needs the metric {self.metric!r} from every evaluation, but it got {found}; "
            "return it from compute_metrics"
        )

    def close(self) -> None:
        """End the trial if it still runs (see :meth:`BatchSizeOptimizer.close`)."""
        self._training = False
        if self._bso is not None:
            self._bso.close()

    def __enter__(self) -> Self:
        """Within the block, the optimizer ends the trial on SIGTERM and on exit."""
        self.bso.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._training = False
        self.bso.__exit__(exc_type, exc, tb)
