"""Events and replies: versioned JSON on the wire, strict validation."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from bso.core.vocabulary import StopReason, TrialPhase, TrialStatus
from bso.spec import Hardware, JobSpec
from bso.wire.events import (
    EVENT_ADAPTER,
    REPLY_ADAPTER,
    SCHEMA_VERSION,
    DeleteJob,
    DetachedEpoch,
    EndTrial,
    EpochDecision,
    EpochReport,
    ErrorReply,
    JobDeleted,
    JobRegistered,
    NextTrial,
    RegisterJob,
    ResumeTrial,
    TrialAssigned,
    TrialEnded,
    TrialStanding,
    new_event_id,
)

SPEC = JobSpec(
    job_id="bert-finetune",
    batch_sizes=[8, 16, 32],
    default_batch_size=16,
    target_metric=84.0,
    beta_knob=None,
    hardware=Hardware(gpu_model="Tesla V100", gpu_count=2, max_power_w=250.0),
)
A40 = Hardware(gpu_model="NVIDIA A40", gpu_count=1, max_power_w=300.0)

EVENTS: list[BaseModel] = [
    RegisterJob(spec=SPEC),
    RegisterJob(spec=SPEC.model_copy(update={"job_id": None, "job_id_prefix": "bert"})),
    NextTrial(job_id="bert-finetune"),
    NextTrial(job_id="bert-finetune", hardware=A40),
    EpochReport(
        job_id="bert-finetune", trial_number=3, epoch=2, time_s=12.5, energy_j=3000.0, metric=0.7
    ),
    EndTrial(job_id="bert-finetune", trial_number=3),
    DeleteJob(job_id="bert-finetune"),
]

REPLIES: list[BaseModel] = [
    JobRegistered(event_id="e1", job_id="j", created=True),
    TrialAssigned(
        event_id="e2", job_id="j", trial_number=1, batch_size=32, phase=TrialPhase.CONCURRENT
    ),
    EpochDecision(
        event_id="e3",
        job_id="j",
        trial_number=1,
        epoch=4,
        stop=True,
        converged=False,
        reason=StopReason.COST_BOUND,
        cost=1234.5,
        message="too expensive",
    ),
    EpochDecision(
        event_id="e3b",
        job_id="j",
        trial_number=1,
        epoch=1,
        stop=False,
        converged=False,
        reason=None,
        cost=0.0,
    ),
    TrialEnded(
        event_id="e4",
        job_id="j",
        trial_number=1,
        status=TrialStatus.FAILED,
        reason=StopReason.HEARTBEAT_TIMEOUT,
    ),
    JobDeleted(event_id="e5", job_id="j", existed=False),
    ErrorReply(event_id="e6", code="unknown_job", message="job 'j' is not registered"),
]


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: type(e).__name__)
def test_event_json_round_trip(event: BaseModel) -> None:
    wire = event.model_dump_json()
    back = EVENT_ADAPTER.validate_json(wire)
    assert type(back) is type(event)
    assert back == event
    assert back.model_dump_json() == wire
    # The wire form is plain JSON carrying its version and kind.
    data = json.loads(wire)
    assert data["version"] == SCHEMA_VERSION == 1
    assert data["kind"] == type(event).model_fields["kind"].default


@pytest.mark.parametrize("reply", REPLIES, ids=lambda r: type(r).__name__)
def test_reply_json_round_trip(reply: BaseModel) -> None:
    wire = reply.model_dump_json()
    back = REPLY_ADAPTER.validate_json(wire)
    assert type(back) is type(reply)
    assert back == reply
    assert json.loads(wire)["version"] == 1


def test_kinds_are_distinct() -> None:
    event_kinds = {type(e).model_fields["kind"].default for e in EVENTS}
    reply_kinds = {type(r).model_fields["kind"].default for r in REPLIES}
    assert event_kinds == {"register", "next_trial", "epoch", "end", "delete"}
    assert reply_kinds == {
        "registered",
        "trial",
        "epoch_decision",
        "trial_ended",
        "deleted",
        "error",
    }


def test_event_ids_are_generated_unique_and_kept() -> None:
    ids = {NextTrial(job_id="j").event_id for _ in range(100)}
    assert len(ids) == 100
    assert all(isinstance(i, str) and 1 <= len(i) <= 128 for i in ids)
    assert NextTrial(job_id="j", event_id="retry-7").event_id == "retry-7"
    assert new_event_id() != new_event_id()


@pytest.mark.parametrize("event_id", ["", "has space", "slash/id", "x" * 129, "é"])
def test_bad_event_ids_are_rejected(event_id: str) -> None:
    with pytest.raises(ValidationError, match="event_id"):
        NextTrial(job_id="j", event_id=event_id)


def test_other_schema_versions_are_rejected() -> None:
    data = json.loads(NextTrial(job_id="j").model_dump_json())
    data["version"] = 2
    with pytest.raises(ValidationError, match="version"):
        EVENT_ADAPTER.validate_python(data)
    reply = json.loads(JobDeleted(event_id="e", job_id="j", existed=True).model_dump_json())
    reply["version"] = 0
    with pytest.raises(ValidationError, match="version"):
        REPLY_ADAPTER.validate_python(reply)


def epoch(**changes: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "kind": "epoch",
        "event_id": "ev-1",
        "job_id": "j",
        "trial_number": 1,
        "epoch": 1,
        "time_s": 10.0,
        "energy_j": 100.0,
        "metric": 0.5,
    }
    data.update(changes)
    return data


def test_a_valid_epoch_payload() -> None:
    report = EVENT_ADAPTER.validate_python(epoch())
    assert isinstance(report, EpochReport)
    assert report.version == 1


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("time_s", -1.0),
        ("energy_j", -0.5),
        ("metric", math.nan),
        ("metric", math.inf),
        ("time_s", math.inf),
        ("energy_j", math.nan),
        ("epoch", 0),
        ("epoch", -3),
        ("trial_number", 0),
        ("job_id", ""),
        ("metric", "high"),
    ],
)
def test_invalid_epoch_payloads(field: str, value: object) -> None:
    with pytest.raises(ValidationError) as info:
        EVENT_ADAPTER.validate_python(epoch(**{field: value}))
    assert field in str(info.value)


def test_nan_in_json_is_rejected() -> None:
    wire = json.dumps(epoch(metric=math.nan))  # json.dumps writes a bare NaN
    assert "NaN" in wire
    with pytest.raises(ValidationError):
        EVENT_ADAPTER.validate_json(wire)


def test_unknown_kind_and_extra_fields_are_rejected() -> None:
    with pytest.raises(ValidationError):
        EVENT_ADAPTER.validate_python({"kind": "pause", "job_id": "j"})
    with pytest.raises(ValidationError, match="priority"):
        EVENT_ADAPTER.validate_python(
            {"kind": "next_trial", "event_id": "e", "job_id": "j", "priority": 1}
        )
    with pytest.raises(ValidationError):
        EVENT_ADAPTER.validate_python({"job_id": "j"})  # no kind at all


def test_a_received_event_must_carry_its_event_id() -> None:
    # A model built in-process gets a fresh id; one received without an id could be
    # neither deduplicated nor answered, so the wire adapter refuses it.
    wire = json.loads(NextTrial(job_id="j").model_dump_json())
    assert EVENT_ADAPTER.validate_python(wire).event_id == wire["event_id"]
    del wire["event_id"]
    with pytest.raises(ValidationError, match="event_id is missing"):
        EVENT_ADAPTER.validate_python(wire)
    with pytest.raises(ValidationError, match="event_id is missing"):
        EVENT_ADAPTER.validate_json(json.dumps(wire))


def test_register_validates_the_spec_inside() -> None:
    data = json.loads(RegisterJob(spec=SPEC).model_dump_json())
    data["spec"]["default_batch_size"] = 64
    with pytest.raises(ValidationError, match="default_batch_size 64 is not in batch_sizes"):
        EVENT_ADAPTER.validate_python(data)


def test_events_are_immutable() -> None:
    event = NextTrial(job_id="j")
    with pytest.raises(ValidationError):
        event.job_id = "k"  # type: ignore[misc]


def test_enum_values_on_the_wire() -> None:
    assert TrialStatus.RUNNING.value == "running"
    assert TrialPhase.EXPLOITATION.value == "exploitation"
    assert StopReason.ABANDONED.value == "abandoned"
    wire = json.loads(REPLIES[1].model_dump_json())
    assert wire["phase"] == "concurrent"


# -- bounds: finite, physical, storable; ids as the spec's ------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("time_s", 1e308),
        ("time_s", 1e9 * 1.01),
        ("energy_j", 1e308),
        ("energy_j", 1e16),
        ("metric", 1e16),
        ("metric", -1e16),
        ("trial_number", 2**31),
        ("trial_number", 2**63),
        ("trial_number", 2**64 + 1),
        ("epoch", 2**31),
        pytest.param("epoch", 10**400, id="epoch-400-digits"),
        ("job_id", "job\n"),
        ("job_id", "a\x00b"),
        ("job_id", "\ud800"),
        ("job_id", "has space"),
        ("job_id", "-leading"),
        ("job_id", "x" * 129),
    ],
)
def test_epoch_fields_beyond_their_bounds_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ValidationError) as info:
        EVENT_ADAPTER.validate_python(epoch(**{field: value}))
    assert field in str(info.value)


def test_epoch_bounds_are_inclusive() -> None:
    report = EVENT_ADAPTER.validate_python(
        epoch(time_s=1e9, energy_j=1e15, metric=-1e15, trial_number=2**31 - 1, epoch=2**31 - 1)
    )
    assert isinstance(report, EpochReport)
    assert report.trial_number == 2**31 - 1


def test_json_infinity_in_a_report_is_refused() -> None:
    wire = json.dumps(epoch()).replace('"time_s": 10.0', '"time_s": 1e999')
    assert "1e999" in wire
    with pytest.raises(ValidationError, match="time_s"):
        EVENT_ADAPTER.validate_json(wire)
    with pytest.raises(ValidationError, match="time_s"):
        EVENT_ADAPTER.validate_python(json.loads(wire))


@pytest.mark.parametrize("kind", ["next_trial", "delete", "end"])
@pytest.mark.parametrize("job_id", ["j\n", "\x1b[2J", "\u2028", "a/b"])
def test_every_event_names_its_job_by_the_spec_rule(kind: str, job_id: str) -> None:
    payload = {"kind": kind, "event_id": "e", "job_id": job_id, "trial_number": 1}
    if kind != "end":
        del payload["trial_number"]
    with pytest.raises(ValidationError, match="job_id"):
        EVENT_ADAPTER.validate_python(payload)


@pytest.mark.parametrize("event_id", ["e\n", "\ud800", "e\x00"])
def test_event_ids_with_control_characters_or_surrogates_are_refused(event_id: str) -> None:
    with pytest.raises(ValidationError, match="event_id"):
        EVENT_ADAPTER.validate_python({"kind": "delete", "job_id": "j", "event_id": event_id})


def test_next_trial_hardware_is_bounded_too() -> None:
    with pytest.raises(ValidationError, match="gpu_model"):
        NextTrial.model_validate({"job_id": "j", "hardware": {"gpu_model": "A100\r"}})
    with pytest.raises(ValidationError, match="gpu_count"):
        NextTrial.model_validate({"job_id": "j", "hardware": {"gpu_count": 2**70}})


def test_fields_added_for_going_back_after_an_outage_are_left_out_when_absent() -> None:
    """``EpochReport.trained_to`` and ``ResumeTrial.standing`` came after version 1: an
    event that does not use them is the JSON an earlier worker reads (it refuses keys
    it does not know) and keeps its body hash across the upgrade; one that does
    round-trips them."""
    report = EpochReport(job_id="j", trial_number=1, epoch=1, time_s=1.0, energy_j=2.0, metric=0.1)
    resume = ResumeTrial(job_id="j", trial_number=1, hardware_key=A40.key, batch_size=8, epochs=1)
    assert "trained_to" not in json.loads(report.model_dump_json())
    assert "standing" not in json.loads(resume.model_dump_json())
    trained = DetachedEpoch(epoch=3, time_s=3.0, energy_j=6.0, metric=0.3)
    with_trained = report.model_copy(update={"trained_to": trained})
    stood = resume.model_copy(update={"standing": (TrialStanding(epochs=1, time_s=1.0),)})
    for event in (with_trained, stood):
        assert EVENT_ADAPTER.validate_json(event.model_dump_json()) == event
