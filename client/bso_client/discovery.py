"""Batch sizes "auto": probe the model's memory once per hardware and model, then cache.

A job registered without ``batch_sizes`` hands bso a :class:`Discovery`: a
factory that builds the model, its optimizer and a batch maker (what ``bso
probe`` takes).  :func:`discover` runs :func:`~bso_client.memory_probe.probe_memory`
on it, turns the largest batch that fits into a :class:`~bso.spec.BatchPlan`
(:func:`plan_from_max`), and caches the result under a key of the hardware,
the model's shapes and the probe's settings, so a recurring job probes once,
not every run.  ``reprobe_memory=True`` (the optimizer's) probes again.

Micro-batching: the probe's limit is what one device holds in one pass.  With
a ``micro_batch_size`` each device runs the batch as whole micro-batches and
accumulates their gradients, so memory no longer bounds the batch: the
candidates then go up to ``limit`` (a global batch size) if given, else to what
fits in one pass per device (the same range as without accumulation, run in
smaller passes).  Either way every candidate is a multiple of micro-batch x
devices, as :class:`~bso.spec.JobSpec` requires.

Importing this module does not import torch.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bso.spec import BatchPlan, memory_size
from bso_client.batch_candidates import DEFAULT_MIN_BATCH_SIZE, auto_batch_sizes
from bso_client.errors import NoBatchSizeFits
from bso_client.global_state import preserved_global_state

logger = logging.getLogger(__name__)

CUDA_SAFETY_MARGIN = 0.10
"""Share of a GPU's free memory left out of the budget: other processes, the CUDA
context's own growth, the allocator's fragmentation."""
CACHE_VERSION = 1
"""Bumped when what is cached or how it is keyed changes: older entries are ignored."""

ProbeFactory = Callable[[], tuple[Any, Any, Any, Any]]
"""``() -> (model, optimizer, make_batch, loss_fn)``, ``make_batch(n) -> (inputs..., targets)``."""


@dataclass(frozen=True)
class Discovery:
    """How to find a job's batch sizes when it lists none (see the module docstring).

    ``memory_budget``: what one training pass may peak at, in bytes or as
    ``bso probe --memory-budget`` takes it (``"256MiB"``, ``"2GiB"``); None on a
    GPU takes its free memory less :data:`CUDA_SAFETY_MARGIN` (required on the
    CPU).
    ``device``: where to probe (None: ``cuda`` if torch sees one, else ``cpu``).
    ``limit``: the largest global batch size to consider.
    ``cache_dir``: None reads ``BSO_CACHE_DIR``, else ``$XDG_CACHE_HOME/bso`` or
    ``~/.cache/bso``.
    ``explore_micro_batch``: runs split their batch as earlier runs' micro-batch
    explorations settled (``BatchSizeOptimizer(explore_micro_batch=True)``).
    """

    factory: ProbeFactory
    memory_budget: int | str | None = None
    device: str | None = None
    micro_batch_size: int | None = None
    limit: int | None = None
    min_batch_size: int = DEFAULT_MIN_BATCH_SIZE
    cache_dir: Path | None = None
    explore_micro_batch: bool = False

    def __post_init__(self) -> None:
        """A size text becomes bytes now, so a typo fails here, naming the argument,
        not inside the probe."""
        if self.memory_budget is not None:
            try:
                budget = memory_size(self.memory_budget)
            except ValueError as exc:
                raise ValueError(f"Discovery(memory_budget=...): {exc}") from None
            object.__setattr__(self, "memory_budget", budget)

    @property
    def memory_budget_bytes(self) -> int | None:
        """:attr:`memory_budget` in bytes (a text was converted at construction)."""
        return None if self.memory_budget is None else memory_size(self.memory_budget)


@dataclass(frozen=True)
class ProbedPlan:
    """The plan a probe gave, with what was measured (``bso probe --json`` prints it)."""

    plan: BatchPlan
    max_batch_size: int
    """Largest batch one device runs in one pass within the budget."""
    predicted_peak_bytes: int
    measured_peak_bytes: int
    memory_budget_bytes: int
    trials: int
    steps: list[tuple[int, int | None]]
    bytes_per_sample: int
    fixed_bytes: int
    device: str
    seconds: float
    cached: bool = False

    def to_json(self) -> dict[str, Any]:
        plan = self.plan
        devices = plan.devices or 1
        micro = plan.micro_batch_size
        return {
            "max_batch_size": self.max_batch_size,
            "default_batch_size": plan.default_batch_size,
            "candidates": plan.batch_sizes,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "measured_peak_bytes": self.measured_peak_bytes,
            "memory_budget_bytes": self.memory_budget_bytes,
            "trials": self.trials,
            "steps": [{"batch_size": b, "peak_bytes": m} for b, m in self.steps],
            "micro_batch_size": micro,
            "devices": devices,
            "per_device_batch_size": {str(b): plan.split(b).per_device for b in plan.batch_sizes},
            "accumulation_steps": {
                str(b): plan.split(b).accumulation_steps for b in plan.batch_sizes
            },
            "bytes_per_sample": self.bytes_per_sample,
            "fixed_bytes": self.fixed_bytes,
            "device": self.device,
            "seconds": self.seconds,
            "cached": self.cached,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ProbedPlan:
        plan = BatchPlan(
            batch_sizes=data["candidates"],
            default_batch_size=data["default_batch_size"],
            micro_batch_size=data["micro_batch_size"],
            devices=data["devices"] if data["devices"] != 1 else None,
        )
        return cls(
            plan=plan,
            max_batch_size=data["max_batch_size"],
            predicted_peak_bytes=data["predicted_peak_bytes"],
            measured_peak_bytes=data["measured_peak_bytes"],
            memory_budget_bytes=data["memory_budget_bytes"],
            trials=data["trials"],
            steps=[(s["batch_size"], s["peak_bytes"]) for s in data["steps"]],
            bytes_per_sample=data["bytes_per_sample"],
            fixed_bytes=data["fixed_bytes"],
            device=data["device"],
            seconds=data["seconds"],
            cached=True,
        )


def plan_from_max(
    max_per_device: int,
    *,
    devices: int = 1,
    micro_batch_size: int | None = None,
    limit: int | None = None,
    default_cap: int | None = None,
    min_batch_size: int = DEFAULT_MIN_BATCH_SIZE,
) -> BatchPlan:
    """Candidates (global batch sizes) from the largest batch one device runs in one pass.

    Per device, the candidates are :func:`~bso_client.batch_candidates.auto_batch_sizes`
    (powers of two, or micro-batch times powers of two, and the top); each is then
    multiplied by ``devices``.  ``limit`` and ``default_cap`` are global sizes.  The
    default is the largest candidate within ``default_cap`` that one pass holds.
    """
    if micro_batch_size is not None and micro_batch_size > max_per_device:
        raise NoBatchSizeFits(
            micro_batch_size,
            f"a micro-batch of {micro_batch_size} does not fit: the largest pass that fits "
            f"is {max_per_device} per device",
        )
    top = max_per_device
    if micro_batch_size is not None and limit is not None:
        top = limit // devices  # accumulation: memory no longer bounds the batch
    elif limit is not None:
        top = min(top, limit // devices)
    step = micro_batch_size or 1
    # The default is a size the job trains well at: the user's (``default_cap``),
    # and never one that needs accumulation when a single pass would hold it.
    cap = min(default_cap // devices if default_cap else top, max_per_device)
    per_device = auto_batch_sizes(
        top,
        min_batch_size=step if micro_batch_size else min(min_batch_size, top),
        default_cap=max(cap, step),
        step=step,
    )
    return BatchPlan(
        batch_sizes=[b * devices for b in per_device.batch_sizes],
        default_batch_size=per_device.default_batch_size * devices,
        micro_batch_size=micro_batch_size,
        devices=devices if devices > 1 else None,
    )


def probe_plan(
    discovery: Discovery,
    *,
    devices: int = 1,
    default_cap: int | None = None,
    hardware_key: str = "",
    read_cache: bool = True,
    write_cache: bool = True,
) -> ProbedPlan:
    """The plan of ``discovery``'s model on this hardware: from the cache, else probed
    (and cached).  ``read_cache=False`` probes again (memory changed: a new
    driver, more free memory) and replaces the entry.

    Raises :class:`~bso_client.errors.NoBatchSizeFits` when not even the
    smallest probe fits the budget.

    Leaves no trace (:mod:`bso_client.global_state`): the factory's model, the
    cache key's batch and the probe's steps draw from the global random
    generators, which are put back, so a seeded script builds the same model
    whether the plan was probed, read from the cache, or typed.
    """
    with preserved_global_state():
        return _probe_plan(
            discovery,
            devices=devices,
            default_cap=default_cap,
            hardware_key=hardware_key,
            read_cache=read_cache,
            write_cache=write_cache,
        )


def _probe_plan(
    discovery: Discovery,
    *,
    devices: int,
    default_cap: int | None,
    hardware_key: str,
    read_cache: bool,
    write_cache: bool,
) -> ProbedPlan:
    import torch

    from bso_client.memory_probe import probe_memory

    device = discovery.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, optimizer, make_batch, loss_fn = discovery.factory()
    model.to(device)
    key = cache_key(
        discovery,
        device=device,
        devices=devices,
        default_cap=default_cap,
        hardware_key=hardware_key,
        model=model,
        make_batch=make_batch,
        optimizer=optimizer,
    )
    try:
        path: Path | None = cache_dir(discovery.cache_dir) / f"probe-{key}.json"
    except NoCacheDir as exc:
        logger.info("bso: the probe's answer is not cached (%s)", exc)
        path = None
    if read_cache and path is not None and path.is_file():
        try:
            found = ProbedPlan.from_json(json.loads(path.read_text())["result"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            logger.warning("bso: ignoring unreadable probe cache %s (%s)", path, exc)
        else:
            logger.info("bso: batch sizes of this model and hardware from the cache %s", path)
            return found
    budget = memory_budget(device, discovery.memory_budget_bytes)
    started = time.perf_counter()
    probe = probe_memory(
        model,
        optimizer,
        make_batch,
        loss_fn,
        budget_bytes=budget,
        device=device,
        limit=None if discovery.micro_batch_size else _per_device(discovery.limit, devices),
    )
    plan = plan_from_max(
        probe.max_batch_size,
        devices=devices,
        micro_batch_size=discovery.micro_batch_size,
        limit=discovery.limit,
        default_cap=default_cap,
        min_batch_size=discovery.min_batch_size,
    )
    result = ProbedPlan(
        plan=plan,
        max_batch_size=probe.max_batch_size,
        predicted_peak_bytes=probe.predicted_peak_bytes,
        measured_peak_bytes=probe.measured_peak_bytes,
        memory_budget_bytes=budget,
        trials=probe.trials,
        steps=list(probe.points),
        bytes_per_sample=round(probe.model.bytes_per_sample),
        fixed_bytes=round(probe.model.fixed_bytes),
        device=device,
        seconds=round(time.perf_counter() - started, 2),
    )
    if write_cache and path is not None:
        _write_cache(path, result)
    return result


def memory_budget(device: str, given: int | None) -> int:
    """``given``, or on a CUDA device its free memory less the safety margin.

    Reached from Python only (``bso probe`` checks ``--memory-budget`` first), so
    the error names the Python argument.
    """
    if given is not None:
        return given
    if not device.startswith("cuda"):
        raise ValueError(
            f"probing on {device} needs a memory budget: pass "
            "Discovery(..., memory_budget='2GiB') (bytes or a size text), the memory "
            "a training step may use there"
        )
    import torch

    free, _total = torch.cuda.mem_get_info(torch.device(device))
    return int(free * (1 - CUDA_SAFETY_MARGIN)) + int(torch.cuda.memory_allocated(device))


class NoCacheDir(OSError):
    """No folder for the client's cache can be named (:func:`cache_dir`): an ``OSError``,
    so that whatever copes with a cache it cannot write copes with this too."""


def cache_dir(given: Path | None) -> Path:
    """``given``, else ``BSO_CACHE_DIR``, else ``$XDG_CACHE_HOME/bso``, else
    ``~/.cache/bso``; :class:`NoCacheDir` where there is no home either (``HOME``
    unset, and a user id with no entry in the passwd database: a container's
    arbitrary uid), where ``Path.home()`` would raise a ``RuntimeError``."""
    if given is not None:
        return given
    if os.environ.get("BSO_CACHE_DIR"):
        return Path(os.environ["BSO_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME")
    if not base:
        home = os.path.expanduser("~")
        if home.startswith("~"):
            raise NoCacheDir(
                "no folder for bso's client cache: BSO_CACHE_DIR, XDG_CACHE_HOME and HOME "
                "are unset, and this user has no home in the passwd database"
            )
        base = os.path.join(home, ".cache")
    return Path(base) / "bso"


def cache_key(
    discovery: Discovery,
    *,
    device: str,
    devices: int,
    default_cap: int | None,
    hardware_key: str,
    model: Any,
    make_batch: Callable[[int], Any],
    optimizer: Any = None,
) -> str:
    """What the probe's answer depends on: the hardware (its key and, on a GPU, its
    memory), torch's version, the model's structure (its ``repr``, the source of its
    ``forward``), tensors' and the batch's shapes and types, the optimizer's class
    and settings, and the probe's settings.  Weights' values do not matter to memory.
    A change none of these show (a helper ``forward`` calls, an environment
    variable) needs ``reprobe_memory=True``."""
    import torch

    parsed = torch.device(device)
    total = torch.cuda.get_device_properties(parsed).total_memory if parsed.type == "cuda" else None
    material = {
        "version": CACHE_VERSION,
        "torch": torch.__version__,
        "hardware": hardware_key,
        "device": parsed.type,
        "device_memory": total,
        "model": type(model).__qualname__,
        "structure": repr(model),
        "forward": _source_of(getattr(type(model), "forward", None)),
        "optimizer": _optimizer_settings(optimizer),
        "tensors": [f"{n}:{tuple(t.shape)}:{t.dtype}" for n, t in model.state_dict().items()],
        "batch": _shapes(make_batch(2)),
        "settings": {
            "budget": discovery.memory_budget_bytes,
            "micro_batch_size": discovery.micro_batch_size,
            "limit": discovery.limit,
            "min_batch_size": discovery.min_batch_size,
            "devices": devices,
            "default_cap": default_cap,
        },
    }
    blob = json.dumps(material, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def _source_of(function: Any) -> str:
    try:
        return inspect.getsource(function)
    except (OSError, TypeError):
        return ""


_NOT_MEMORY = frozenset({"params", "lr", "initial_lr", "bso_unscaled_lr"})
"""Param-group keys that do not change a step's memory (a new rate is no new probe)."""


def _optimizer_settings(optimizer: Any) -> Any:
    """The optimizer's class and its param groups' settings (not the parameters)."""
    if optimizer is None:
        return None
    groups = [
        {k: v for k, v in group.items() if k not in _NOT_MEMORY}
        for group in getattr(optimizer, "param_groups", [])
    ]
    return [type(optimizer).__qualname__, groups]


def _shapes(value: Any) -> Any:
    """Shapes and types of a (nested) batch, without its batch dimension's size."""
    if isinstance(value, list | tuple):
        return [_shapes(v) for v in value]
    if isinstance(value, dict):
        return {k: _shapes(v) for k, v in sorted(value.items())}
    shape = getattr(value, "shape", None)
    if shape is not None:
        return [list(shape)[1:], str(getattr(value, "dtype", ""))]
    return type(value).__name__


def _per_device(limit: int | None, devices: int) -> int | None:
    return None if limit is None else max(limit // devices, 1)


def _write_cache(path: Path, result: ProbedPlan) -> None:
    """Atomically (a rename): a run killed mid-write leaves no half entry."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        scratch = path.with_suffix(f".{os.getpid()}.tmp")
        scratch.write_text(json.dumps({"result": result.to_json()}, indent=1))
        scratch.replace(path)
    except OSError as exc:
        logger.warning("bso: could not cache the probe's result in %s (%s)", path, exc)


__all__ = ["Discovery", "ProbedPlan", "plan_from_max", "probe_plan"]
