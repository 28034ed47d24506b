"""The Lightning and Hugging Face callbacks, driving real trainers on CPU.

The models are tiny (a linear layer on 64 random samples) so that each fit
takes a second or two; what matters is the trainer's real hook order.  The
metric each validation reports is scripted (0.1 after epoch 1, 0.2 after
epoch 2, ...) so the epoch at which bso says stop is known in advance.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset
from transformers import EvalPrediction, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

from bso.core.vocabulary import StopReason, TrialStatus
from bso.spec import JobSpec
from bso_client.discovery import Discovery
from bso_client.energy.time_only import TimeOnlyMonitor
from bso_client.errors import TrainFailError
from bso_client.integrations.batch_check import check_global_batch
from bso_client.integrations.hf import BsoHfCallback
from bso_client.integrations.lightning import BsoLightningCallback
from bso_client.run_status import RunStatus
from tests.test_optimizer import RecordingService

SPEC = JobSpec(
    job_id="job",
    batch_sizes=[8, 16, 32],
    default_batch_size=16,
    target_metric=0.3,
    max_epochs=10,
    mab_seed=1,
)


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny models on a shared CI box: threads only add contention."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def reported(service: RecordingService) -> list[float]:
    return [kw["metric"] for m, _, kw in service.calls if m == "report_epoch"]


# -- Lightning --------------------------------------------------------------------------


class ScriptedModule(pl.LightningModule):
    """Logs ``score`` = epoch / 10; optionally fails in training epoch ``fail_in_epoch``."""

    def __init__(
        self,
        bso: BsoLightningCallback,
        fail_in_epoch: int | None = None,
        loader_size: str = "micro_batch_size",
    ) -> None:
        super().__init__()
        self.bso = bso
        self.loader_size = loader_size
        self.fail_in_epoch = fail_in_epoch
        self.net = nn.Linear(4, 2)
        self.data = TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
        self.loader_batch_size: int | None = None
        self.epoch_ends = 0
        self.train_ended = False

    def on_train_epoch_end(self) -> None:
        self.epoch_ends += 1

    def on_train_end(self) -> None:
        self.train_ended = True

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
        if self.current_epoch + 1 == self.fail_in_epoch:
            raise RuntimeError("CUDA out of memory")
        inputs, labels = batch
        loss: torch.Tensor = nn.functional.cross_entropy(self.net(inputs), labels)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> None:
        self.log("score", (self.current_epoch + 1) / 10)

    def train_dataloader(self) -> DataLoader[Any]:
        self.loader_batch_size = getattr(self.bso, self.loader_size)
        return DataLoader(self.data, batch_size=self.loader_batch_size)

    def val_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.data, batch_size=64)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def lightning_trainer(bso: BsoLightningCallback, **options: Any) -> pl.Trainer:
    options.setdefault("max_epochs", 10)
    return pl.Trainer(
        accelerator="cpu",
        callbacks=[bso],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **options,
    )


def lightning_callback(
    service: RecordingService, spec: JobSpec = SPEC, metric: str = "score"
) -> BsoLightningCallback:
    return BsoLightningCallback(
        spec, service=service, metric=metric, monitor=TimeOnlyMonitor(), environ={}
    )


def test_lightning_stops_when_bso_says_converged() -> None:
    service = RecordingService()
    bso = lightning_callback(service)
    module = ScriptedModule(bso)
    trainer = lightning_trainer(bso)
    trainer.fit(module)
    assert module.loader_batch_size == bso.batch_size == 16
    assert trainer.current_epoch == 3  # of max_epochs=10
    assert reported(service) == pytest.approx([0.1, 0.2, 0.3])
    assert bso.bso.training_finished
    assert service.trial(1).status is TrialStatus.CONVERGED
    assert "end_trial" not in service.methods()


def test_lightning_min_epochs_past_the_stop_reports_nothing_more() -> None:
    service = RecordingService()
    bso = lightning_callback(service)
    trainer = lightning_trainer(bso, min_epochs=5)
    trainer.fit(ScriptedModule(bso))
    assert trainer.current_epoch == 5
    assert len(reported(service)) == 3


def test_lightning_run_stopped_unconverged_raises_train_fail_error() -> None:
    """Out of fit, once Lightning has ended the epoch and training as it would have:
    the module's epoch-end and train-end hooks ran (raised where bso said stop, the
    epoch's own were skipped, and ModelCheckpoint's save of it)."""
    service = RecordingService()
    bso = lightning_callback(service, SPEC.model_copy(update={"max_epochs": 2}))
    module = ScriptedModule(bso)
    with pytest.raises(TrainFailError, match="launch the job again"):
        lightning_trainer(bso).fit(module)
    assert (module.epoch_ends, module.train_ended) == (2, True)
    assert service.trial(1).stop_reason is StopReason.MAX_EPOCHS
    assert "end_trial" not in service.methods()


def test_lightning_run_status_watches_the_optimizer_the_callback_creates_in_setup(
    tmp_path: Path,
) -> None:
    """Passed to the callback, the RunStatus watches the optimizer once setup created it
    (under DDP, after Lightning initialized torch.distributed): nothing is created
    before fit, and the file says how the run ended."""
    service = RecordingService()
    status = RunStatus(tmp_path / "run-status.json")
    bso = BsoLightningCallback(
        SPEC, service=service, metric="score", monitor=TimeOnlyMonitor(), environ={},
        run_status=status,
    )  # fmt: skip
    with status, bso:
        assert bso._bso is None  # not created before fit
        lightning_trainer(bso).fit(ScriptedModule(bso))
    written = json.loads((tmp_path / "run-status.json").read_text())
    assert (written["outcome"], written["trial_number"]) == ("converged", 1)


def test_lightning_exception_ends_the_trial_once() -> None:
    service = RecordingService()
    bso = lightning_callback(service)
    trainer = lightning_trainer(bso)
    with pytest.raises(RuntimeError, match="out of memory"), bso:
        trainer.fit(ScriptedModule(bso, fail_in_epoch=2))
    assert reported(service) == pytest.approx([0.1])
    assert service.methods().count("end_trial") == 1
    assert service.trial(1).stop_reason is StopReason.OUT_OF_MEMORY


def test_lightning_missing_metric_names_what_was_logged() -> None:
    bso = lightning_callback(RecordingService(), metric="val_acc")
    with pytest.raises(KeyError, match="logged score"):
        lightning_trainer(bso).fit(ScriptedModule(bso))


# -- Hugging Face -----------------------------------------------------------------------


class Pairs(Dataset[dict[str, torch.Tensor]]):
    def __init__(self, size: int = 64) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(size, 4, generator=generator)
        self.labels = torch.randint(0, 2, (size,), generator=generator)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[index], "labels": self.labels[index]}


class TinyClassifier(nn.Module):
    """What the Trainer expects of a model: a dict with the loss and the logits."""

    def __init__(self, fail_after_steps: int | None = None) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 2)
        self.fail_after_steps = fail_after_steps
        self.steps = 0

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.training:
            self.steps += 1
            if self.fail_after_steps is not None and self.steps > self.fail_after_steps:
                raise RuntimeError("CUDA out of memory")
        logits = self.linear(x)
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


class ScriptedScore:
    """``compute_metrics`` returning 0.1, 0.2, ... at successive evaluations."""

    def __init__(self) -> None:
        self.evaluations = 0

    def __call__(self, prediction: EvalPrediction) -> dict[str, float]:
        self.evaluations += 1
        return {"score": self.evaluations / 10}


def hf_trainer(
    bso: BsoHfCallback,
    output_dir: Path,
    model: nn.Module | None = None,
    per_pass: int | None = None,
    before: Sequence[TrainerCallback] = (),
    *,
    eval_strategy: str = "epoch",
) -> Trainer:
    args = TrainingArguments(
        output_dir=str(output_dir),
        per_device_train_batch_size=per_pass or bso.per_device_train_batch_size,
        gradient_accumulation_steps=bso.gradient_accumulation_steps,
        num_train_epochs=10,
        eval_strategy=eval_strategy,
        save_strategy="no",
        logging_strategy="no",
        report_to=[],
        disable_tqdm=True,
        use_cpu=True,
    )
    return Trainer(
        model=model or TinyClassifier(),
        args=args,
        train_dataset=Pairs(),
        eval_dataset=Pairs(),
        compute_metrics=ScriptedScore(),
        callbacks=[*before, bso],
    )


def hf_callback(
    service: RecordingService, spec: JobSpec = SPEC, metric: str = "score"
) -> BsoHfCallback:
    return BsoHfCallback(
        spec, service=service, metric=metric, monitor=TimeOnlyMonitor(), environ={}
    )


def test_hf_trainer_stops_when_bso_says_converged(tmp_path: Path) -> None:
    service = RecordingService()
    bso = hf_callback(service)
    trainer = hf_trainer(bso, tmp_path)
    assert trainer.args.per_device_train_batch_size == 16
    with bso:
        trainer.train()
    assert trainer.state.epoch == 3  # of num_train_epochs=10
    assert reported(service) == pytest.approx([0.1, 0.2, 0.3])
    assert service.trial(1).status is TrialStatus.CONVERGED
    trainer.evaluate()  # after training: not an epoch of the trial
    assert len(reported(service)) == 3
    assert "end_trial" not in service.methods()


def test_a_trainer_that_never_evaluates_is_told_so_when_training_begins(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """TrainingArguments' default eval_strategy is "no": bso gets no metric, learns
    nothing from the run, and the one line a user saw was, at its end, "training ended
    after 0 epoch(s) ... does the loop run job.max_epochs epochs", which names a fix
    for a hand-written loop.  One WARNING now names eval_strategy="epoch" when
    training begins, and the run still trains to its end."""
    service = RecordingService()
    bso = hf_callback(service)
    trainer = hf_trainer(bso, tmp_path, eval_strategy="no")
    with caplog.at_level(logging.WARNING, "bso_client"), bso:
        trainer.train()
    assert trainer.state.epoch == 10  # trained to num_train_epochs
    hf = "bso_client.integrations.hf"
    [warning] = [r.getMessage() for r in caplog.records if r.name == hf]
    assert "eval_strategy='no'" in warning
    assert 'eval_strategy="epoch"' in warning
    assert "learns nothing from this run" in warning
    assert reported(service) == []


class TrainEnd(TrainerCallback):
    """Stands in for a tracker's callback (W&B, MLflow) that must hear training end."""

    def __init__(self) -> None:
        self.ended = False

    def on_train_end(self, *args: Any, **kwargs: Any) -> None:
        self.ended = True


def test_hf_run_stopped_unconverged_raises_train_fail_error(tmp_path: Path) -> None:
    """Out of train(), once the Trainer has ended training as it would have: the
    callbacks before bso's heard it end (raised where bso said stop, they did not)."""
    service = RecordingService()
    bso = hf_callback(service, SPEC.model_copy(update={"max_epochs": 2}))
    tracker = TrainEnd()
    trainer = hf_trainer(bso, tmp_path, before=[tracker])
    with pytest.raises(TrainFailError) as caught, bso:
        trainer.train()
    assert caught.value.reason is StopReason.MAX_EPOCHS
    assert tracker.ended
    assert trainer.state.epoch == 2
    assert "end_trial" not in service.methods()


def test_hf_exception_ends_the_trial_once(tmp_path: Path) -> None:
    service = RecordingService()
    bso = hf_callback(service)
    steps_per_epoch = 64 // 16
    trainer = hf_trainer(bso, tmp_path, TinyClassifier(fail_after_steps=steps_per_epoch + 1))
    with pytest.raises(RuntimeError, match="out of memory"), bso:
        trainer.train()
    assert reported(service) == pytest.approx([0.1])
    assert service.methods().count("end_trial") == 1
    assert service.trial(1).stop_reason is StopReason.OUT_OF_MEMORY


def test_hf_missing_metric_names_what_was_returned(tmp_path: Path) -> None:
    bso = hf_callback(RecordingService(), metric="accuracy")
    trainer = hf_trainer(bso, tmp_path)
    with pytest.raises(KeyError, match="eval_score"), bso:
        trainer.train()


# -- the global batch: passes x accumulation x devices ----------------------------------

MICRO = SPEC.model_copy(
    update={"batch_sizes": [16, 32], "default_batch_size": 32, "micro_batch_size": 8}
)
"""Batches of 32 as 4 accumulated passes of 8: 64 samples make 2 optimizer steps."""


def test_lightning_loads_micro_batches_and_accumulates_to_bsos_size() -> None:
    service = RecordingService()
    bso = lightning_callback(service, MICRO)
    module = ScriptedModule(bso)
    trainer = lightning_trainer(bso)
    with bso:
        trainer.fit(module)
    assert (module.loader_batch_size, trainer.accumulate_grad_batches) == (8, 4)
    assert trainer.global_step == 3 * 2  # stopped after epoch 3, 2 optimizer steps each


def test_lightning_refuses_a_loader_of_the_global_size() -> None:
    bso = lightning_callback(RecordingService(), MICRO)
    with bso, pytest.raises(ValueError, match="would run batches of 128 samples"):
        lightning_trainer(bso).fit(ScriptedModule(bso, loader_size="batch_size"))


def test_hf_sets_per_device_size_and_accumulation_to_bsos_size(tmp_path: Path) -> None:
    bso = hf_callback(RecordingService(), MICRO)
    trainer = hf_trainer(bso, tmp_path)
    assert (trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps) == (
        8,
        4,
    )
    with bso:
        trainer.train()
    assert trainer.state.global_step == 3 * 2


def test_hf_refuses_the_global_size_as_the_per_device_size(tmp_path: Path) -> None:
    bso = hf_callback(RecordingService(), MICRO)
    trainer = hf_trainer(bso, tmp_path, per_pass=bso.batch_size)
    with bso, pytest.raises(ValueError, match="would run batches of 128 samples"):
        trainer.train()


def test_the_check_counts_every_device() -> None:
    check_global_batch(256, 16, 4, 4, "fix")
    with pytest.raises(ValueError, match=r"1024 samples \(64 per pass x 4 accumulated passes x 4"):
        check_global_batch(256, 64, 4, 4, "fix")


def tiny_setup() -> tuple[Any, ...]:
    net = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)

    def make_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(n, 4), torch.randint(0, 2, (n,))

    return net, optimizer, make_batch, nn.functional.cross_entropy


def test_lightning_job_without_sizes_discovers_them(tmp_path: Path) -> None:
    service = RecordingService()
    job = SPEC.model_dump(exclude={"batch_sizes", "default_batch_size"})
    discovery = Discovery(tiny_setup, memory_budget=8 << 20, limit=32, cache_dir=tmp_path)
    bso = BsoLightningCallback(
        job,
        service=service,
        metric="score",
        monitor=TimeOnlyMonitor(),
        environ={},
        discovery=discovery,
    )
    module = ScriptedModule(bso)
    with bso:
        lightning_trainer(bso).fit(module)
    (registered,) = [kw["spec"] for m, _, kw in service.calls if m == "register"]
    assert registered.batch_sizes == [8, 16, 32]
    assert module.loader_batch_size == 32  # the default: the largest size, one pass


def test_the_callbacks_refuse_growth_they_cannot_apply() -> None:
    from bso.core.growth import BatchGrowth

    for callback in (BsoLightningCallback, BsoHfCallback):
        with pytest.raises(ValueError, match="growth= is not supported"):
            callback(SPEC, service=RecordingService(), metric="score", growth=BatchGrowth())


class KilledAfterSave(TrainerCallback):
    """Preempts the run (Ctrl-C: the trial ends as interrupted) right after the
    checkpoint of step ``step`` was saved, as a SIGTERM there would."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            raise KeyboardInterrupt


def test_hf_resumed_from_a_checkpoint_goes_on_with_the_trial(tmp_path: Path) -> None:
    """on_save puts the run's state in the checkpoint; resume_state reads it back for
    resume=, and train(resume_from_checkpoint=...) goes on with the same trial."""
    service = RecordingService()

    def trainer(bso: BsoHfCallback, score: ScriptedScore, after: Sequence[Any]) -> Trainer:
        args = TrainingArguments(
            output_dir=str(tmp_path),
            per_device_train_batch_size=bso.per_device_train_batch_size,
            gradient_accumulation_steps=bso.gradient_accumulation_steps,
            num_train_epochs=10,
            eval_strategy="epoch",
            save_strategy="epoch",
            logging_strategy="no",
            report_to=[],
            disable_tqdm=True,
            use_cpu=True,
        )
        return Trainer(
            model=TinyClassifier(),
            args=args,
            train_dataset=Pairs(),
            eval_dataset=Pairs(),
            compute_metrics=score,
            callbacks=[bso, *after],
        )

    first = hf_callback(service)
    steps_per_epoch = len(Pairs()) // first.batch_size
    with pytest.raises(KeyboardInterrupt), first:
        trainer(first, ScriptedScore(), [KilledAfterSave(2 * steps_per_epoch)]).train()
    assert service.trial(1).status is TrialStatus.INTERRUPTED
    checkpoint = get_last_checkpoint(str(tmp_path))
    state = BsoHfCallback.resume_state(checkpoint)
    assert state is not None
    assert (state["trial_number"], state["epochs"]) == (1, 2)
    again = BsoHfCallback(
        SPEC, service=service, metric="score", monitor=TimeOnlyMonitor(), environ={}, resume=state
    )
    score = ScriptedScore()
    score.evaluations = 2  # the scores go on from the checkpoint's epoch
    with again:
        trainer(again, score, []).train(resume_from_checkpoint=checkpoint)
    trial = service.trial(1)
    assert (trial.status, trial.epochs) == (TrialStatus.CONVERGED, 3)
    assert service.methods().count("next_trial") == 1  # the first run's only
    assert BsoHfCallback.resume_state(None) is None


class PreemptedModule(ScriptedModule):
    """Ctrl-C in training epoch ``stop_in_epoch`` (the trial ends as interrupted)."""

    def __init__(self, bso: BsoLightningCallback, stop_in_epoch: int) -> None:
        super().__init__(bso)
        self.stop_in_epoch = stop_in_epoch

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
        if self.current_epoch + 1 == self.stop_in_epoch:
            raise KeyboardInterrupt
        return super().training_step(batch, index)


def test_lightning_resumed_from_a_checkpoint_goes_on_with_the_trial(tmp_path: Path) -> None:
    """The callback's state_dict is in Lightning's checkpoint; resume_state reads it
    back for resume=, and fit(ckpt_path=...) goes on with the same trial."""
    service = RecordingService()

    first = lightning_callback(service)
    with pytest.raises((KeyboardInterrupt, SystemExit)), first:
        checkpointing_trainer(first, tmp_path).fit(PreemptedModule(first, stop_in_epoch=3))
    assert service.trial(1).status is TrialStatus.INTERRUPTED
    last = tmp_path / "last.ckpt"
    state = BsoLightningCallback.resume_state(last)
    assert state is not None
    assert (state["trial_number"], state["epochs"]) == (1, 2)  # saved after the report
    again = BsoLightningCallback(
        SPEC, service=service, metric="score", monitor=TimeOnlyMonitor(), environ={}, resume=state
    )
    with again:
        checkpointing_trainer(again, tmp_path).fit(ScriptedModule(again), ckpt_path=last)
    trial = service.trial(1)
    assert (trial.status, trial.epochs) == (TrialStatus.CONVERGED, 3)
    assert service.methods().count("next_trial") == 1  # the first run's only
    assert BsoLightningCallback.resume_state(tmp_path / "none.ckpt") is None


def checkpointing_trainer(
    bso: BsoLightningCallback, folder: Path, *, at_epoch_end: bool = True
) -> pl.Trainer:
    """Checkpoints at the end of each training epoch, after bso's report of it, or
    (``at_epoch_end=False``) at the end of each validation, before that report."""
    checkpoints = pl.callbacks.ModelCheckpoint(
        dirpath=folder, save_last=True, save_on_train_epoch_end=at_epoch_end
    )
    return pl.Trainer(
        accelerator="cpu",
        callbacks=[bso, checkpoints],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        max_epochs=10,
    )


def checkpointed_at_validation_end(service: RecordingService, folder: Path) -> Path:
    """A run stopped in epoch 3, its last checkpoint saved at epoch 2's validation."""
    first = lightning_callback(service)
    trainer = checkpointing_trainer(first, folder, at_epoch_end=False)
    with pytest.raises((KeyboardInterrupt, SystemExit)), first:
        trainer.fit(PreemptedModule(first, stop_in_epoch=3))
    return folder / "last.ckpt"


@pytest.mark.parametrize("resumed", [True, False], ids=["resume", "new-run"])
def test_lightning_restored_from_a_checkpoint_saved_at_validation_end_trains_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, resumed: bool
) -> None:
    """fit(ckpt_path=...) from a checkpoint saved at the end of validation ends the
    restored epoch again without validating it, so no metric is logged: the callback
    raised its KeyError ("the model logged nothing") and the run died before it
    trained.  Resumed (resume=), it reports that epoch with the metric the checkpoint
    kept, so the trial's epochs stay Lightning's; as a new run, its trial begins after
    it.  One WARNING names the fix either way."""
    service = RecordingService()
    last = checkpointed_at_validation_end(service, tmp_path)
    state = BsoLightningCallback.resume_state(last)
    assert state is not None
    assert state["epochs"] == 1  # saved at epoch 2's validation, before its report
    again = BsoLightningCallback(
        SPEC,
        service=service,
        metric="score",
        monitor=TimeOnlyMonitor(),
        environ={},
        resume=state if resumed else None,
    )
    with caplog.at_level(logging.WARNING, "bso_client"), again:
        trainer = checkpointing_trainer(again, tmp_path, at_epoch_end=False)
        trainer.fit(ScriptedModule(again), ckpt_path=last)
    lightning = "bso_client.integrations.lightning"
    [warning] = [r.getMessage() for r in caplog.records if r.name == lightning]
    assert "saved at the end of epoch 2's validation" in warning
    assert "save_on_train_epoch_end=True" in warning
    if resumed:
        assert "reports it with the metric that validation logged, 0.2" in warning
        trial = service.trial(1)
        assert (trial.status, trial.epochs) == (TrialStatus.CONVERGED, 3)  # Lightning's
        assert reported(service)[-2:] == [pytest.approx(0.2), pytest.approx(0.3)]
    else:
        assert "does not count it" in warning
        trial = service.trial(2)
        assert (trial.status, trial.epochs) == (TrialStatus.CONVERGED, 1)  # epoch 3's score
