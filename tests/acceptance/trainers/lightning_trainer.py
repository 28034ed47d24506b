"""A Lightning module with bso's callback, as docs/client.md wires it.

A small MLP on synthetic 8x8 "digits" (ten noisy class prototypes from a
fixed seed; nothing downloaded).  The loader takes the callback's
``micro_batch_size``; the callback sets ``accumulate_grad_batches`` and stops
the Trainer when bso says so::

    set -a; . .bso/credentials.env; set +a      # BSO_BROKER_URL, BSO_API_KEY
    python lightning_trainer.py --job-id nightly-lightning

Prints ``epoch N accuracy A`` after every epoch it trained, and as its last
line a JSON summary.  Exits 3 when bso stopped the run unconverged (relaunch).

``--checkpoint-dir DIR`` checkpoints with ``ModelCheckpoint(dirpath=DIR,
save_last=True)`` and, when ``DIR/last.ckpt`` exists, resumes from it
(``resume=BsoLightningCallback.resume_state(...)``, ``fit(ckpt_path=...)``), as
docs/client.md shows; ``--save-at validation-end`` saves at the end of each
validation (``save_on_train_epoch_end=False``) instead of after bso's report.
``--epoch-seconds S`` pads the start of each training epoch.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from bso_client import JobSpec, RunStatus, TrainFailError
from bso_client.integrations.lightning import BsoLightningCallback

CLASSES = 10
SIDE = 8


def synthetic_digits(seed: int, size: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    prototypes = torch.randn(CLASSES, SIDE * SIDE, generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, CLASSES, (size,), generator=generator)
    noise = 2.5 * torch.randn(size, SIDE * SIDE, generator=generator)
    return TensorDataset(prototypes[labels] + noise, labels)


class DigitsModel(pl.LightningModule):
    def __init__(self, bso: BsoLightningCallback, seed: int, epoch_seconds: float = 0.0) -> None:
        super().__init__()
        self.bso = bso
        self.epoch_seconds = epoch_seconds
        self.train_set = synthetic_digits(seed, 1024)
        self.val_set = synthetic_digits(seed + 1, 512)
        self.net = nn.Sequential(nn.Linear(SIDE * SIDE, 64), nn.ReLU(), nn.Linear(64, CLASSES))
        self.loss = nn.CrossEntropyLoss()

    def on_train_epoch_start(self) -> None:
        print(f"starting epoch {self.current_epoch + 1}", flush=True)  # the last one is done
        time.sleep(self.epoch_seconds)  # a longer epoch, to stop a run mid-epoch

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
        inputs, labels = batch
        loss: torch.Tensor = self.loss(self.net(inputs), labels)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> None:
        inputs, labels = batch
        self.log("val_acc", (self.net(inputs).argmax(dim=1) == labels).float().mean())

    def on_validation_epoch_end(self) -> None:
        accuracy = float(self.trainer.callback_metrics.get("val_acc", float("nan")))
        print(f"epoch {self.current_epoch + 1} accuracy {accuracy:.3f}", flush=True)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.train_set, batch_size=self.bso.micro_batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.val_set, batch_size=len(self.val_set))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)
        self.bso.bso.scale_lr(optimizer)  # opt-in: the lr was tuned for the default size
        return optimizer


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--broker-url", default=os.environ.get("BSO_BROKER_URL"))
    parser.add_argument("--job-id", default="nightly-lightning")
    parser.add_argument("--max-epochs", type=int, default=5)
    parser.add_argument("--target", type=float, default=0.85)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint-dir", default=None, metavar="DIR")
    parser.add_argument("--save-at", choices=["epoch-end", "validation-end"], default="epoch-end")
    parser.add_argument("--epoch-seconds", type=float, default=0.0)
    args = parser.parse_args(argv)
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("bso_client").setLevel(logging.INFO)
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)

    job = JobSpec(
        job_id=args.job_id,
        batch_sizes=[16, 32, 64, 128],
        default_batch_size=32,
        target_metric=args.target,
        max_epochs=args.max_epochs,
        eta_knob=0.5,
    )
    last = os.path.join(args.checkpoint_dir, "last.ckpt") if args.checkpoint_dir else None
    ckpt = last if last and os.path.exists(last) else None
    bso = BsoLightningCallback(
        job, args.broker_url, metric="val_acc", resume=BsoLightningCallback.resume_state(ckpt)
    )
    callbacks: list[pl.Callback] = [bso]
    if args.checkpoint_dir:
        callbacks.append(
            pl.callbacks.ModelCheckpoint(
                dirpath=args.checkpoint_dir,
                save_last=True,
                save_on_train_epoch_end=args.save_at == "epoch-end",
            )
        )
    trainer = pl.Trainer(
        max_epochs=args.max_epochs,
        accelerator="cpu",
        devices=1,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=bool(args.checkpoint_dir),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    summary: dict[str, Any] = {"job_id": args.job_id}
    status = RunStatus()  # BSO_RUN_STATUS_FILE, and one last "bso: OUTCOME ..." line
    with status, bso:
        status.watch(bso.bso)
        model = DigitsModel(bso, args.seed, args.epoch_seconds)
        batch_size = bso.batch_size  # asks bso: registers the job, starts the trial
        summary.update(
            trial_number=bso.bso.trial_number,
            batch_size=batch_size,
            trained_batch=bso.micro_batch_size * bso.accumulation_steps * trainer.world_size,
        )
        try:
            trainer.fit(model, ckpt_path=ckpt)
        except TrainFailError as err:  # bso stopped the run unconverged: relaunch
            print(err, file=sys.stderr)
    summary["outcome"] = status.outcome
    print(json.dumps(summary), flush=True)
    return status.exit_code


if __name__ == "__main__":
    sys.exit(main())
