"""Hugging Face Accelerate: check that the ``Accelerator`` trains the batch bso chose.

Accelerate has no callback to hang bso on: a script keeps its own loop and
calls the optimizer itself (docs/client.md, "Accelerate").  What can go wrong
is the arithmetic, silently: a DataLoader of the global batch, a forgotten
``gradient_accumulation_steps``, ``split_batches=True``, or an Accelerator
that does not see the processes ``torch.distributed`` has (under ``torchrun``
on CPUs, Accelerate 1.x reports ``DistributedType.NO`` and one process while
the process group has two: each process then trains alone, without sharding
the data or averaging gradients, and bso would record a global batch that
never ran).  :func:`check_accelerator` refuses all of these before the first
step, naming the fix, as the Lightning and Hugging Face callbacks do.

Imports neither torch nor accelerate: it reads the Accelerator's attributes.
"""

from __future__ import annotations

from typing import Any

from bso_client.integrations.batch_check import check_global_batch
from bso_client.optimizer import BatchSizeOptimizer


def check_accelerator(bso: BatchSizeOptimizer, accelerator: Any, loader_batch_size: int) -> None:
    """Raise ``ValueError`` unless ``accelerator`` with DataLoaders of ``loader_batch_size``
    runs bso's global batch: the same processes as bso counts, ``split_batches`` off,
    and ``loader_batch_size x accumulation x processes`` equal to bso's size.

    Call it once the Accelerator exists and before training (every rank).
    """
    global_batch = bso.get_batch_size()
    processes = int(accelerator.num_processes)
    if processes != bso.world_size:
        raise ValueError(
            f"Accelerate runs {processes} process(es) as one job, but torch.distributed has "
            f"{bso.world_size}: each would train alone while bso records a global batch over "
            f"{bso.world_size}. Launch with a configuration Accelerate recognises "
            "(`accelerate config`, or `accelerate launch --multi_gpu` on GPUs), so that "
            "Accelerator().num_processes matches the process group"
        )
    if getattr(accelerator, "split_batches", False):
        raise ValueError(
            "Accelerator(split_batches=True) splits each DataLoader batch over the processes; "
            "bso's sizes assume the default (split_batches=False) with DataLoaders of "
            "bso.micro_batch_size"
        )
    check_global_batch(
        global_batch,
        loader_batch_size,
        int(accelerator.gradient_accumulation_steps),
        processes,
        "DataLoader(batch_size=bso.micro_batch_size) and "
        "Accelerator(gradient_accumulation_steps=bso.accumulation_steps)",
    )


__all__ = ["check_accelerator"]
