"""The job specification users write, and the hardware a trial runs on.

Every number a caller sends is finite and within a physical bound, and every
integer fits the 32-bit SQL columns that store it.  The bounds are far beyond
any real training job, so they refuse only typos and attacks; what they buy
is that no computation on accepted input can overflow.  In particular the
cost (:func:`bso.core.cost.cost`) of any accepted report is at most :data:`MAX_COST`::

    eta * energy + (1 - eta) * MaxPower * time
      <= 1 * MAX_ENERGY_J + 1 * (MAX_GPU_COUNT * MAX_POWER_W) * MAX_TIME_S
      =  1e15 + 4096 * 1e5 * 1e9  ~=  4.1e17 J

(each term is a product of bounded non-negative factors, ``eta`` and
``1 - eta`` are in [0, 1]), and the early-stop bound ``beta_knob * cost`` is at
most ``MAX_BETA * MAX_COST`` ~= 4.1e23: both are finite doubles with room to
spare (a double overflows above 1.8e308).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections import Counter
from typing import Annotated, Final, Literal, NamedTuple

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

from bso.ids import JOB_ID_RULE, MAX_ID_LENGTH, is_job_id

MAX_SQL_INT: Final = 2**31 - 1
"""Largest value of a 32-bit SQL ``INTEGER`` column (trial numbers, epochs, batch
sizes): every integer bso stores must fit one."""

MAX_BATCH_SIZE: Final = 1 << 22
"""Batch sizes beyond this (4 Mi samples) are almost certainly a typo (an extra
zero or two); it also keeps a size far inside :data:`MAX_SQL_INT`."""

MAX_BATCH_SIZES: Final = 4096
"""Most batch sizes one job may list: a search space no job needs more of, and
it bounds the work (and the message) of validating one spec."""

MAX_GPU_COUNT: Final = 4096
"""Most GPUs one trial runs on."""

MAX_POWER_W: Final = 100_000.0
"""Highest per-GPU power limit, in watts (100 kW; a GPU draws about 1 kW)."""

MAX_TIME_S: Final = 1e9
"""Longest cumulative training time of a trial, in seconds (about 32 years)."""

MAX_ENERGY_J: Final = 1e15
"""Most cumulative energy of a trial, in joules (1 PJ, about 280 GWh, several
times the largest training runs known)."""

MAX_METRIC: Final = 1e15
"""Largest absolute value of a metric (and of ``target_metric``)."""

MAX_BETA: Final = 1e6
"""Largest ``beta_knob``: a trial costing a million times the best is stopped
anyway; use None to disable the bound."""

MAX_EXPLORATION_BUDGET: Final = 10.0
"""Largest ``exploration_budget``: ten times always-default's cost is no limit at all."""

MIN_EXPLORATION_BUDGET: Final = 1e-4
"""Smallest positive ``exploration_budget`` (0.01%): the budget is counted from
recurrence ``1 / budget``, which must stay a number (0 is accepted: no exploring)."""

MAX_COST: Final = MAX_ENERGY_J + MAX_GPU_COUNT * MAX_POWER_W * MAX_TIME_S
"""Upper bound of any trial's cost, in joules (about 4.1e17): see the module
docstring."""

MAX_PRIOR_MEAN: Final = 1e18
"""Largest absolute ``mab_prior_mean``: the prior is on the reward ``-cost``,
and every cost is within [0, :data:`MAX_COST`]."""

MAX_PRIOR_PRECISION: Final = 1e18
"""Largest ``mab_prior_precision`` (1/J^2): with :data:`MAX_PRIOR_MEAN` their
product, which the bandit computes, stays below 1e36."""

MAX_SEED: Final = 2**63 - 1
"""Largest ``mab_seed``: numpy takes any non-negative integer, the store a
signed 64-bit one."""

MAX_PREFIX_LENGTH: Final = MAX_ID_LENGTH - 13
"""A generated id appends "-" and 12 hex digits to the prefix; ids are at most 128."""

_SHOWN: Final = 10
"""Most offending values an error message lists (the rest are counted)."""

PolicyName = Literal["bso", "zeus"]

PLAN_FIELDS: Final = ("batch_sizes", "default_batch_size", "micro_batch_size", "devices")
"""The fields that say which batch sizes can run on a hardware and how: they may
differ between the hardware lanes of one job (:class:`BatchPlan`)."""


_SIZE_UNITS: Final = {"": 1, "b": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4}
_BINARY_UNITS: Final = {"ki": 1024, "mi": 1024**2, "gi": 1024**3, "ti": 1024**4}


def memory_size(value: int | str) -> int:
    """Bytes from ``512MiB``, ``2GB``, ``1.5G``, ``1000000`` or an int: the one syntax of
    ``bso probe --memory-budget`` and ``Discovery(memory_budget=...)``.

    Raises ``ValueError`` without naming the argument: each caller names its own
    (``--memory-budget`` on the command line, ``memory_budget=`` in Python).
    """
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"not a memory size: {value!r} (give bytes, or a text like '512MiB')")
    if isinstance(value, int):
        size = value
    else:
        found = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]i?)?b?\s*", value.lower())
        if not found:
            raise ValueError(f"not a memory size: {value!r} (e.g. 512MiB, 2GB)")
        unit = found.group(2) or ""
        size = int(float(found.group(1)) * (_BINARY_UNITS.get(unit) or _SIZE_UNITS[unit]))
    if size < 1:
        raise ValueError(f"a memory budget must be positive, got {value!r}")
    return size


def listed(values: list[int]) -> str:
    """``values`` for an error message: at most :data:`_SHOWN` of them, so that a
    message stays short whatever the input's length."""
    if len(values) <= _SHOWN:
        return str(values)
    return f"{values[:_SHOWN]} and {len(values) - _SHOWN} more"


def refuse_bools(value: object) -> object:
    """``value`` unchanged, or a ValueError if it (or an item of it) is a bool: pydantic
    takes True for 1, so ``max_epochs=True`` (a flag where a count belongs) would train
    one epoch, ``batch_sizes=[True, 32]`` list a batch of one, ``gpu_count=True`` one GPU.

    The message names the bool and its place, not the value: this runs before
    pydantic's checks (any input an event carries), and the message goes into the
    caller's reply and the worker's log, which a list echoed whole made megabytes."""
    items: list[object] | tuple[object, ...] = value if isinstance(value, list | tuple) else [value]
    for index, item in enumerate(items):
        if isinstance(item, bool):
            where = "" if items is not value else f" (item {index})"
            raise ValueError(f"a whole number, not True or False, got {item}{where}")
    return value


class Hardware(BaseModel):
    """The GPUs one trial runs on; learning is kept separately per hardware key."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    gpu_model: Annotated[str, Field(min_length=1, max_length=128)] = "cpu"
    """Printable text (no control, format or surrogate characters): it is part of the
    hardware key, which appears in replies, logs and the ``status`` output."""
    gpu_count: Annotated[int, Field(ge=1, le=MAX_GPU_COUNT)] = 1
    """1 to :data:`MAX_GPU_COUNT` (4096)."""
    max_power_w: Annotated[float, Field(gt=0, le=MAX_POWER_W, allow_inf_nan=False)] = 300.0
    """Maximum power limit of one GPU, in watts: above 0, at most :data:`MAX_POWER_W`
    (100 kW)."""
    devices: Annotated[int, Field(ge=2, le=MAX_GPU_COUNT)] | None = None
    """Data-parallel devices (processes) that train one batch together, when more
    than one: the run's ``JobSpec.devices``.  A batch size is the global batch, so
    runs of another process count split it another way and cost another amount:
    they learn in a lane of their own (:attr:`key`).  None: one device, and what
    clients before issue 23 sent."""

    @model_serializer(mode="wrap")
    def _omit_unset_devices(self, handler: SerializerFunctionWrapHandler) -> dict[str, object]:
        """A single-process hardware serializes as before ``devices`` existed: the same
        bytes on the wire (workers of an older version accept it) and in the store."""
        data: dict[str, object] = handler(self)
        if self.devices is None:
            data.pop("devices", None)
        return data

    @field_validator("gpu_count", "devices", mode="before")
    @classmethod
    def _refuse_bools(cls, value: object) -> object:
        return refuse_bools(value)

    @field_validator("gpu_model")
    @classmethod
    def _check_gpu_model(cls, value: str) -> str:
        if not value.isprintable():
            raise ValueError("must be printable text (no control characters)")
        return value

    @property
    def key(self) -> str:
        """Identity of a hardware configuration: same model, count and data-parallel
        devices learn together (``A100 x8``, ``A100 x8 dp8``, ``cpu-time-only x1 dp2``).

        A single-process run keeps the key lanes always had, so what a job learned
        before ``devices`` existed stays its single-process lane's; see
        ``docs/client.md``, "Lanes", for data-parallel lanes recorded before.
        """
        base = f"{self.gpu_model} x{self.gpu_count}"
        return base if self.devices is None else f"{base} dp{self.devices}"

    def with_devices(self, devices: int | None) -> Hardware:
        """This hardware trained by ``devices`` data-parallel processes (None or 1: one)."""
        return self.model_copy(update={"devices": devices if devices and devices > 1 else None})

    @property
    def total_max_power_w(self) -> float:
        """``MaxPower`` of the cost formula: the power limit times the GPU count."""
        return self.max_power_w * self.gpu_count


COUNT_FIELDS: Final = (
    "batch_sizes",
    "default_batch_size",
    "max_epochs",
    "num_pruning_rounds",
    "window_size",
    "mab_num_explorations",
    "micro_batch_size",
    "devices",
    "mab_seed",
)
"""The fields of :class:`JobSpec` that hold whole numbers, where a bool is a mistake."""


class JobSpec(BaseModel):
    """What a recurring job tells bso about itself (Zeus's ``JobSpec`` plus hardware).

    Field names follow Zeus so that users can move over without relearning them.
    The bounds of every field are in its docstring and in ``docs/client.md``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    job_id: str | None = None
    """1-128 letters, digits, ``.``, ``_``, ``:`` or ``-`` (:mod:`bso.ids`)."""
    job_id_prefix: str | None = None
    """Like a job id, at most :data:`MAX_PREFIX_LENGTH` characters."""
    batch_sizes: Annotated[list[int], Field(max_length=MAX_BATCH_SIZES)]
    """1 to :data:`MAX_BATCH_SIZES` distinct sizes, each 1 to :data:`MAX_BATCH_SIZE`."""
    default_batch_size: Annotated[int, Field(ge=1, le=MAX_BATCH_SIZE)]
    """One of ``batch_sizes``."""
    eta_knob: float = 0.5
    """Weight of energy against time in the cost, in [0, 1]."""
    beta_knob: float | None = 2.0
    """Early-stop factor: finite, above 1, at most :data:`MAX_BETA` (1e6); None disables it."""
    target_metric: Annotated[float, Field(ge=-MAX_METRIC, le=MAX_METRIC)]
    """Finite, absolute value at most :data:`MAX_METRIC` (1e15)."""
    higher_is_better_metric: bool = True
    """True: a run converges once its metric is at or above ``target_metric`` (an
    accuracy); False: at or below it (a validation loss, an error rate)."""
    max_epochs: Annotated[int, Field(ge=1, le=100_000)] = 100
    num_pruning_rounds: Annotated[int, Field(ge=1, le=10)] = 2
    window_size: Annotated[int, Field(ge=0, le=10_000)] = 10
    mab_prior_mean: Annotated[float, Field(ge=-MAX_PRIOR_MEAN, le=MAX_PRIOR_MEAN)] = 0.0
    """Finite, absolute value at most :data:`MAX_PRIOR_MEAN` (1e18)."""
    mab_prior_precision: Annotated[
        float, Field(ge=0, le=MAX_PRIOR_PRECISION, allow_inf_nan=False)
    ] = 0.0
    """Finite, 0 to :data:`MAX_PRIOR_PRECISION` (1e18)."""
    mab_num_explorations: Annotated[int, Field(ge=0, le=100)] = 2
    mab_seed: Annotated[int, Field(ge=0, le=MAX_SEED)] | None = None
    """0 to 2^63 - 1, or None for a random seed."""
    micro_batch_size: Annotated[int, Field(ge=1, le=MAX_BATCH_SIZE)] | None = None
    """Samples one device processes in one forward/backward pass; None: the whole
    per-device batch in one pass.  With it, a batch size ``b`` runs as
    ``b / (micro_batch_size * devices)`` accumulated passes (:meth:`split`)."""
    devices: Annotated[int, Field(ge=1, le=MAX_GPU_COUNT)] | None = None
    """Data-parallel devices one batch is split across; None: 1 (the client fills in
    its world size).  A batch size is the global batch: samples per optimizer step,
    over all devices."""
    exploration_budget: Annotated[float, Field(ge=0, le=MAX_EXPLORATION_BUDGET)] | None = None
    """Extra cost exploration may add over the job's life, as a fraction of always
    running the default (0.02: at most 2% more); None: no limit.  What it guarantees
    is in docs/client.md ("Exploration budget")."""
    policy: PolicyName = "bso"
    hardware: Hardware = Field(default_factory=Hardware)

    @field_validator("job_id", "job_id_prefix")
    @classmethod
    def _check_id(cls, value: str | None) -> str | None:
        if value is not None and not is_job_id(value):
            raise ValueError(JOB_ID_RULE)
        return value

    @field_validator("job_id_prefix")
    @classmethod
    def _check_prefix_length(cls, value: str | None) -> str | None:
        if value is not None and len(value) > MAX_PREFIX_LENGTH:
            raise ValueError(
                f"must be at most {MAX_PREFIX_LENGTH} characters: bso appends '-' and "
                "12 characters to make the job id"
            )
        return value

    @field_validator(*COUNT_FIELDS, mode="before")
    @classmethod
    def _refuse_bools(cls, value: object) -> object:
        return refuse_bools(value)

    @field_validator("batch_sizes")
    @classmethod
    def _check_batch_sizes(cls, sizes: list[int]) -> list[int]:
        """Linear in the number of sizes (one pass each, a Counter for duplicates):
        validation must not be a way to burn a worker's time."""
        if not sizes:
            raise ValueError("batch_sizes is empty: give at least one batch size")
        bad = [b for b in sizes if b <= 0]
        if bad:
            raise ValueError(f"batch sizes must be positive, got {listed(bad)}")
        absurd = [b for b in sizes if b > MAX_BATCH_SIZE]
        if absurd:
            raise ValueError(
                f"batch sizes above {MAX_BATCH_SIZE} are not plausible, got {listed(absurd)}"
            )
        dupes = sorted(b for b, n in Counter(sizes).items() if n > 1)
        if dupes:
            raise ValueError(f"batch_sizes has duplicates: {listed(dupes)}")
        return sorted(sizes)

    @field_validator("exploration_budget")
    @classmethod
    def _check_budget(cls, budget: float | None) -> float | None:
        return None if budget is None else checked_exploration_budget(budget)

    @field_validator("eta_knob")
    @classmethod
    def _check_eta(cls, eta: float) -> float:
        if not 0.0 <= eta <= 1.0:
            raise ValueError(f"eta_knob must be within [0, 1], got {eta}")
        return eta

    @field_validator("beta_knob")
    @classmethod
    def _check_beta(cls, beta: float | None) -> float | None:
        if beta is not None and not (1.0 < beta <= MAX_BETA):
            raise ValueError(
                f"beta_knob must be a finite number above 1 and at most {MAX_BETA:g} "
                f"(or None to disable early stop), got {beta}"
            )
        return beta

    @field_validator("target_metric", "mab_prior_mean", mode="before")
    @classmethod
    def _check_finite(cls, value: object) -> object:
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"must be a finite number, got {value}")
        return value

    @model_validator(mode="after")
    def _check_consistency(self) -> JobSpec:
        if self.job_id is None and self.job_id_prefix is None:
            raise ValueError("give job_id, or job_id_prefix to have one generated")
        if self.default_batch_size not in self.batch_sizes:
            raise ValueError(
                f"default_batch_size {self.default_batch_size} is not in batch_sizes "
                f"{listed(self.batch_sizes)}"
            )
        unit = self.batch_unit
        uneven = [b for b in self.batch_sizes if b % unit]
        if uneven:
            raise ValueError(
                f"every batch size must be a multiple of micro_batch_size x devices = {unit} "
                f"(each device runs whole micro-batches), got {listed(uneven)}"
            )
        return self

    @property
    def batch_unit(self) -> int:
        """Every batch size is a multiple of this: one micro-batch on every device."""
        return (self.micro_batch_size or 1) * (self.devices or 1)

    def split(self, batch_size: int) -> BatchSplit:
        """How ``batch_size`` (global, per optimizer step) runs on this job's devices."""
        return split_batch(batch_size, self.micro_batch_size, self.devices)

    @property
    def plan(self) -> BatchPlan:
        return BatchPlan.model_validate(self.model_dump(include=set(PLAN_FIELDS)))

    def with_plan(self, plan: BatchPlan) -> JobSpec:
        """This spec with another lane's batch sizes (already validated together)."""
        return self.model_copy(update=plan.model_dump())

    def metric_reached(self, metric: float) -> bool:
        """Whether ``metric`` reaches ``target_metric`` (from above when lower is better):
        the one convergence test of the policies and of a detached run."""
        target = self.target_metric
        return metric >= target if self.higher_is_better_metric else metric <= target

    def config_fingerprint(self) -> str:
        """Hash of everything that must match when a job id is registered again.

        The id fields, the hardware and the batch plan (:data:`PLAN_FIELDS`) are
        left out: the same job may recur on other GPUs, where other sizes fit, and
        bso keeps its learning and the sizes per hardware lane instead.
        """
        payload = self.model_dump(
            mode="json", exclude={"job_id", "job_id_prefix", "hardware", *PLAN_FIELDS}
        )
        if payload["exploration_budget"] is None:
            del payload["exploration_budget"]  # jobs registered before the field keep theirs
        blob = json.dumps(payload, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()


def checked_exploration_budget(budget: float) -> float:
    """``budget`` if it is an exploration budget bso accepts (0, or a fraction from
    :data:`MIN_EXPLORATION_BUDGET` to :data:`MAX_EXPLORATION_BUDGET`), else ValueError:
    the one rule for ``JobSpec`` and ``bso simulate --exploration-budget``."""
    if not (budget == 0 or MIN_EXPLORATION_BUDGET <= budget <= MAX_EXPLORATION_BUDGET):
        raise ValueError(
            f"exploration_budget must be 0 or a fraction from {MIN_EXPLORATION_BUDGET:g} to "
            f"{MAX_EXPLORATION_BUDGET:g} (0.02: at most 2% above always-default), got {budget}"
        )
    return budget


class BatchSplit(NamedTuple):
    """One global batch size as each device runs it."""

    per_device: int
    """Samples per device per optimizer step (``per_device_train_batch_size`` in
    Hugging Face's terms when there is no accumulation)."""
    micro_batch_size: int
    """Samples per device per forward/backward pass (the DataLoader's batch size)."""
    accumulation_steps: int
    """Passes whose gradients are accumulated before one optimizer step."""


class BatchPlan(BaseModel):
    """The batch sizes of one hardware lane: what fits there, and how it is split.

    A job's lanes share everything else in the spec; this part may differ
    because memory does (see ``docs/client.md``, "Lanes").
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    batch_sizes: list[int]
    default_batch_size: int
    micro_batch_size: int | None = None
    devices: int | None = None

    def split(self, batch_size: int) -> BatchSplit:
        """How ``batch_size`` runs on this lane's devices (as :meth:`JobSpec.split`)."""
        return split_batch(batch_size, self.micro_batch_size, self.devices)


def split_batch(batch_size: int, micro_batch_size: int | None, devices: int | None) -> BatchSplit:
    """The one rule: ``batch_size`` over ``devices`` (None: 1), each in passes of
    ``micro_batch_size`` (None: its whole share in one pass)."""
    per_device = batch_size // (devices or 1)
    micro = micro_batch_size or per_device
    return BatchSplit(per_device, micro, per_device // micro)
