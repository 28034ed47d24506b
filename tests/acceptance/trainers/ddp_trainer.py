"""Data-parallel PyTorch (``DistributedDataParallel``, gloo, CPU) under ``torchrun``.

Every rank builds the optimizer; rank 0 talks to bso and every rank gets the
same answers.  bso's batch size is the global batch: each rank's loader takes
its share, ``per_device_batch_size``, as docs/client.md's DDP section says::

    set -a; . .bso/credentials.env; set +a      # BSO_BROKER_URL, BSO_API_KEY
    torchrun --nproc_per_node 2 ddp_trainer.py --job-id nightly-ddp

Rank 0 prints ``epoch N accuracy A`` after every epoch it trained, and as its
last line a JSON summary whose ``trained_batch`` is the global batch that
actually trained: the sum over ranks of what each rank's loader took per step.
``--explore-micro-batch STEPS`` starts the first epoch with bso's micro-batch
exploration on every rank (each rank's own share, in passes, rank 0's times
deciding) and trains the rest at the choice, accumulating under ``no_sync``;
the summary then lists every rank's micro-batch.
``--checkpoint PATH``: rank 0 saves the model, the optimizer and ``bso.state_dict()``
to PATH after every epoch (then prints ``checkpoint N``), and when PATH exists every
rank resumes from it (``resume=``), as docs/client.md shows.  ``--epoch-seconds S`` pads each epoch.
Each rank exits 3 when bso stopped the run unconverged (relaunch), which
torchrun turns into 1: ``RunStatus`` says "relaunch" in ``BSO_RUN_STATUS_FILE``
and in its last ``bso: RELAUNCH ...`` line, where a scheduler reads it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from bso_client import BatchSizeOptimizer, JobSpec, RunStatus, TrainFailError

CLASSES = 10
SIDE = 8


def synthetic_digits(seed: int, size: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    prototypes = torch.randn(CLASSES, SIDE * SIDE, generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, CLASSES, (size,), generator=generator)
    noise = 2.5 * torch.randn(size, SIDE * SIDE, generator=generator)
    return TensorDataset(prototypes[labels] + noise, labels)


def accuracy(model: nn.Module, data: TensorDataset) -> float:
    model.eval()
    with torch.no_grad():
        inputs, labels = data.tensors
        value = float((model(inputs).argmax(dim=1) == labels).float().mean())
    model.train()
    return value


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--broker-url", default=os.environ.get("BSO_BROKER_URL"))
    parser.add_argument("--job-id", default="nightly-ddp")
    parser.add_argument("--max-epochs", type=int, default=5)
    parser.add_argument("--target", type=float, default=0.85)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--explore-micro-batch", type=int, metavar="STEPS", default=None)
    parser.add_argument("--checkpoint", default=None, metavar="PATH")
    parser.add_argument("--epoch-seconds", type=float, default=0.0)
    args = parser.parse_args(argv)
    explore = args.explore_micro_batch
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("bso_client").setLevel(logging.INFO)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)

    job = JobSpec(
        job_id=args.job_id,
        batch_sizes=[32, 64, 128, 256],
        default_batch_size=64,
        target_metric=args.target,
        max_epochs=args.max_epochs,
        eta_knob=0.5,
    )
    train_set, val_set = synthetic_digits(args.seed, 2048), synthetic_digits(args.seed + 1, 512)
    summary: dict[str, object] = {"job_id": args.job_id, "world_size": world_size}
    status = RunStatus()  # BSO_RUN_STATUS_FILE, and one last "bso: OUTCOME ..." line
    checkpoint: dict[str, Any] = {}
    if args.checkpoint and os.path.exists(args.checkpoint):
        checkpoint = torch.load(args.checkpoint)
    with (
        status,
        BatchSizeOptimizer(
            job,
            args.broker_url,
            explore_micro_batch=explore is not None,
            resume=checkpoint.get("bso"),
        ) as bso,
    ):
        status.watch(bso)
        batch_size = bso.get_batch_size()  # the global batch, over every rank
        per_rank = bso.per_device_batch_size  # this rank's share of it
        assert per_rank is not None
        sampler: DistributedSampler[tuple[torch.Tensor, ...]] = DistributedSampler(
            train_set, shuffle=True, seed=args.seed
        )
        loader = DataLoader(train_set, batch_size=per_rank, sampler=sampler)
        net = nn.Sequential(nn.Linear(SIDE * SIDE, 64), nn.ReLU(), nn.Linear(64, CLASSES))
        if checkpoint:
            net.load_state_dict(checkpoint["model"])
        model = DistributedDataParallel(net)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        bso.scale_lr(optimizer)
        if checkpoint:
            optimizer.load_state_dict(checkpoint["optimizer"])
        trained = torch.tensor(per_rank)
        dist.all_reduce(trained)  # what one optimizer step takes over every rank
        summary.update(
            trial_number=bso.trial_number, batch_size=batch_size, trained_batch=int(trained)
        )
        loss_fn = nn.CrossEntropyLoss()
        bso.on_train_begin()
        try:
            for epoch in range(checkpoint.get("epoch", 0) + 1, args.max_epochs + 1):
                sampler.set_epoch(epoch)
                batches = iter(loader)
                if explore is not None and epoch == 1:
                    bso.explore_micro_batch(
                        model, optimizer, loss_fn, batches, budget_steps=explore
                    )
                for inputs, labels in batches:  # this rank's share, in bso's passes
                    optimizer.zero_grad()
                    passes = list(
                        zip(
                            inputs.split(bso.micro_batch_size),
                            labels.split(bso.micro_batch_size),
                            strict=True,
                        )
                    )
                    for index, (x, y) in enumerate(passes):
                        last = index == len(passes) - 1
                        with nullcontext() if last else model.no_sync():
                            (loss_fn(model(x), y) * (len(y) / len(labels))).backward()
                    optimizer.step()
                time.sleep(args.epoch_seconds)  # a longer epoch, to stop a run mid-epoch
                value = accuracy(model, val_set)
                if rank == 0:
                    print(f"epoch {epoch} accuracy {value:.3f}", flush=True)
                bso.on_evaluate(value)
                if args.checkpoint and rank == 0:
                    saved = {
                        "model": net.state_dict(),
                        "optimizer": optimizer.state_dict(),
                        "epoch": epoch,
                        "bso": bso.state_dict(),
                    }
                    torch.save(saved, args.checkpoint)
                    print(f"checkpoint {epoch}", flush=True)  # a kill after it loses no report
                if bso.training_finished:
                    break
        except TrainFailError as err:  # bso stopped the run unconverged: relaunch
            if rank == 0:
                print(err, file=sys.stderr)
        micro = [None] * world_size
        dist.all_gather_object(micro, (bso.micro_batch_size, bso.accumulation_steps))
        summary["micro_batches"] = micro
    summary["outcome"] = status.outcome
    if rank == 0:
        print(json.dumps(summary), flush=True)
    # Every rank reaches teardown together, then leaves without the interpreter's
    # finalization: gloo's threads can abort a process at exit after a finished run
    # ("terminate called without an active exception", SIGABRT on rank 1; seen twice
    # in full suite runs, with and without destroy_process_group after a barrier,
    # never in bso's code: the run had converged and RunStatus had written its
    # outcome).  torch's own report: pytorch/pytorch#179291.
    dist.barrier()
    return status.exit_code


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
