"""Plain PyTorch training with bso choosing the batch size: one run = one recurrence.

A small MLP learns to classify synthetic 8x8 "digits" (ten noisy class
prototypes, generated from a fixed seed, so nothing is downloaded); a run takes
seconds on a CPU.  Start the service, then run this script again and again, as
a nightly job would::

    bso up                                    # prints the Redis URL and the API key
    export BSO_API_KEY=bso_...                # the key it printed (or `bso keys create`)
    python examples/train_mnist_like.py --broker-url redis://127.0.0.1:6379/0

Each run asks bso for a batch size, trains until the validation accuracy
reaches ``--target`` and reports every epoch.  bso may stop a run early when
its batch size is clearly worse than the best so far: the script then exits
with status 3 and the message to relaunch, and the next run gets another size.
Last line of output: a JSON summary of the run.

Without a GPU the energy is not measured (a warning says so) and bso compares
batch sizes by time alone.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from bso_client import BatchSizeOptimizer, JobSpec, TrainFailError

EXIT_RELAUNCH = 3
"""Exit status of a run bso stopped without convergence: launch the job again."""

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


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(SIDE * SIDE, 64), nn.ReLU(), nn.Linear(64, CLASSES))


def accuracy(model: nn.Module, data: TensorDataset) -> float:
    model.eval()
    with torch.no_grad():
        inputs, labels = data.tensors
        predicted = model(inputs).argmax(dim=1)
    model.train()
    return float((predicted == labels).float().mean())


def train(bso: BatchSizeOptimizer, max_epochs: int, seed: int) -> tuple[int, float]:
    """The training loop with bso's three calls; returns (epochs run, last accuracy)."""
    train_set, val_set = make_data(seed)
    torch.manual_seed(seed + (bso.trial_number or 0))
    model = make_model()
    loader = DataLoader(train_set, batch_size=bso.get_batch_size(), shuffle=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.003, momentum=0.9)
    bso.scale_lr(optimizer)  # opt-in: the lr was tuned for the default batch size
    loss_fn = nn.CrossEntropyLoss()
    bso.on_train_begin()
    acc = 0.0
    for epoch in range(1, max_epochs + 1):
        for inputs, labels in loader:
            optimizer.zero_grad()
            loss_fn(model(inputs), labels).backward()
            optimizer.step()
        acc = accuracy(model, val_set)
        bso.on_evaluate(acc)  # raises TrainFailError if bso stops the run unconverged
        if bso.training_finished:
            return epoch, acc
    return max_epochs, acc


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--broker-url", default=os.environ.get("BSO_BROKER_URL", "redis://127.0.0.1:6379/0")
    )
    parser.add_argument("--job-id", default="mnist-like")
    parser.add_argument("--target", type=float, default=0.78, help="validation accuracy to reach")
    parser.add_argument("--max-epochs", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=10.0, help="wait for each reply")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # a model this small only loses time to thread hand-offs

    job = JobSpec(
        job_id=args.job_id,
        batch_sizes=[16, 32, 64, 128, 256],
        default_batch_size=64,
        target_metric=args.target,
        max_epochs=args.max_epochs,
        eta_knob=0.5,  # below 1: without a GPU the cost is time only
    )
    summary: dict[str, object] = {"job_id": args.job_id}
    status = 0
    with BatchSizeOptimizer(job, args.broker_url, timeout_s=args.timeout_s) as bso:
        batch_size = bso.get_batch_size()
        summary.update(trial_number=bso.trial_number, batch_size=batch_size)
        try:
            epochs, acc = train(bso, args.max_epochs, args.seed)
        except TrainFailError as err:
            print(err, file=sys.stderr)
            status = EXIT_RELAUNCH
        else:
            summary.update(epochs=epochs, accuracy=round(acc, 4))
        summary.update(converged=bso.training_finished and status == 0, reported_epochs=bso.epoch)
    print(json.dumps(summary))
    return status


if __name__ == "__main__":
    sys.exit(main())
