"""Redis key and wire names shared by the client and the workers."""

from __future__ import annotations

import json
import typing

import pytest

from bso import keys
from bso.events import (
    DeleteJob,
    EndTrial,
    EpochReport,
    Event,
    NextTrial,
    RegisterJob,
)
from bso.spec import JobSpec

SPEC = JobSpec(job_id="job-1", batch_sizes=[8, 16], default_batch_size=16, target_metric=0.9)


def test_reply_key_names_job_trial_and_event() -> None:
    assert keys.reply_key("e1", "job-1", 7) == "bso:reply:job-1:7:e1"
    assert keys.reply_key("e1", "job-1") == "bso:reply:job-1:-:e1"
    assert keys.reply_key("e1") == "bso:reply:-:-:e1"


@pytest.mark.parametrize(
    ("event", "expected"),
    [
        (RegisterJob(event_id="r", spec=SPEC), "bso:reply:job-1:-:r"),
        (
            RegisterJob(
                event_id="p", spec=SPEC.model_copy(update={"job_id": None, "job_id_prefix": "x"})
            ),
            "bso:reply:-:-:p",
        ),
        (NextTrial(event_id="n", job_id="job-1"), "bso:reply:job-1:-:n"),
        (
            EpochReport(
                event_id="e",
                job_id="job-1",
                trial_number=3,
                epoch=1,
                time_s=1,
                energy_j=1,
                metric=0,
            ),
            "bso:reply:job-1:3:e",
        ),
        (EndTrial(event_id="x", job_id="job-1", trial_number=3), "bso:reply:job-1:3:x"),
        (DeleteJob(event_id="d", job_id="job-1"), "bso:reply:job-1:-:d"),
    ],
)
def test_caller_and_worker_derive_the_same_key(event: Event, expected: str) -> None:
    # The caller derives the key from the model, a worker from the raw JSON it received.
    from_model = keys.reply_key_for(event.model_dump(mode="json"))
    from_wire = keys.reply_key_for(json.loads(event.model_dump_json()))
    assert from_model == from_wire == expected


@pytest.mark.parametrize(
    "payload",
    [{}, {"event_id": ""}, {"event_id": 5}, {"event_id": "x" * 129}, {"event_id": None}],
)
def test_no_key_without_a_usable_event_id(payload: dict[str, object]) -> None:
    assert keys.reply_key_for(payload) is None


def test_fields_of_the_wrong_type_are_left_out_of_the_key() -> None:
    # A broken event still gets its error reply on a key the caller can compute.
    payload = {"event_id": "e", "job_id": ["not", "a", "string"], "trial_number": "3"}
    assert keys.reply_key_for(payload) == "bso:reply:-:-:e"
    assert keys.reply_key_for({"event_id": "e", "job_id": "j", "trial_number": True}) == (
        "bso:reply:j:-:e"
    )
    assert keys.reply_key_for({"event_id": "e", "spec": "nope"}) == "bso:reply:-:-:e"


def test_every_event_kind_has_a_task_and_all_names_are_namespaced() -> None:
    union = typing.get_args(typing.get_args(Event)[0])
    kinds = {model.model_fields["kind"].default for model in union}
    assert set(keys.TASK_FOR_KIND) == kinds
    tasks = {*keys.TASK_FOR_KIND.values(), keys.TASK_STATUS, keys.TASK_SWEEP}
    assert all(name.startswith("bso.") for name in tasks)
    assert len(tasks) == len(keys.TASK_FOR_KIND) + 2
    assert keys.REPLY_PREFIX.startswith(keys.KEY_PREFIX)
    assert keys.BROKER_KEY_PREFIX.startswith(keys.KEY_PREFIX)
