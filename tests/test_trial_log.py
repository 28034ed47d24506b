"""The client's trial log line carries the running recommendation while bso explores."""

from __future__ import annotations

import logging

import pytest

from bso.apikeys import DEFAULT_TENANT
from bso.service import BsoService
from bso.spec import Hardware, JobSpec
from bso.status import JobStatus, started_from_text
from bso.storage.memory import MemoryStore
from bso_client.energy.time_only import TimeOnlyMonitor
from bso_client.optimizer import BatchSizeOptimizer

SPEC = JobSpec(
    job_id="live",
    batch_sizes=[8, 16, 32],
    default_batch_size=16,
    target_metric=0.9,
    max_epochs=3,
    mab_seed=4,
)


def run_once(service: BsoService, metrics: tuple[float, ...] = (0.95,)) -> None:
    with BatchSizeOptimizer(
        SPEC, service=service, monitor=TimeOnlyMonitor(), heartbeat_interval_s=None
    ) as bso:
        bso.get_batch_size()
        bso.on_train_begin()
        for metric in metrics:
            bso.on_evaluate(metric)


def test_the_first_trial_has_no_recommendation_yet(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="bso_client")
    run_once(BsoService(MemoryStore()))
    (line,) = [r.getMessage() for r in caplog.records if "bso trial 1 " in r.getMessage()]
    assert "so far" not in line


class RecordingStatus(BsoService):
    """The in-process service, keeping every status it answered."""

    def __init__(self) -> None:
        super().__init__(MemoryStore())
        self.answered: list[JobStatus] = []

    def status(self, job_id: str, tenant: str = DEFAULT_TENANT) -> JobStatus:
        self.answered.append(super().status(job_id, tenant))
        return self.answered[-1]


def test_later_trials_say_what_is_cheapest_so_far_and_how_sure(
    caplog: pytest.LogCaptureFixture,
) -> None:
    service = RecordingStatus()
    for _ in range(3):
        run_once(service)
    caplog.clear()
    caplog.set_level(logging.INFO, logger="bso_client")
    seen = len(service.answered)
    run_once(service)
    lane = service.answered[seen].lanes[0]  # what the trial's start was told
    (line,) = [r.getMessage() for r in caplog.records if "bso trial 4 " in r.getMessage()]
    assert lane.recommended_batch_size is not None
    told = f"so far {lane.recommended_batch_size} is cheapest at confidence {lane.confidence}%"
    assert told in line


def test_runs_that_raise_before_their_first_epoch_are_called_a_script_bug(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """After three runs raised before epoch 1, the next run's log says so plainly, once,
    and still gets a size (the same one: the fixed script runs it)."""
    service = BsoService(MemoryStore())
    sizes: list[int] = []

    def buggy_run() -> None:
        with BatchSizeOptimizer(
            SPEC, service=service, monitor=TimeOnlyMonitor(), heartbeat_interval_s=None
        ) as bso:
            sizes.append(bso.get_batch_size())
            raise ValueError("a bug in the training script")

    for _ in range(3):
        with pytest.raises(ValueError, match="a bug"):
            buggy_run()
    caplog.set_level(logging.INFO, logger="bso_client")
    run_once(service, (0.5, 0.95))  # converged at epoch 2: no warning of an easy target
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        f"bso: the last 3 runs of job live on {TimeOnlyMonitor().hardware.key} were ended by "
        f"the training script itself (it raised, or stopped short of the target), at batch "
        f"size {sizes[0]}: a bug in the script, not held against the batch size (see the "
        "run's traceback); bso still hands out sizes"
    ]
    assert len(set(sizes)) == 1


class OnGpu(TimeOnlyMonitor):
    """Time only, on a GPU model of the test's choosing: another hardware lane."""

    def __init__(self, model: str) -> None:
        super().__init__()
        self._hardware = Hardware(gpu_model=model, gpu_count=1, max_power_w=700.0)


def job_lines(service: BsoService, model: str, caplog: pytest.LogCaptureFixture) -> list[str]:
    caplog.clear()
    caplog.set_level(logging.INFO, logger="bso_client")
    spec = SPEC.model_copy(update={"job_id": "tinyl"})
    with BatchSizeOptimizer(
        spec, service=service, monitor=OnGpu(model), heartbeat_interval_s=None
    ) as bso:
        bso.get_batch_size()
        bso.on_train_begin()
        bso.on_evaluate(0.95)
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("bso job ")]


def test_a_new_lane_of_a_registered_job_is_called_new_not_already_registered(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The user's report: the first run on an H100 of a job that ran on an A100 logged
    ``bso job tinyl already registered on NVIDIA H100 80GB HBM3 x1``: the job was, the
    lane was not."""
    a100, h100 = "NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3"
    service = RecordingStatus()
    assert job_lines(service, a100, caplog) == [f"bso job tinyl registered on {a100} x1"]
    for _ in range(2):
        job_lines(service, a100, caplog)
    (line,) = job_lines(service, h100, caplog)
    (lane,) = [la for la in service.status("tinyl").lanes if la.hardware.gpu_model == h100]
    start = lane.started_from  # fixed when the lane began
    assert start is not None
    assert line == (
        f"bso job tinyl: new lane {h100} x1 (the job was registered before); "
        + started_from_text(start, SPEC.default_batch_size)
    )
    assert f"lane {a100} x1's recommendation" in line  # as bso status says it
    assert job_lines(service, h100, caplog) == [
        f"bso job tinyl already registered on {h100} x1 (1 earlier trial(s) on this lane)"
    ]


def test_a_loop_that_ends_short_of_the_target_on_its_own_is_told_whose_run_it_was(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Two epochs below the target and then out of the with block, without an error
    (a loop of fewer epochs than max_epochs): bso counts the run as the script's, and
    the one warning says so; a run bso ended, or one that raised, gets no such line."""
    service = BsoService(MemoryStore())
    caplog.set_level(logging.INFO, logger="bso_client")
    run_once(service, metrics=(0.1, 0.2))
    short = [r.getMessage() for r in caplog.records if "without an error" in r.getMessage()]
    assert short == [
        "bso trial 1 of job live: training ended after 2 epoch(s) without an error, short of "
        "target_metric and of max_epochs (3): bso counts the run as the script's, not the "
        "batch size's, and gives the next run the same size (does the loop run "
        "job.max_epochs epochs, stopping early only when bso.training_finished is True?)"
    ]
    (first,) = service.status("live").lanes[0].history
    assert first.outcome == "script_error"
    caplog.clear()
    run_once(service, metrics=(0.1, 0.95))  # converged: bso ended it

    def buggy_run() -> None:
        with BatchSizeOptimizer(
            SPEC, service=service, monitor=TimeOnlyMonitor(), heartbeat_interval_s=None
        ) as bso:
            bso.get_batch_size()
            raise ValueError("a bug in the training script")

    with pytest.raises(ValueError, match="a bug"):
        buggy_run()
    assert not [r for r in caplog.records if "without an error" in r.getMessage()]
