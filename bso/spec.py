"""The job specification users write, and the hardware a trial runs on."""

from __future__ import annotations

import hashlib
import json
import math
import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# Batch sizes beyond this are almost certainly a typo (an extra zero or two).
MAX_BATCH_SIZE = 1 << 22
_JOB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
# A generated id appends "-" and 12 hex digits to the prefix; ids are at most 128.
MAX_PREFIX_LENGTH = 128 - 13

PolicyName = Literal["bso", "zeus"]


class Hardware(BaseModel):
    """The GPUs one trial runs on; learning is kept separately per hardware key."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    gpu_model: Annotated[str, Field(min_length=1, max_length=128)] = "cpu"
    gpu_count: Annotated[int, Field(ge=1, le=4096)] = 1
    max_power_w: Annotated[float, Field(gt=0, le=100_000)] = 300.0
    """Maximum power limit of one GPU, in watts."""

    @property
    def key(self) -> str:
        """Identity of a hardware configuration: same model and count learn together."""
        return f"{self.gpu_model} x{self.gpu_count}"

    @property
    def total_max_power_w(self) -> float:
        """``MaxPower`` of the cost formula: the power limit times the GPU count."""
        return self.max_power_w * self.gpu_count


class JobSpec(BaseModel):
    """What a recurring job tells bso about itself (Zeus's ``JobSpec`` plus hardware).

    Field names follow Zeus so that users can move over without relearning them.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    job_id: str | None = None
    job_id_prefix: str | None = None
    batch_sizes: list[int]
    default_batch_size: int
    eta_knob: float = 0.5
    beta_knob: float | None = 2.0
    target_metric: float
    higher_is_better_metric: bool = True
    max_epochs: Annotated[int, Field(ge=1, le=100_000)] = 100
    num_pruning_rounds: Annotated[int, Field(ge=1, le=10)] = 2
    window_size: Annotated[int, Field(ge=0, le=10_000)] = 10
    mab_prior_mean: float = 0.0
    mab_prior_precision: Annotated[float, Field(ge=0)] = 0.0
    mab_num_explorations: Annotated[int, Field(ge=0, le=100)] = 2
    mab_seed: int | None = None
    policy: PolicyName = "bso"
    hardware: Hardware = Field(default_factory=Hardware)

    @field_validator("job_id", "job_id_prefix")
    @classmethod
    def _check_id(cls, value: str | None) -> str | None:
        if value is not None and not _JOB_ID_RE.match(value):
            raise ValueError(
                "must be 1-128 characters of letters, digits, '.', '_', ':' or '-', "
                "starting with a letter or digit"
            )
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

    @field_validator("batch_sizes")
    @classmethod
    def _check_batch_sizes(cls, sizes: list[int]) -> list[int]:
        if not sizes:
            raise ValueError("batch_sizes is empty: give at least one batch size")
        bad = [b for b in sizes if b <= 0]
        if bad:
            raise ValueError(f"batch sizes must be positive, got {bad}")
        absurd = [b for b in sizes if b > MAX_BATCH_SIZE]
        if absurd:
            raise ValueError(f"batch sizes above {MAX_BATCH_SIZE} are not plausible, got {absurd}")
        dupes = sorted({b for b in sizes if sizes.count(b) > 1})
        if dupes:
            raise ValueError(f"batch_sizes has duplicates: {dupes}")
        return sorted(sizes)

    @field_validator("eta_knob")
    @classmethod
    def _check_eta(cls, eta: float) -> float:
        if not 0.0 <= eta <= 1.0:
            raise ValueError(f"eta_knob must be within [0, 1], got {eta}")
        return eta

    @field_validator("beta_knob")
    @classmethod
    def _check_beta(cls, beta: float | None) -> float | None:
        if beta is not None and not (beta > 1.0 and math.isfinite(beta)):
            raise ValueError(
                f"beta_knob must be a finite number above 1 (or None to disable early stop), "
                f"got {beta}"
            )
        return beta

    @field_validator("target_metric", "mab_prior_mean")
    @classmethod
    def _check_finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError(f"must be a finite number, got {value}")
        return value

    @model_validator(mode="after")
    def _check_consistency(self) -> JobSpec:
        if self.job_id is None and self.job_id_prefix is None:
            raise ValueError("give job_id, or job_id_prefix to have one generated")
        if self.default_batch_size not in self.batch_sizes:
            raise ValueError(
                f"default_batch_size {self.default_batch_size} is not in batch_sizes "
                f"{self.batch_sizes}"
            )
        return self

    def config_fingerprint(self) -> str:
        """Hash of everything that must match when a job id is registered again.

        The id fields and the hardware are left out: the same job may recur on
        other GPUs, and bso keeps its learning per hardware key instead.
        """
        payload = self.model_dump(mode="json", exclude={"job_id", "job_id_prefix", "hardware"})
        blob = json.dumps(payload, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()

    def cost(self, energy_j: float, time_s: float) -> float:
        """Zeus's cost: ``eta * energy + (1 - eta) * MaxPower * time``."""
        return cost(energy_j, time_s, self.eta_knob, self.hardware.total_max_power_w)


def cost(energy_j: float, time_s: float, eta_knob: float, max_power_w: float) -> float:
    """``eta * ETA + (1 - eta) * MaxPower * TTA``, in joules."""
    return eta_knob * energy_j + (1.0 - eta_knob) * max_power_w * time_s
