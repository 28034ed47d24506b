"""PyTorch Lightning with bso choosing the batch size: the callback does the calls.

The same synthetic 8x8 "digits" as ``train_mnist_like.py`` (no download, CPU,
seconds), trained by a ``pl.Trainer`` with :class:`BsoLightningCallback`:
the batch size goes into ``train_dataloader``, the validation accuracy logged
as ``val_acc`` is reported after every epoch, and the trainer stops when bso
says so::

    bso up                                    # prints the Redis URL and the API key
    set -a; . .bso/credentials.env; set +a    # BSO_BROKER_URL (user, password), BSO_API_KEY
    python examples/lightning_example.py

Exits with status 3 when bso stopped the run without convergence (relaunch);
the last line on stderr (``bso: RELAUNCH job=...``) and, when
``BSO_RUN_STATUS_FILE`` names one, a JSON status file say the same under a
launcher that changes exit codes (:mod:`bso_client.run_status`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from bso_client import JobSpec, RunStatus, TrainFailError
from bso_client.integrations.lightning import BsoLightningCallback
from bso_client.run_status import EXIT_CODES

CLASSES = 10
SIDE = 8


def make_data(seed: int, train_size: int = 2048, val_size: int = 1024) -> tuple[TensorDataset, ...]:
    """Ten class prototypes plus Gaussian noise: separable, but not in one epoch."""
    generator = torch.Generator().manual_seed(seed)
    prototypes = torch.randn(CLASSES, SIDE * SIDE, generator=generator)

    def sample(n: int) -> TensorDataset:
        labels = torch.randint(0, CLASSES, (n,), generator=generator)
        noise = 3.0 * torch.randn(n, SIDE * SIDE, generator=generator)
        return TensorDataset(prototypes[labels] + noise, labels)

    return sample(train_size), sample(val_size)


class DigitsModel(pl.LightningModule):
    """A small MLP whose loaders take their batch size from the bso callback."""

    def __init__(self, bso: BsoLightningCallback, seed: int) -> None:
        super().__init__()
        self.bso = bso
        self.train_set, self.val_set = make_data(seed)
        self.net = nn.Sequential(nn.Linear(SIDE * SIDE, 64), nn.ReLU(), nn.Linear(64, CLASSES))
        self.loss = nn.CrossEntropyLoss()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
        inputs, labels = batch
        loss: torch.Tensor = self.loss(self.net(inputs), labels)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> None:
        inputs, labels = batch
        accuracy = (self.net(inputs).argmax(dim=1) == labels).float().mean()
        self.log("val_acc", accuracy, on_epoch=True)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.train_set, batch_size=self.bso.micro_batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.val_set, batch_size=len(self.val_set))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.003, momentum=0.9)
        self.bso.bso.scale_lr(optimizer)  # opt-in: the lr was tuned for the default size
        return optimizer


def run(
    broker_url: str | None = None,
    *,
    job_id: str = "mnist-like-lightning",
    target: float = 0.78,
    max_epochs: int = 12,
    seed: int = 0,
    **optimizer_options: Any,
) -> dict[str, Any]:
    """One run of the job; ``optimizer_options`` go to the BatchSizeOptimizer (``service=``...)."""
    job = JobSpec(
        job_id=job_id,
        batch_sizes=[16, 32, 64, 128, 256],
        default_batch_size=64,
        target_metric=target,
        max_epochs=max_epochs,
    )
    torch.manual_seed(seed)
    status = RunStatus()  # BSO_RUN_STATUS_FILE, and one last "bso: OUTCOME ..." line
    # Watched once the callback has the optimizer, after Lightning set up torch.distributed.
    bso = BsoLightningCallback(
        job, broker_url, metric="val_acc", run_status=status, **optimizer_options
    )
    trainer = pl.Trainer(
        max_epochs=max_epochs,
        accelerator="cpu",
        callbacks=[bso],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    summary: dict[str, Any] = {"job_id": job_id}
    with status, bso:
        try:
            trainer.fit(DigitsModel(bso, seed))
        except TrainFailError as err:
            print(err, file=sys.stderr)
        decision = bso.bso.last_decision
        summary.update(
            trial_number=bso.bso.trial_number,
            batch_size=bso.batch_size,
            epochs=bso.bso.epoch,
            accuracy=round(float(trainer.callback_metrics.get("val_acc", 0.0)), 4),
            converged=decision is not None and decision.converged,
        )
    summary["outcome"] = status.outcome
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--broker-url",
        default=os.environ.get("BSO_BROKER_URL"),
        help="default: BSO_BROKER_URL, from bso up's credentials.env",
    )
    parser.add_argument("--job-id", default="mnist-like-lightning")
    parser.add_argument("--target", type=float, default=0.78)
    parser.add_argument("--max-epochs", type=int, default=12)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # a model this small only loses time to thread hand-offs
    summary = run(
        args.broker_url, job_id=args.job_id, target=args.target, max_epochs=args.max_epochs
    )
    print(json.dumps(summary))
    return EXIT_CODES[summary["outcome"]]  # 3: bso stopped it unconverged, relaunch


if __name__ == "__main__":
    sys.exit(main())
