"""Redis key and wire names shared by the client and the workers."""

from __future__ import annotations

import json
import re
import typing

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bso.spec import JobSpec
from bso.wire import keys
from bso.wire.events import (
    DeleteJob,
    EndTrial,
    EpochReport,
    Event,
    NextTrial,
    RegisterJob,
)

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


@pytest.mark.parametrize("event_id", ["e\n", "\ud800", "e\x00x", "a b", "é", "x" * 129])
def test_no_key_from_an_invalid_event_id(event_id: str) -> None:
    assert keys.reply_key_for({"event_id": event_id, "job_id": "j"}) is None


@pytest.mark.parametrize(
    "job_id", ["\ud800", "j\r\nSET x", "j\x1b", "has space", "-lead", "x" * 129, "a*"]
)
def test_an_invalid_job_id_is_left_out_of_the_key(job_id: str) -> None:
    # The event still gets its invalid_event reply, on a key no sender shaped.
    assert keys.reply_key_for({"event_id": "e", "job_id": job_id}) == "bso:reply:-:-:e"
    spec = {"job_id": job_id}
    assert keys.reply_key_for({"event_id": "e", "spec": spec}) == "bso:reply:-:-:e"


@pytest.mark.parametrize(
    "trial", [0, -1, 2**31, 2**63, pytest.param(10**4000, id="4000-digits"), 1.5]
)
def test_an_invalid_trial_number_is_left_out_of_the_key(trial: object) -> None:
    key = keys.reply_key_for({"event_id": "e", "job_id": "j", "trial_number": trial})
    assert key == "bso:reply:j:-:e"
    top = keys.reply_key_for({"event_id": "e", "job_id": "j", "trial_number": 2**31 - 1})
    assert top == f"bso:reply:j:{2**31 - 1}:e"


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
    max_leaves=8,
)
_KEY = re.compile(r"bso:reply:[A-Za-z0-9._:-]{1,128}:(-|[0-9]{1,10}):[A-Za-z0-9._:-]{1,128}")


@settings(max_examples=500, deadline=None, derandomize=True)
@given(
    event_id=st.one_of(st.text(), st.from_regex(r"[A-Za-z0-9._:-]{1,130}", fullmatch=True), JSON),
    job_id=st.one_of(st.text(), st.from_regex(r"[A-Za-z0-9._:-]{1,130}", fullmatch=True), JSON),
    trial=JSON,
)
def test_any_json_gives_no_key_or_a_short_ascii_one(
    event_id: object, job_id: object, trial: object
) -> None:
    key = keys.reply_key_for({"event_id": event_id, "job_id": job_id, "trial_number": trial})
    if key is not None:
        assert _KEY.fullmatch(key), key
        key.encode("ascii")


def test_every_event_kind_has_a_task_and_all_names_are_namespaced() -> None:
    union = typing.get_args(typing.get_args(Event)[0])
    kinds = {model.model_fields["kind"].default for model in union}
    assert set(keys.TASK_FOR_KIND) == kinds
    tasks = {*keys.TASK_FOR_KIND.values(), keys.TASK_STATUS, keys.TASK_LIST_JOBS, keys.TASK_SWEEP}
    assert all(name.startswith("bso.") for name in tasks)
    assert len(tasks) == len(keys.TASK_FOR_KIND) + 3
    assert keys.REPLY_PREFIX.startswith(keys.KEY_PREFIX)
    assert keys.BROKER_KEY_PREFIX.startswith(keys.KEY_PREFIX)
