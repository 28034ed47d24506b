"""The JobSpec a run registers: as given, or with batch sizes discovered, split over devices.

A batch size in bso is the global batch: samples per optimizer step over all
data-parallel devices.  So the spec's ``devices`` is the run's world size when
it does not say (a spec that says otherwise under ``torchrun`` is refused), and
its sizes must split evenly.  The devices are part of the hardware's lane
(:meth:`~bso.spec.Hardware.with_devices`): a job run with 1 process, then with
2, learns in two lanes, and a lane's sizes always split over the devices they
were learned with, so the global batch that trains is the one bso records.
A job that lists no ``batch_sizes`` gets them from a
:class:`~bso_client.discovery.Discovery` on rank 0, once per hardware and
model (:func:`~bso_client.discovery.probe_plan` caches).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from pydantic import ValidationError

from bso.errors import ConfigMismatch, InvalidSpec
from bso.spec import PLAN_FIELDS, BatchPlan, Hardware, JobSpec, listed
from bso_client.discovery import Discovery, probe_plan

logger = logging.getLogger(__name__)

_PLACEHOLDER_PLAN = {"batch_sizes": [1], "default_batch_size": 1}
"""Stands in for the plan a discovery will fill, so every other field is checked first."""


_GIVEN_PLAN_FIELDS = ("default_batch_size", "micro_batch_size", "devices")


def _given_plan(job: Mapping[str, Any]) -> tuple[int | None, ...]:
    """The default's cap, ``micro_batch_size`` and ``devices`` of a job that lists no
    ``batch_sizes``, checked as :class:`~bso.spec.JobSpec` checks them (True where a
    count belongs, a size out of bounds, text that is no number: its
    ``ValidationError``, naming the field), before the placeholder plan replaces them:
    unchecked, ``micro_batch_size=True`` split every batch into passes of one and
    ``default_batch_size="64"`` failed inside the probe with a TypeError."""
    given = {name: job[name] for name in _GIVEN_PLAN_FIELDS if job.get(name) is not None}
    try:  # field errors only: the placeholder sizes need not agree with the given ones
        JobSpec.model_validate({**job, "default_batch_size": 1, **given, "batch_sizes": [1]})
    except ValidationError as exc:
        if any(error["loc"] for error in exc.errors()):
            raise
    return tuple(int(given[n]) if n in given else None for n in _GIVEN_PLAN_FIELDS)


class JobSetup:
    """A job as the script gave it, and what it still needs to be registered."""

    def __init__(self, job: JobSpec | Mapping[str, Any], discovery: Discovery | None) -> None:
        self.discovery = discovery
        self.default_cap: int | None = None
        self.micro_batch_size: int | None = None
        self.devices_given: int | None = None
        if isinstance(job, JobSpec):
            self.spec, self.discovers = job, False
            return
        if "batch_sizes" in job:
            self.spec, self.discovers = JobSpec.model_validate(job), False
            return
        if discovery is None:
            raise InvalidSpec(
                "the job lists no batch_sizes: list them, or pass discovery=Discovery(factory) "
                "to have bso probe the largest batch that fits and choose them"
            )
        self.default_cap, micro_batch_size, self.devices_given = _given_plan(job)
        self.micro_batch_size = discovery.micro_batch_size or micro_batch_size
        fields = {**job, **_PLACEHOLDER_PLAN, "micro_batch_size": None, "devices": None}
        self.spec, self.discovers = JobSpec.model_validate(fields), True

    def energy_refusal(self, measured: bool) -> InvalidSpec | None:
        """Why bso cannot follow this run, if ``eta_knob`` is 1 (energy only) and no
        energy is measured here: every run would cost 0 J.  Returned, not raised: one
        node of a job whose energy cannot be read (no NVML library in its container)
        trains without bso, as for any refusal (``on_unavailable="raise"`` raises)."""
        if self.spec.eta_knob == 1.0 and not measured:
            return InvalidSpec(
                "eta_knob=1 optimizes energy alone, but no energy can be measured "
                "here (no NVML GPU, no readable RAPL): every run would cost 0 J and "
                "bso could not tell batch sizes apart. Use eta_knob < 1 (time "
                "counts too), or run where energy is measurable"
            )
        return None

    def complete(
        self,
        *,
        world_size: int,
        hardware: Hardware,
        reprobe: bool,
        on_rank_zero: Callable[[Callable[[], BatchPlan]], BatchPlan],
    ) -> JobSpec:
        """The spec to register: the plan discovered (rank 0 probes, every rank gets
        it), the devices filled in, the hardware set."""
        spec = self.spec
        devices = self.devices_given if self.discovers else spec.devices
        if world_size > 1 and devices not in (None, world_size):
            raise InvalidSpec(
                f"the job says devices={devices}, but {world_size} processes train together: "
                "a batch size is the global batch over every process (leave devices out)"
            )
        devices = devices or (world_size if world_size > 1 else None)
        if self.discovers:
            plan = on_rank_zero(lambda: self._discover(devices or 1, hardware, reprobe))
        else:
            plan = spec.plan.model_copy(update={"devices": devices})
        fields = {**spec.model_dump(exclude=set(PLAN_FIELDS)), **plan.model_dump()}
        fields["hardware"] = hardware.with_devices(devices)
        try:
            return JobSpec.model_validate(fields)
        except ValidationError as exc:
            raise InvalidSpec(
                f"the job's batch sizes do not split over {devices} devices: {exc}"
            ) from exc

    def _discover(self, devices: int, hardware: Hardware, reprobe: bool) -> BatchPlan:
        assert self.discovery is not None
        discovery = self.discovery
        if self.micro_batch_size != discovery.micro_batch_size:
            discovery = replace(discovery, micro_batch_size=self.micro_batch_size)
        found = probe_plan(
            discovery,
            devices=devices,
            default_cap=self.default_cap,
            hardware_key=hardware.key,
            read_cache=not reprobe,
        )
        logger.info(
            "bso: %s batch sizes %s (default %d) on %s: the largest pass that fits is %d",
            "cached" if found.cached else "probed",
            found.plan.batch_sizes,
            found.plan.default_batch_size,
            hardware.key,
            found.max_batch_size,
        )
        return found.plan

    def adopt(self, spec: JobSpec, lane_plan: BatchPlan | None) -> JobSpec:
        """``spec`` with the plan the service keeps for this lane, when it differs from
        the one registered here (another machine of the same GPU model probed first).

        A lane whose sizes split over another number of devices than this run has
        (a lane recorded before lanes counted devices) is refused: running its sizes
        here would train another global batch than bso records.
        """
        if lane_plan is None:
            return spec
        if (lane_plan.devices or 1) != (spec.devices or 1):
            raise ConfigMismatch(
                f"job {spec.job_id or spec.job_id_prefix} on {spec.hardware.key}: this "
                f"lane's batch sizes {listed(lane_plan.batch_sizes)} are global batches "
                f"over {lane_plan.devices or 1} data-parallel devices, and this run has "
                f"{spec.devices or 1}, so it would train another batch than bso records. "
                f"Run it with {lane_plan.devices or 1} processes, or use a new job_id"
            )
        if self.discovers:
            logger.info(
                "bso: lane %s already has batch sizes %s (default %d); probed here: %s. "
                "Using the lane's",
                spec.hardware.key,
                lane_plan.batch_sizes,
                lane_plan.default_batch_size,
                spec.batch_sizes,
            )
        return spec.with_plan(lane_plan)
