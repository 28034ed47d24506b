"""pytorch/examples' ``mnist/main.py``, shaped the same, with bso choosing the batch size.

The same ``Net`` (two convolutions, max-pool, dropout, two linear layers), the
same ``train``/``test`` functions, Adadelta with a ``StepLR`` schedule; only
smaller (12x12 synthetic "digits": ten noisy class prototypes from a fixed
seed, so nothing is downloaded) and with bso's three calls, as docs/client.md
shows them::

    set -a; . .bso/credentials.env; set +a      # BSO_BROKER_URL, BSO_API_KEY
    python mnist_loop.py --job-id nightly-mnist

Prints ``epoch N accuracy A`` after every epoch it trained, and as its last
line a JSON summary.  Exits 3 when bso stopped the run unconverged (relaunch).

``--explore-micro-batch`` starts the first epoch with bso's micro-batch exploration
(real steps on the epoch's own batches) and trains the rest of the run at the
micro-batch it chose, accumulating its passes, as docs/client.md shows.

``--checkpoint PATH`` saves the model, the optimizers and ``bso.state_dict()`` to
PATH after every epoch, when PATH exists resumes from it (``resume=``), and
removes it once the run is over (not when it is killed or crashes), as
docs/client.md shows; ``--keep-checkpoint`` is the bug of a script that keeps it.

``--bug KIND`` plants a bug that raises before the first epoch, the way real
scripts break: ``scheduler-first`` (an LR scheduler built before
``bso.scale_lr``, which bso refuses), ``report-before-begin`` (``on_evaluate``
before ``on_train_begin``) or ``data`` (a typo in the user's own code).
``--bug-at-epoch N`` plants that typo in the validation code of epoch N instead:
the run trains and reports N - 1 epochs, then raises.  ``--validation-size 0`` is
the bug of an empty validation set: every epoch's accuracy is NaN.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 (as pytorch/examples writes it)
from torch import nn, optim
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, TensorDataset

from bso_client import BatchSizeOptimizer, JobSpec, RunStatus, TrainFailError

SIDE = 12
CLASSES = 10


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, 1)
        self.conv2 = nn.Conv2d(8, 16, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(256, 32)
        self.fc2 = nn.Linear(32, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.dropout2(x)
        return F.log_softmax(self.fc2(x), dim=1)


def synthetic_digits(seed: int, size: int) -> TensorDataset:
    """Ten class prototypes plus noise: learnable in a few epochs, not in one."""
    generator = torch.Generator().manual_seed(seed)
    prototypes = torch.randn(CLASSES, 1, SIDE, SIDE, generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, CLASSES, (size,), generator=generator)
    noise = 1.5 * torch.randn(size, 1, SIDE, SIDE, generator=generator)
    return TensorDataset(prototypes[labels] + noise, labels)


def train(
    model: nn.Module,
    loader: DataLoader[tuple[torch.Tensor, ...]],
    optimizer: optim.Optimizer,
    bso: BatchSizeOptimizer,
    explore_steps: int | None = None,
) -> None:
    """One epoch; with ``explore_steps``, its first steps explore micro-batches."""
    model.train()
    batches = iter(loader)
    if explore_steps is not None:
        bso.explore_micro_batch(model, optimizer, F.nll_loss, batches, budget_steps=explore_steps)
    for data, target in batches:  # each a whole per-device batch, in bso's passes
        optimizer.zero_grad()
        for inputs, labels in zip(
            data.split(bso.micro_batch_size), target.split(bso.micro_batch_size), strict=True
        ):
            loss = F.nll_loss(model(inputs), labels) / bso.accumulation_steps
            loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()


def test(model: nn.Module, loader: DataLoader[tuple[torch.Tensor, ...]]) -> float:
    """The share of right answers: NaN when the loader has no samples (torch's mean of
    nothing), as validation code of this shape gives a user for an empty set."""
    model.eval()
    hits = torch.zeros(0)
    with torch.no_grad():
        for data, target in loader:
            hits = torch.cat([hits, (model(data).argmax(dim=1) == target).float()])
    return float(hits.mean())


def plant_bug(kind: str, bso: BatchSizeOptimizer, optimizer: optim.Optimizer) -> None:
    """Raise the way a broken script does, before its first epoch."""
    if kind == "scheduler-first":
        StepLR(optimizer, step_size=1)
        bso.scale_lr(optimizer)  # bso refuses: the scheduler would undo the scaling
    elif kind == "report-before-begin":
        bso.on_evaluate(0.0)  # OperationOrderError: on_train_begin was never called
    elif kind == "data":
        columns = {"image": 0, "label": 1}
        print(columns["labels"])  # the user's typo: KeyError


def busy_pool_torn_down() -> None:
    """Data preparation in a pool forked from the training process (``fork``, Linux's
    default), torn down while its workers are busy, as ``with Pool()`` does when its
    block ends early: ``terminate()`` sends each worker SIGTERM."""
    pool = multiprocessing.get_context("fork").Pool(2)
    pool.map_async(time.sleep, [30, 30])
    time.sleep(0.5)
    pool.terminate()
    pool.join()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--broker-url", default=os.environ.get("BSO_BROKER_URL"))
    parser.add_argument("--job-id", default="nightly-mnist")
    parser.add_argument("--max-epochs", type=int, default=6)
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--lr", type=float, default=1.0)
    parser.add_argument("--gamma", type=float, default=0.8)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--epoch-seconds", type=float, default=0.0, help="pad each epoch")
    parser.add_argument("--exploration-budget", type=float, default=None)
    parser.add_argument("--eta", type=float, default=0.5, help="the job's eta_knob")
    parser.add_argument(
        "--explore-micro-batch",
        type=int,
        metavar="STEPS",
        default=None,
        help="explore micro-batches in the first STEPS steps",
    )
    parser.add_argument(
        "--bug", choices=("none", "scheduler-first", "report-before-begin", "data"), default="none"
    )
    parser.add_argument("--bug-at-epoch", type=int, default=0, metavar="N")
    parser.add_argument("--batch-sizes", default="16,32,64,128", help="the job's candidates")
    parser.add_argument(
        "--validation-size",
        type=int,
        default=512,
        help="0 is a user's bug: an empty validation set (a wrong path), every accuracy NaN",
    )
    parser.add_argument("--checkpoint", default=None, metavar="PATH")
    parser.add_argument("--keep-checkpoint", action="store_true")
    parser.add_argument("--heartbeat-interval", type=float, default=30.0, metavar="S")
    parser.add_argument("--heartbeat-misses", type=int, default=3)
    parser.add_argument(
        "--pool-at-epoch",
        type=int,
        default=0,
        metavar="N",
        help="tear down a busy fork pool in epoch N (its workers get SIGTERM)",
    )
    args = parser.parse_args(argv)
    # The line docs/client.md shows to see bso's per-trial log.
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("bso_client").setLevel(logging.INFO)
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)

    job = JobSpec(
        job_id=args.job_id,
        batch_sizes=[int(b) for b in args.batch_sizes.split(",")],
        default_batch_size=32,
        target_metric=args.target,
        max_epochs=args.max_epochs,
        eta_knob=args.eta,  # below 1 by default: without a GPU the cost is time only
        exploration_budget=args.exploration_budget,
    )
    train_set = synthetic_digits(args.seed, 1024)
    test_set = synthetic_digits(args.seed + 1, args.validation_size)
    summary: dict[str, object] = {"job_id": args.job_id}
    status = RunStatus()  # BSO_RUN_STATUS_FILE, and one last "bso: OUTCOME ..." line
    explore = args.explore_micro_batch is not None
    checkpoint: dict[str, Any] = {}
    if args.checkpoint and os.path.exists(args.checkpoint):
        checkpoint = torch.load(args.checkpoint)
    resume = checkpoint.get("bso")
    with (
        status,
        BatchSizeOptimizer(
            job,
            args.broker_url,
            explore_micro_batch=explore,
            resume=resume,
            heartbeat_interval_s=args.heartbeat_interval,
            heartbeat_misses=args.heartbeat_misses,
        ) as bso,
    ):
        status.watch(bso)  # asks for the batch size, writes "running"
        batch_size = bso.get_batch_size()  # the global batch: one process here, so all of it
        train_loader = DataLoader(train_set, batch_size=bso.per_device_batch_size, shuffle=True)
        test_loader = DataLoader(test_set, batch_size=256)
        model = Net()
        optimizer = optim.Adadelta(model.parameters(), lr=args.lr)
        plant_bug(args.bug, bso, optimizer)
        bso.scale_lr(optimizer)
        scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
        if checkpoint:
            model.load_state_dict(checkpoint["model"])
            optimizer.load_state_dict(checkpoint["optimizer"])
            scheduler.load_state_dict(checkpoint["scheduler"])
        summary.update(
            trial_number=bso.trial_number,
            batch_size=batch_size,
            trained_batch=train_loader.batch_size,
            detached=bso.detached,
        )
        bso.on_train_begin()
        accuracy = 0.0
        try:
            for epoch in range(checkpoint.get("epoch", 0) + 1, args.max_epochs + 1):
                train(model, train_loader, optimizer, bso, args.explore_micro_batch)
                args.explore_micro_batch = None  # the first epoch's start only
                time.sleep(args.epoch_seconds)
                accuracy = test(model, test_loader)
                if epoch == args.bug_at_epoch:
                    plant_bug("data", bso, optimizer)
                if epoch == args.pool_at_epoch:
                    busy_pool_torn_down()
                print(f"epoch {epoch} accuracy {accuracy:.3f}", flush=True)
                scheduler.step()
                bso.on_evaluate(accuracy)
                print(f"reported epoch {epoch}", flush=True)  # bso answered (or is detached)
                if args.checkpoint:
                    saved = {
                        "model": model.state_dict(),
                        "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(),
                        "epoch": epoch,
                        "bso": bso.state_dict(),
                    }
                    torch.save(saved, args.checkpoint)
                if bso.training_finished:
                    break
        except TrainFailError as err:  # bso stopped the run unconverged: relaunch
            print(err, file=sys.stderr)
        if args.checkpoint and not args.keep_checkpoint:  # the run is over: the next starts afresh
            Path(args.checkpoint).unlink(missing_ok=True)
        summary.update(
            accuracy=round(accuracy, 4),
            detached=bso.detached,
            micro_batch_size=bso.micro_batch_size,
            accumulation_steps=bso.accumulation_steps,
        )
    summary["outcome"] = status.outcome
    print(json.dumps(summary), flush=True)
    return status.exit_code


if __name__ == "__main__":
    sys.exit(main())
