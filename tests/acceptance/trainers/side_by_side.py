"""Two jobs trained side by side in one process, recurrence after recurrence.

Each run is a generator that trains one epoch per step inside its optimizer's
``with`` block, and the loop steps the two in turn (as an asyncio sweep or a
round-robin trainer does): the blocks end in the order they began, A then B,
not nested.  A scheduler's SIGTERM may come at any point::

    python side_by_side.py --job-id nightly --recurrences 3

With ``--same-job`` the two are runs of one job (a sweep stepped in turn), each
in its own block.  Prints ``recurrence R`` when a recurrence starts and ``epoch N
JOB`` after every epoch (a test waits for those lines to send SIGTERM).
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Iterator, Sequence

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from bso_client import BatchSizeOptimizer, JobSpec, TrainFailError


def make_data(seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    generator = torch.Generator().manual_seed(seed)
    prototypes = torch.randn(10, 32, generator=generator)

    def sample(n: int) -> TensorDataset:
        labels = torch.randint(0, 10, (n,), generator=generator)
        noise = 3 * torch.randn(n, 32, generator=generator)
        return TensorDataset(prototypes[labels] + noise, labels)

    return sample(1024), sample(512)


def run(job: JobSpec, url: str) -> Iterator[None]:
    """One run of ``job``: one epoch per step, inside the optimizer's ``with`` block."""
    train_set, val_set = make_data()
    with BatchSizeOptimizer(job, url) as bso:
        bso.get_batch_size()
        model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 10))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.002, momentum=0.9)
        loader = DataLoader(train_set, batch_size=bso.per_device_batch_size, shuffle=True)
        bso.on_train_begin()
        for epoch in range(1, job.max_epochs + 1):
            for inputs, labels in loader:
                optimizer.zero_grad()
                nn.functional.cross_entropy(model(inputs), labels).backward()
                optimizer.step()
            with torch.no_grad():
                inputs, labels = val_set.tensors
                accuracy = float((model(inputs).argmax(1) == labels).float().mean())
            print(f"epoch {epoch} {job.job_id}", flush=True)
            try:
                bso.on_evaluate(accuracy)
            except TrainFailError:
                return
            if bso.training_finished:
                return
            yield


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--broker-url", default=os.environ.get("BSO_BROKER_URL"))
    parser.add_argument("--job-id", default="side-by-side")
    parser.add_argument("--recurrences", type=int, default=3)
    parser.add_argument("--max-epochs", type=int, default=3)
    parser.add_argument("--same-job", action="store_true", help="two runs of one job")
    args = parser.parse_args(argv)
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("bso_client").setLevel(logging.INFO)
    torch.set_num_threads(1)
    jobs = [
        JobSpec(
            job_id=args.job_id if args.same_job else f"{args.job_id}-{name}",
            batch_sizes=[16, 32, 64],
            default_batch_size=32,
            target_metric=0.99,  # not reached: every run trains max_epochs
            max_epochs=args.max_epochs,
            eta_knob=0.5,
        )
        for name in ("a", "b")
    ]
    for recurrence in range(1, args.recurrences + 1):
        print(f"recurrence {recurrence}", flush=True)
        runs = [run(job, args.broker_url) for job in jobs]
        while runs:
            for each in list(runs):
                if next(each, StopIteration) is StopIteration:
                    runs.remove(each)


if __name__ == "__main__":
    main()
