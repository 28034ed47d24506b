"""Plain PyTorch training with bso choosing the batch size: one run = one recurrence.

A small MLP learns to classify synthetic 8x8 "digits" (ten noisy class
prototypes, generated from a fixed seed, so nothing is downloaded); a run takes
seconds on a CPU.  Start the service, then run this script again and again, as
a nightly job would::

    bso up                                    # prints the Redis URL and the API key
    set -a; . .bso/credentials.env; set +a    # BSO_BROKER_URL (user, password), BSO_API_KEY
    python examples/train_mnist_like.py

Each run asks bso for a batch size, trains until the validation accuracy
reaches ``--target`` and reports every epoch.  bso may stop a run early when
its batch size is clearly worse than the best so far: the script then exits
with status 3, and the next run gets another size.  Last line of standard
output: a JSON summary of the run.

Data parallel: ``torchrun --nproc_per_node 2 examples/train_mnist_like.py ...``
runs it on two gloo processes.  bso's batch size is the global batch; each
rank loads ``bso.per_device_batch_size`` of it.  torchrun itself exits 1 when a
rank exits 3, so the run's outcome is also in the last line bso prints on
stderr (``bso: RELAUNCH job=... trial=...``) and, when ``BSO_RUN_STATUS_FILE``
names one, in a JSON status file (:mod:`bso_client.run_status`).

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
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from bso_client import BatchSizeOptimizer, JobSpec, RunStatus, TrainFailError

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
    bso.get_batch_size()  # the global batch; each rank loads its share of it
    sampler: DistributedSampler[tuple[torch.Tensor, ...]] | None = (
        DistributedSampler(train_set, seed=seed) if bso.world_size > 1 else None
    )
    loader = DataLoader(
        train_set, batch_size=bso.per_device_batch_size, shuffle=sampler is None, sampler=sampler
    )
    net = DistributedDataParallel(model) if bso.world_size > 1 else model
    optimizer = torch.optim.SGD(net.parameters(), lr=0.003, momentum=0.9)
    bso.scale_lr(optimizer)  # opt-in: the lr was tuned for the default batch size
    loss_fn = nn.CrossEntropyLoss()
    bso.on_train_begin()
    acc = 0.0
    for epoch in range(1, max_epochs + 1):
        if sampler is not None:
            sampler.set_epoch(epoch)
        for inputs, labels in loader:
            optimizer.zero_grad()
            loss_fn(net(inputs), labels).backward()
            optimizer.step()
        acc = accuracy(model, val_set)
        bso.on_evaluate(acc)  # raises TrainFailError if bso stops the run unconverged
        if bso.training_finished:
            return epoch, acc
    return max_epochs, acc


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--broker-url",
        default=os.environ.get("BSO_BROKER_URL"),
        help="default: BSO_BROKER_URL, from bso up's credentials.env",
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
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("gloo")  # under torchrun: before the optimizer
    summary: dict[str, object] = {"job_id": args.job_id}
    status = RunStatus()  # BSO_RUN_STATUS_FILE, and one last "bso: OUTCOME ..." line
    with status, BatchSizeOptimizer(job, args.broker_url, timeout_s=args.timeout_s) as bso:
        status.watch(bso)
        summary.update(
            trial_number=bso.trial_number,
            batch_size=bso.batch_size,
            per_device_batch_size=bso.per_device_batch_size,
            world_size=bso.world_size,
        )
        try:
            epochs, acc = train(bso, args.max_epochs, args.seed)
        except TrainFailError as err:  # bso stopped the run unconverged: exit 3
            print(err, file=sys.stderr)
        else:
            summary.update(epochs=epochs, accuracy=round(acc, 4))
    summary.update(
        outcome=status.outcome, converged=status.outcome == "converged", reported_epochs=bso.epoch
    )
    if bso.rank == 0:
        print(json.dumps(summary))
    if dist.is_initialized():
        dist.destroy_process_group()
    return status.exit_code


if __name__ == "__main__":
    sys.exit(main())
