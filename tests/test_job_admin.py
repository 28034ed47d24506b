"""``bso jobs`` in the service: reset, a lane's new sizes, the tenant's job list, and the
rule a registration follows for a changed size list (:mod:`bso.job_admin`,
:mod:`bso.registration`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bso.core.vocabulary import StopReason
from bso.errors import ConfigMismatch, InvalidEvent, InvalidSpec, UnknownJob
from bso.service import BsoService
from bso.spec import Hardware, JobSpec
from bso.storage.memory import MemoryStore
from bso.wire.events import ErrorReply, JobReset, NextTrial, RegisterJob, ResetJob, SetLaneSizes

GPU = Hardware(gpu_model="Tesla T4", gpu_count=1, max_power_w=70.0)


def spec(**changes: Any) -> JobSpec:
    fields: dict[str, Any] = {
        "job_id": "job",
        "batch_sizes": [16, 32, 64, 128],
        "default_batch_size": 32,
        "target_metric": 0.9,
        "max_epochs": 4,
        "mab_seed": 5,
        "hardware": GPU,
    }
    return JobSpec.model_validate(fields | changes)


@pytest.fixture
def service() -> BsoService:
    service = BsoService(MemoryStore())
    service.register(spec())
    return service


def train(service: BsoService, epochs: int = 2, *, converge: bool = True) -> int:
    """One run on the job's lane: ``epochs`` epochs, the last reaching the target."""
    trial = service.next_trial("job")
    for epoch in range(1, epochs + 1):
        decision = service.report_epoch(
            "job",
            trial.trial_number,
            epoch=epoch,
            time_s=10.0 * epoch,
            energy_j=100.0 * epoch,
            metric=1.0 if converge and epoch == epochs else 0.0,
        )
        if decision.stop:
            break
    return trial.batch_size


def lane_sizes(service: BsoService) -> dict[int, dict[str, int]]:
    (lane,) = service.status("job").lanes
    return {s.batch_size: s.outcomes for s in lane.sizes}


# -- reset --------------------------------------------------------------------------------


def test_reset_forgets_finished_trials_and_keeps_the_spec_and_a_running_trial(
    service: BsoService,
) -> None:
    first = service.next_trial("job", event_id="first")
    service.end_trial("job", first.trial_number, reason=StopReason.DIVERGED)
    running = service.next_trial("job")
    reset = service.reset_job("job")
    assert (reset.forgotten, reset.running) == (1, 1)
    (lane,) = service.status("job").lanes
    assert (lane.trials, lane.running_trials) == (1, 1)
    # The running run goes on, and counts when it ends.
    service.report_epoch("job", running.trial_number, epoch=1, time_s=1.0, energy_j=1.0, metric=1.0)
    assert lane_sizes(service)[running.batch_size] == {"converged": 1}
    # Numbers go on; an event id answered before the reset keeps its reply.
    assert service.next_trial("job").trial_number == running.trial_number + 1
    assert service.next_trial("job", event_id="first") == first
    # The spec stays: registering it again is no new job.
    assert not service.register(spec()).created


def test_a_reset_is_idempotent_per_event_id(service: BsoService) -> None:
    service.end_trial("job", service.next_trial("job").trial_number)
    first = service.handle(ResetJob(job_id="job", event_id="r1"))
    service.end_trial("job", service.next_trial("job").trial_number)
    assert service.handle(ResetJob(job_id="job", event_id="r1")) == first
    assert isinstance(first, JobReset)
    assert first.forgotten == 1
    assert service.status("job").lanes[0].trials == 1  # the retry forgot nothing more


def test_a_new_exploration_budget_after_a_reset_is_refused_naming_both_values_and_delete(
    service: BsoService,
) -> None:
    """A reset keeps the configuration (it only forgets trials): a new budget is a new
    job, and the refusal says so, with the registered and the new value."""
    service.end_trial("job", service.next_trial("job").trial_number)
    service.reset_job("job")
    with pytest.raises(ConfigMismatch) as refused:
        service.register(spec(exploration_budget=0.05, eta_knob=0.25))
    message = refused.value.message
    assert "exploration_budget (registered None, this registration 0.05)" in message
    assert "eta_knob (registered 0.5, this registration 0.25)" in message
    assert "bso jobs delete job" in message
    assert "bso jobs reset keeps the configuration" in message
    assert "Tesla T4" not in message  # the job's own knobs only
    assert "batch_sizes" not in message
    # Deleting starts the job over: the new budget is taken.
    service.delete_job("job")
    assert service.register(spec(exploration_budget=0.02)).created
    assert service.status("job").spec.exploration_budget == 0.02
    # docs/client.md ("Exploration budget") tells the user this, quoting the message.
    with pytest.raises(ConfigMismatch) as refused:
        service.register(spec(exploration_budget=0.05))
    quoted = "exploration_budget (registered 0.02, this registration 0.05)"
    assert quoted in refused.value.message
    docs = " ".join(
        (Path(__file__).resolve().parents[1] / "docs" / "client.md").read_text().split()
    )
    assert f"`{quoted}`" in docs
    assert "`bso jobs reset JOB` does not change it" in docs


def test_reset_of_a_job_that_is_not_there(service: BsoService) -> None:
    with pytest.raises(UnknownJob):
        service.reset_job("nope")


# -- another tenant --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "event",
    [
        ResetJob(job_id="job"),
        SetLaneSizes(job_id="job", lane=GPU.key, batch_sizes=[16]),
        NextTrial(job_id="job"),
    ],
    ids=["reset", "set-sizes", "next-trial"],
)
def test_another_tenant_finds_no_job_to_touch(service: BsoService, event: Any) -> None:
    train(service)
    reply = service.handle(event, "team-b")
    assert isinstance(reply, ErrorReply)
    assert (reply.code, reply.message) == (UnknownJob.code, "job 'job' is not registered")
    assert service.status("job").lanes[0].trials == 1


def test_each_tenant_lists_only_its_own_jobs(service: BsoService) -> None:
    train(service)
    service.handle(RegisterJob(spec=spec(job_id="theirs")), "team-b")
    assert [j.job_id for j in service.list_jobs()] == ["job"]
    (mine,) = service.list_jobs()
    assert (mine.trials, mine.running_trials, mine.lanes) == (1, 0, [GPU.key])
    assert [j.job_id for j in service.list_jobs("team-b")] == ["theirs"]
    assert service.list_jobs("team-c") == []


# -- a lane's new sizes ----------------------------------------------------------------------


def test_new_sizes_keep_the_trials_at_sizes_still_listed(service: BsoService) -> None:
    handed_out = [train(service) for _ in range(3)]
    with service.store.read("job") as tx:
        rng_before = tx.get_lane(GPU.key).rng_state  # type: ignore[union-attr]
    kept_size = handed_out[0]
    new = sorted({kept_size, 256, 512} - {s for s in handed_out if s != kept_size})
    done = service.set_lane_sizes("job", GPU.key, new, default_batch_size=kept_size)
    assert done.plan.batch_sizes == new
    assert done.kept_trials == sum(s == kept_size for s in handed_out)
    assert done.kept_trials + done.set_aside_trials == 3
    with service.store.read("job") as tx:
        assert tx.get_lane(GPU.key).rng_state == rng_before  # type: ignore[union-attr]
    for _ in range(6):
        assert train(service) in new
    (lane,) = service.status("job").lanes
    assert lane.batch_sizes == new
    # The job's script now lists the new sizes: registering them is accepted.
    assert service.register(spec(batch_sizes=new, default_batch_size=kept_size)).plan is None
    with pytest.raises(ConfigMismatch, match="list them in the job"):
        service.register(spec())  # the old list


def test_new_sizes_keep_the_default_or_take_the_nearest(service: BsoService) -> None:
    assert service.set_lane_sizes("job", GPU.key, [8, 32, 512]).plan.default_batch_size == 32
    assert service.set_lane_sizes("job", GPU.key, [8, 48, 512]).plan.default_batch_size == 48


def test_new_sizes_that_do_not_fit_the_lane_are_refused(service: BsoService) -> None:
    with pytest.raises(InvalidSpec, match="not in batch_sizes") as refused:
        service.set_lane_sizes("job", GPU.key, [16, 32], default_batch_size=64)
    assert refused.value.message.endswith(
        "do not fit the lane: default_batch_size 64 is not in batch_sizes [16, 32]"
    )  # what the operator reads, without pydantic's "Value error, " in the middle
    with pytest.raises(InvalidEvent, match=r"no lane 'TPU x1'.*'Tesla T4 x1'"):
        service.set_lane_sizes("job", "TPU x1", [16, 32])
    assert service.status("job").spec.batch_sizes == [16, 32, 64, 128]


def test_following_config_mismatch_advice_works(service: BsoService) -> None:
    """The user edits the script's list and relaunches: the refusal names the command,
    and after it the relaunch registers."""
    train(service)
    changed = spec(batch_sizes=[32, 64, 256], default_batch_size=64)
    with pytest.raises(ConfigMismatch) as refused:
        service.register(changed)
    command = f"bso jobs set-sizes job --lane '{GPU.key}' --batch-sizes 32,64,256 --default 64"
    assert command in refused.value.message
    service.set_lane_sizes("job", GPU.key, [32, 64, 256], default_batch_size=64)
    assert service.register(changed).plan is None
    assert train(service) in (32, 64, 256)


# -- a registration that names no hardware ------------------------------------------------


def test_a_registration_without_hardware_follows_the_jobs_lane_rule(
    service: BsoService,
) -> None:
    """The raw ServiceClient.register of a spec without hardware used to pin the new
    list to a fresh 'cpu x1' lane (created=False, no error) that no next_trial of the
    caller used; it is checked against the job's lane, as the training client is."""
    bare = spec(hardware=Hardware())
    assert service.register(bare).plan is None  # the same list: accepted
    with pytest.raises(ConfigMismatch, match="bso jobs set-sizes job --lane 'Tesla T4 x1'"):
        service.register(spec(hardware=Hardware(), batch_sizes=[16, 32, 256]))
    # A real other hardware still adds a lane with its own sizes.
    other = Hardware(gpu_model="NVIDIA A100", gpu_count=1, max_power_w=400.0)
    assert service.register(spec(hardware=other, batch_sizes=[64, 256], default_batch_size=64))
    assert service.next_trial("job", other).batch_size in (64, 256)
    assert service.status("job").lanes[0].trials == 1
