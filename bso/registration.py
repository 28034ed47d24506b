"""A job id registered again: what must match, and the rules of a lane's batch plan.

The first registration of a job id creates the job (:meth:`bso.service.BsoService.handle`);
every later one comes here, inside the job's transaction.  Everything in the spec
but the ids, the hardware and the batch plan must match
(:meth:`~bso.spec.JobSpec.config_fingerprint`); the plan follows the lane rules of
:func:`register_lane` (``docs/client.md``, "Lanes").
"""

from __future__ import annotations

import dataclasses
import json

from bso.errors import ConfigMismatch
from bso.spec import PLAN_FIELDS, BatchPlan, Hardware, JobSpec, listed
from bso.storage.base import JobRecord, JobTransaction, LaneRecord


def register_again(
    tx: JobTransaction, job: JobRecord, spec: JobSpec, proposed: bool
) -> BatchPlan | None:
    """Check a registration of the existing ``job``; the lane's plan when the caller
    must run that one instead of its proposal (None: run its own)."""
    if job.spec.config_fingerprint() != spec.config_fingerprint():
        raise_config_mismatch(job.spec, spec)
    if spec.hardware == Hardware():
        # A spec that names no hardware (the model's default) is about the job's own
        # lane, the one a next_trial without hardware runs on.  So a changed size list
        # is refused there, as it is for the training client, instead of quietly
        # pinning it to a new "cpu x1" lane that no trial of the caller would use.
        spec = spec.model_copy(update={"hardware": job.spec.hardware})
    return register_lane(tx, job, spec, proposed)


def register_lane(
    tx: JobTransaction, job: JobRecord, spec: JobSpec, proposed: bool
) -> BatchPlan | None:
    """Give ``spec.hardware`` its own batch plan when it registers one the job lacks.

    Another GPU model fits other sizes, so a lane may list its own; the job's
    other settings are shared.  A lane's plan is fixed once it is known: the
    job's first hardware has the job's plan, a lane's first registration pins
    its plan, and a lane that already ran trials under the job's plan keeps
    that one (its trials were measured at those sizes).  A ``proposed`` plan
    (from a probe) that differs gives way to the known one, which is returned.
    A typed plan that differs is refused with the command that changes the
    lane's list (``bso jobs set-sizes``, :mod:`bso.job_admin`).
    """
    key = spec.hardware.key
    lane = tx.get_lane(key)
    if lane is not None and lane.plan is not None:
        known: BatchPlan | None = lane.plan
    elif key == job.spec.hardware.key or tx.trials(key):
        known = job.spec.plan
    else:
        known = None
    if known is None:  # the lane's first registration pins its plan
        base = lane or LaneRecord(spec.hardware)
        tx.save_lane(dataclasses.replace(base, plan=spec.plan))
        return None
    if known == spec.plan:
        return None
    if proposed or known == spec.plan.model_copy(update={"devices": None}):
        # A probe's proposal gives way; so does a client that now fills in its world
        # size as ``devices`` for a lane that ran before clients did (the lane keeps
        # its sizes' old, per-device meaning, which its trials were measured with).
        return known
    raise ConfigMismatch(
        f"job {job.spec.job_id} runs on {key} with batch sizes "
        f"{listed(known.batch_sizes)} (default {known.default_batch_size}, micro-batch "
        f"{known.micro_batch_size}, devices {known.devices}); this registration has "
        f"{listed(spec.batch_sizes)} (default {spec.default_batch_size}, micro-batch "
        f"{spec.micro_batch_size}, devices {spec.devices}). A lane's sizes are fixed "
        "once it has them: to run the lane's sizes, list them in the job; to give the "
        "lane this list instead (trials at sizes kept "
        f"still count): bso jobs set-sizes {job.spec.job_id} --lane '{key}' --batch-sizes "
        f"{','.join(str(b) for b in spec.batch_sizes)} --default "
        f"{spec.default_batch_size}, then relaunch"
    )


def raise_config_mismatch(old: JobSpec, new: JobSpec) -> None:
    """Refuse ``new``, naming each setting that differs with the registered value and
    this registration's.  Only the job's own settings are shown (knobs, target,
    policy: numbers, flags and a policy name, never ids, hardware or keys), to the
    tenant that owns the job (job ids are per tenant), so nothing leaks."""
    skip = {"job_id", "job_id_prefix", "hardware", *PLAN_FIELDS}
    before = old.model_dump(mode="json", exclude=skip)
    after = new.model_dump(mode="json", exclude=skip)
    changed = sorted(k for k in before if json.dumps(before[k]) != json.dumps(after.get(k)))
    differs = ", ".join(
        f"{k} (registered {shown(before[k])}, this registration {shown(after.get(k))})"
        for k in changed
    )
    raise ConfigMismatch(
        f"job {old.job_id} is registered with a different configuration "
        f"(differs in: {differs or 'the settings fingerprint'}); register the same "
        f"configuration, use a new job_id, or start the job over with bso jobs delete "
        f"{old.job_id} (bso jobs reset keeps the configuration: it only forgets the trials)"
    )


def shown(value: object) -> str:
    """A setting as it is written in a ``JobSpec(...)``: ``0.02``, ``None``, ``'zeus'``;
    cut to 40 characters (every such setting is a short scalar)."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
