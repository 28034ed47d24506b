"""bso.micro_batch_wire, and the micro-batch timings' way through the service: a run's
exploration is kept once with its trial, the next run of the lane and global batch
gets every earlier run's timings, and ``bso status`` shows the choice."""

from __future__ import annotations

import json
import math

import pytest
from pydantic import ValidationError

from bso.commands.status import describe
from bso.core.micro_batch import KEPT_RUNS, STOP_CONFIDENCE, Timings, learned_choice
from bso.core.vocabulary import TrialPhase
from bso.errors import InvalidEvent
from bso.micro_batch_wire import timings_from_wire, timings_to_wire
from bso.service import BsoService
from bso.spec import Hardware, JobSpec
from bso.storage.memory import MemoryStore
from bso.wire.events import EVENT_ADAPTER, EpochReport, TrialAssigned
from bso.wire.micro_batch_timings import (
    MAX_LOG_COST,
    MAX_SQUARES,
    MAX_TIMED_STEPS,
    MicroBatchTiming,
)

GPU = Hardware(gpu_model="Tesla V100", gpu_count=1, max_power_w=300.0)


def spec(**changes: object) -> JobSpec:
    fields: dict[str, object] = {
        "job_id": "mb",
        "batch_sizes": [32, 64, 128],
        "default_batch_size": 64,
        "target_metric": 0.9,
        "max_epochs": 5,
        "mab_seed": 3,
        "hardware": GPU,
    }
    fields.update(changes)
    return JobSpec.model_validate(fields)


def timings(fast: int, per_device: int, steps: int = 6) -> dict[int, Timings]:
    """A run's exploration in which ``fast`` is 20% faster per sample than the others."""
    return {
        m: Timings(steps, math.log(1.0 if m == fast else 1.2), 0.0004 * steps)
        for m in (per_device, per_device // 2, per_device // 4)
    }


def first_epoch(service: BsoService, trial: int, explored: dict[int, Timings] | None) -> None:
    service.report_epoch(
        "mb",
        trial,
        epoch=1,
        time_s=10.0,
        energy_j=1000.0,
        metric=0.5,
        micro_batches=timings_to_wire(explored or {}),
    )


def converge(service: BsoService, trial: int) -> None:
    decision = service.report_epoch("mb", trial, epoch=2, time_s=20.0, energy_j=2000.0, metric=0.95)
    assert decision.converged


def test_the_translation_keeps_every_figure() -> None:
    known = {8: Timings(5, -2.5, 0.01), 16: Timings(3, -2.7, 0.0)}
    wire = timings_to_wire(known)
    assert wire is not None
    assert [t.micro_batch_size for t in wire] == [8, 16]
    assert timings_from_wire(wire) == known
    assert timings_to_wire({}) is None
    assert timings_from_wire(None) == {}


def test_the_wire_refuses_repeated_sizes_and_figures_out_of_bounds() -> None:
    good = {"micro_batch_size": 8, "steps": 3, "mean_log_cost": -2.0, "squares": 0.01}
    base = {"kind": "epoch", "event_id": "e1", "job_id": "mb", "trial_number": 1, "epoch": 1,
            "time_s": 1.0, "energy_j": 1.0, "metric": 0.5}  # fmt: skip
    assert EVENT_ADAPTER.validate_python({**base, "micro_batches": [good]})
    for bad in (
        [good, good],  # one size twice
        [{**good, "steps": 0}],
        [{**good, "mean_log_cost": float("nan")}],
        [{**good, "squares": -1.0}],
        [{**good, "micro_batch_size": 0}],
        [],
    ):
        with pytest.raises(ValidationError):
            EVENT_ADAPTER.validate_python({**base, "micro_batches": bad})


def test_a_runs_exploration_is_kept_once_and_reaches_the_next_run_at_that_size() -> None:
    service = BsoService(MemoryStore())
    service.register(spec())
    first = service.next_trial("mb", GPU)
    assert first.micro_batches is None  # nothing learned yet
    per_device = first.batch_size
    explored = timings(per_device // 2, per_device)
    first_epoch(service, first.trial_number, explored)
    # A later report carrying other timings does not count the run twice.
    decision = service.report_epoch(
        "mb", first.trial_number, epoch=2, time_s=20.0, energy_j=2000.0, metric=0.5,
        micro_batches=timings_to_wire(timings(per_device, per_device)),
    )  # fmt: skip
    assert decision.epoch == 2
    second = service.next_trial("mb", GPU)
    if second.batch_size == per_device:
        assert timings_from_wire(second.micro_batches) == explored
    else:
        assert second.micro_batches is None  # another global batch learned nothing


def test_runs_at_the_same_size_add_up() -> None:
    service = BsoService(MemoryStore())
    service.register(spec(batch_sizes=[64], default_batch_size=64))
    for _ in range(3):
        trial = service.next_trial("mb", GPU)
        known = timings_from_wire(trial.micro_batches)
        assert sum(t.steps for t in known.values()) == 18 * (trial.trial_number - 1)
        first_epoch(service, trial.trial_number, timings(32, 64))
        converge(service, trial.trial_number)


def test_a_micro_batch_that_does_not_divide_the_batch_per_device_is_refused() -> None:
    service = BsoService(MemoryStore())
    service.register(spec(batch_sizes=[64], default_batch_size=64, devices=2))
    trial = service.next_trial("mb", GPU.model_copy(update={"gpu_count": 2}))
    with pytest.raises(InvalidEvent, match=r"runs 32 samples per device.*\[64\]"):
        first_epoch(service, trial.trial_number, {64: Timings(3, 0.0, 0.0)})


def test_status_shows_the_choice_per_global_batch() -> None:
    service = BsoService(MemoryStore())
    service.register(spec(batch_sizes=[64], default_batch_size=64))
    for _ in range(2):
        trial = service.next_trial("mb", GPU)
        first_epoch(service, trial.trial_number, timings(32, 64, steps=10))
        converge(service, trial.trial_number)
    status = service.status("mb")
    (lane,) = status.lanes
    (choice,) = lane.micro_batches
    expected = learned_choice(timings(32, 64, steps=20))
    assert expected is not None
    assert (choice.batch_size, choice.micro_batch_size, choice.runs) == (64, 32, 2)
    assert choice.confidence == expected.score >= STOP_CONFIDENCE * 100
    assert choice.timed_steps == 60
    assert (
        "micro-batch at batch size 64: 32 per pass (confidence "
        f"{choice.confidence}, 60 steps timed over 2 run(s)); later runs skip the exploration"
    ) in describe(status)


def test_a_report_without_timings_leaves_the_lane_without_a_choice() -> None:
    service = BsoService(MemoryStore())
    service.register(spec())
    trial = service.next_trial("mb", GPU)
    first_epoch(service, trial.trial_number, None)
    assert service.status("mb").lanes[0].micro_batches == []
    assert "micro-batch" not in describe(service.status("mb"))


def test_the_report_model_names_its_field() -> None:
    report = EpochReport(
        job_id="mb", trial_number=1, epoch=1, time_s=1.0, energy_j=0.0, metric=0.1,
        micro_batches=[MicroBatchTiming(micro_batch_size=4, steps=2, mean_log_cost=0.1)],
    )  # fmt: skip
    assert report.model_dump()["micro_batches"][0]["squares"] == 0.0


def test_a_hostile_report_cannot_overflow_or_outgrow_the_sums() -> None:
    base = {"kind": "epoch", "event_id": "e1", "job_id": "mb", "trial_number": 1, "epoch": 1,
            "time_s": 1.0, "energy_j": 1.0, "metric": 0.5}  # fmt: skip
    for bad in (
        {"micro_batch_size": 8, "steps": 3, "mean_log_cost": 1000.0},  # e^1000 overflows
        {"micro_batch_size": 8, "steps": MAX_TIMED_STEPS + 1, "mean_log_cost": 0.0},
        {"micro_batch_size": 8, "steps": 1, "mean_log_cost": 0.0, "squares": 0.5},
        {"micro_batch_size": 8, "steps": 2, "mean_log_cost": 0.0, "squares": MAX_SQUARES},
    ):
        with pytest.raises(ValidationError):
            EVENT_ADAPTER.validate_python({**base, "micro_batches": [bad]})
    # The most any run may report, over more runs than a lane keeps: the sums the
    # service hands out stay valid, and so does the status.
    service = BsoService(MemoryStore())
    service.register(spec(batch_sizes=[64], default_batch_size=64))
    extreme = {
        64: Timings(MAX_TIMED_STEPS, MAX_LOG_COST, (MAX_TIMED_STEPS - 1) * (2 * MAX_LOG_COST) ** 2),
        32: Timings(MAX_TIMED_STEPS, -MAX_LOG_COST, 0.0),
    }
    for _ in range(KEPT_RUNS + 3):
        trial = service.next_trial("mb", GPU)
        first_epoch(service, trial.trial_number, extreme)
        converge(service, trial.trial_number)
    trial = service.next_trial("mb", GPU)
    summed = timings_from_wire(trial.micro_batches)
    assert summed[64].steps == KEPT_RUNS * MAX_TIMED_STEPS
    (choice,) = service.status("mb").lanes[0].micro_batches
    assert (choice.micro_batch_size, choice.runs) == (32, KEPT_RUNS)


def test_without_timings_the_json_is_what_an_earlier_bso_sent_and_read() -> None:
    """An earlier client refuses keys it does not know (extra="forbid"), and an event
    stored before the upgrade must keep its body hash when it is retried after it."""
    report = EpochReport(job_id="mb", trial_number=1, epoch=1, time_s=1.0, energy_j=0.0, metric=0.1)
    trial = TrialAssigned(
        event_id="e1", job_id="mb", trial_number=1, batch_size=64, phase=TrialPhase.EXPLORATION
    )
    for model in (report, trial):
        sent = json.loads(model.model_dump_json())
        assert "micro_batches" not in sent
        assert set(sent) <= set(type(model).model_fields) - {"micro_batches"}
    with_timings = report.model_copy(
        update={"micro_batches": [MicroBatchTiming(micro_batch_size=8, steps=2, mean_log_cost=0.0)]}
    )
    assert json.loads(with_timings.model_dump_json())["micro_batches"][0]["steps"] == 2
