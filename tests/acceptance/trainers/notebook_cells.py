"""A notebook, imitated: cells run one after another in one long-lived process.

The training cell builds a ``BatchSizeOptimizer`` without ``with`` (as notebook
code often does) and trains a small MLP on synthetic data.  The first run of the
cell is stopped by Ctrl-C after its first epoch; the "kernel" catches the
``KeyboardInterrupt`` and lives on (``atexit`` does not run).  Then the cell is
run again and trains to the end::

    python notebook_cells.py --job-id nightly-notebook

With ``--unclosed`` the second run of the cell trains to its end but never
closes its optimizer, and the cell is run a third time.

Prints ``cell N`` when a cell starts, ``epoch N accuracy A`` after every epoch,
and ``KeyboardInterrupt caught by the kernel`` for the stopped cell.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Sequence

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


def train_cell(job: JobSpec, url: str, interrupt_after_epoch: int | None, close: bool) -> None:
    """The cell: no ``with``, and ``close()`` only when the loop ends by itself (and
    ``close``: a notebook that never closes leaves its finished runs to the next cell)."""
    train_set, val_set = make_data()
    bso = BatchSizeOptimizer(job, url)
    bso.get_batch_size()
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.002, momentum=0.9)
    loader = DataLoader(train_set, batch_size=bso.per_device_batch_size, shuffle=True)
    loss_fn = nn.CrossEntropyLoss()
    bso.on_train_begin()
    for epoch in range(1, job.max_epochs + 1):
        for inputs, labels in loader:
            optimizer.zero_grad()
            loss_fn(model(inputs), labels).backward()
            optimizer.step()
        with torch.no_grad():
            inputs, labels = val_set.tensors
            accuracy = float((model(inputs).argmax(1) == labels).float().mean())
        print(f"epoch {epoch} accuracy {accuracy:.3f}", flush=True)
        if epoch == interrupt_after_epoch:
            raise KeyboardInterrupt  # the user presses Ctrl-C (Interrupt the kernel)
        try:
            bso.on_evaluate(accuracy)
        except TrainFailError:
            break
        if bso.training_finished:
            break
    if close:
        bso.close()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--job-id", required=True)
    parser.add_argument(
        "--unclosed", action="store_true", help="the second cell never closes; a third runs"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    job = JobSpec(
        job_id=args.job_id,
        batch_sizes=[16, 32, 64],
        default_batch_size=32,
        target_metric=0.99,  # never reached: every run trains max_epochs
        max_epochs=3,
        eta_knob=0.5,
    )
    url = os.environ["BSO_BROKER_URL"]
    cells = [(1, 2, True), (2, None, not args.unclosed)]
    if args.unclosed:
        cells.append((3, None, True))
    for cell, interrupt, close in cells:
        print(f"cell {cell}", flush=True)
        try:
            train_cell(job, url, interrupt, close)
        except KeyboardInterrupt:
            print("KeyboardInterrupt caught by the kernel", flush=True)


if __name__ == "__main__":
    main()
