"""Data-parallel training: one rank talks to bso, every rank gets the same answers.

A data-parallel job is one bso trial however many processes run it, so:

* **Only rank 0 talks to the service.**  Every rank calls the optimizer the
  same way; rank 0 sends the event, and the reply (or the error) is broadcast
  so that all ranks use the same batch size and trial number, stop at the same
  epoch, and raise the same exception (:func:`on_rank_zero`).  A rank that
  stopped alone would leave the others hanging in their next all-reduce.
* **Energy is summed over every GPU of the job.**  The *measuring* ranks each
  own an energy monitor; at every epoch end the per-rank energies are
  all-gathered and summed, and rank 0 reports the job's total.  Which ranks
  measure is the ``energy_scope``:

  - ``"node"`` (default): the first rank of each node (``LOCAL_RANK`` 0, or the
    lowest rank on its host when ``LOCAL_RANK`` is unset) measures every GPU
    its monitor sees, i.e. the whole node when all GPUs are visible to every
    rank (``torchrun``'s default).  The other ranks contribute nothing, so no
    GPU is counted twice.
  - ``"rank"``: every rank measures the GPUs *it* sees; right when each rank
    is restricted to its own GPU (``CUDA_VISIBLE_DEVICES`` set per rank, as
    SLURM's ``--gpus-per-task`` does), where a node's first rank would see
    one GPU only.

  The job's hardware is assembled the same way: every measuring rank's GPU
  count is added up, and their models must agree
  (:class:`~bso_client.errors.MixedGpuModels` otherwise).  Rank 0 always
  measures, since it also reports the elapsed time.

The collectives are ``torch.distributed``'s object collectives
(``all_gather_object``, ``broadcast_object_list``): a few hundred bytes once
per epoch, on any backend (with NCCL, call ``torch.cuda.set_device`` first, as
those collectives use the current device).  The process group must be
initialized before the optimizer is created.  torch is only imported when it
already is: a process that never imported torch cannot have a process group.
"""

from __future__ import annotations

import os
import socket
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from bso.errors import BsoError
from bso.spec import Hardware
from bso_client.errors import DistributedSetupError, MixedGpuModels, RankZeroError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

T = TypeVar("T")

EnergyScope = Literal["node", "rank"]


class Collective(ABC):
    """The two collectives the optimizer needs, over the job's processes."""

    rank: int
    world_size: int

    @abstractmethod
    def broadcast(self, value: T) -> T:
        """Rank 0's ``value`` on every rank (other ranks' ``value`` is ignored)."""

    @abstractmethod
    def all_gather(self, value: T) -> list[T]:
        """Every rank's ``value``, indexed by rank, on every rank."""


class SingleProcess(Collective):
    """Not distributed: rank 0 of 1, collectives are identities."""

    rank = 0
    world_size = 1

    def broadcast(self, value: T) -> T:
        return value

    def all_gather(self, value: T) -> list[T]:
        return [value]


class TorchCollective(Collective):
    """``torch.distributed`` object collectives over ``group`` (default: the world)."""

    def __init__(self, group: ProcessGroup | None = None) -> None:
        import torch.distributed as dist

        self._dist = dist
        self._group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        # broadcast_object_list names its source by global rank.
        self._source = 0 if group is None else dist.get_global_rank(group, 0)

    def broadcast(self, value: T) -> T:
        box: list[Any] = [value]
        self._dist.broadcast_object_list(box, src=self._source, group=self._group)
        result: T = box[0]
        return result

    def all_gather(self, value: T) -> list[T]:
        out: list[Any] = [None] * self.world_size
        self._dist.all_gather_object(out, value, group=self._group)
        return out


def torch_distributed_initialized() -> bool:
    """Whether this process has a default process group, without importing torch."""
    if "torch" not in sys.modules:
        return False
    import torch.distributed as dist

    return bool(dist.is_available() and dist.is_initialized())


def detect_collective(environ: Mapping[str, str] | None = None) -> Collective:
    """The world's collective if ``torch.distributed`` is initialized, else a single process.

    ``WORLD_SIZE`` above 1 without a process group raises
    :class:`~bso_client.errors.DistributedSetupError` instead of letting each
    rank run a trial of its own.
    """
    if torch_distributed_initialized():
        return TorchCollective()
    env = os.environ if environ is None else environ
    world = int(env.get("WORLD_SIZE", "1"))
    if world > 1:
        raise DistributedSetupError(
            f"WORLD_SIZE={world} but torch.distributed is not initialized: call "
            "torch.distributed.init_process_group() before creating the BatchSizeOptimizer, so "
            "that rank 0 can share the batch size with the other ranks (Hugging Face: build "
            "TrainingArguments and read args.device before reading the callback's batch "
            "size; Lightning: leave the optimizer to the callback's setup, and pass "
            "run_status= to the callback instead of calling RunStatus.watch before fit)"
        )
    return SingleProcess()


def local_rank(collective: Collective, environ: Mapping[str, str] | None = None) -> int:
    """This process's rank within its node: ``LOCAL_RANK``, else counted by host name.

    A collective call when ``LOCAL_RANK`` is unset: every rank must call it.
    """
    env = os.environ if environ is None else environ
    value = env.get("LOCAL_RANK")
    if value is not None:
        return int(value)
    hosts = collective.all_gather(socket.gethostname())
    return hosts[: collective.rank].count(hosts[collective.rank])


def measures_energy(
    collective: Collective, scope: EnergyScope, environ: Mapping[str, str] | None = None
) -> bool:
    """Whether this rank owns an energy monitor under ``scope`` (see the module docstring)."""
    if scope not in ("node", "rank"):
        raise ValueError(f"energy_scope must be 'node' or 'rank', got {scope!r}")
    # local_rank is collective when LOCAL_RANK is unset: call it on every rank first.
    first_on_node = local_rank(collective, environ) == 0
    return collective.rank == 0 or scope == "rank" or first_on_node


def combine_hardware(parts: Sequence[Hardware | None]) -> Hardware:
    """The job's hardware from the measuring ranks' (``None`` for the others)."""
    measured = [(rank, hw) for rank, hw in enumerate(parts) if hw is not None]
    if not measured:
        raise ValueError("no rank measured any hardware")
    models = {hw.gpu_model for _, hw in measured}
    if len(models) > 1:
        found = ", ".join(f"rank {r}: {hw.gpu_count} x {hw.gpu_model}" for r, hw in measured)
        raise MixedGpuModels(
            f"the job's ranks run on different hardware ({found}); bso learns per GPU "
            "model, so run the job on GPUs of one model"
        )
    return Hardware(
        gpu_model=measured[0][1].gpu_model,
        gpu_count=sum(hw.gpu_count for _, hw in measured),
        max_power_w=max(hw.max_power_w for _, hw in measured),
    )


def on_rank_zero(collective: Collective, call: Callable[[], T]) -> T:
    """Run ``call`` on rank 0 only and return its result, or raise its error, on every rank.

    Must be called by every rank (it is a broadcast).  A :class:`BsoError`
    is re-raised as itself everywhere; any other exception is re-raised as
    itself on rank 0 and as :class:`~bso_client.errors.RankZeroError` on the
    others (arbitrary exceptions need not pickle).
    """
    if collective.world_size == 1:
        return call()
    outcome: tuple[bool, Any] = (True, None)
    original: Exception | None = None
    if collective.rank == 0:
        try:
            outcome = (True, call())
        except BsoError as err:
            original, outcome = err, (False, err)
        except Exception as err:
            original = err
            outcome = (False, RankZeroError(f"rank 0 failed: {type(err).__name__}: {err}"))
    ok, payload = collective.broadcast(outcome)
    if ok:
        result: T = payload
        return result
    if original is not None:
        raise original
    assert isinstance(payload, BsoError)
    raise payload
