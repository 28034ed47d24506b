"""BatchSizeOptimizer in one process, against the in-process service.

The service is the real :class:`bso.service.BsoService` over a memory store,
wrapped in a recorder that logs each call with its event id, so that the
tests can check what the client sends (and how often) as well as what the
service ends up believing.  The tests of the optimizer's parts
(test_call_order, test_epoch_meter, test_service_calls, test_shutdown) use
the same recorder.
"""

from __future__ import annotations

import logging
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bso.core.vocabulary import StopReason, TrialStatus
from bso.errors import ConfigMismatch, ServiceUnavailable
from bso.service import BsoService
from bso.spec import Hardware, JobSpec
from bso.status import JobStatus
from bso.storage.base import TrialRecord
from bso.storage.memory import MemoryStore
from bso.wire.events import EpochDecision, HeartbeatAck, JobRegistered, ResumeTrial, TrialAssigned
from bso.wire.replies import StubReplyBackend
from bso_client.energy.base import EnergyFallbackWarning
from bso_client.energy.time_only import TimeOnlyMonitor
from bso_client.errors import DistributedSetupError, OperationOrderError, TrainFailError
from bso_client.optimizer import BatchSizeOptimizer
from bso_client.transport import Publisher, ServiceClient
from bso_workers.supervision import free_port

ROOT = Path(__file__).resolve().parents[1]

SPEC = JobSpec(
    job_id="job",
    batch_sizes=[8, 16, 32],
    default_batch_size=16,
    target_metric=0.9,
    max_epochs=5,
    mab_seed=1,
)


class RecordingService:
    """The in-process service, logging ``(method, event_id, kwargs)`` of every call.

    ``fail_after`` makes the n-th call (1-based) reach the service and then
    raise ServiceUnavailable, as a reply lost on the way back would.
    """

    def __init__(self, store: MemoryStore | None = None, fail_after: set[int] | None = None):
        self.store = store or MemoryStore()
        self.service = BsoService(self.store)
        self.calls: list[tuple[str, str, dict[str, Any]]] = []
        self.fail_after = fail_after or set()

    def _record(self, method: str, event_id: str, **kwargs: Any) -> None:
        self.calls.append((method, event_id, kwargs))

    def _maybe_fail(self) -> None:
        if len(self.calls) in self.fail_after:
            raise ServiceUnavailable("bso service at test did not answer (timeout_s=0.1)")

    def register(
        self, spec: JobSpec, *, plan_proposed: bool = False, event_id: str
    ) -> JobRegistered:
        self._record("register", event_id, spec=spec)
        reply = self.service.register(spec, plan_proposed=plan_proposed, event_id=event_id)
        self._maybe_fail()
        return reply

    def next_trial(
        self, job_id: str, hardware: Hardware | None = None, *, event_id: str, **options: Any
    ) -> TrialAssigned:
        self._record("next_trial", event_id, hardware=hardware, **options)
        reply = self.service.next_trial(job_id, hardware, event_id=event_id, **options)
        self._maybe_fail()
        return reply

    def report_epoch(
        self, job_id: str, trial_number: int, *, event_id: str, **report: Any
    ) -> EpochDecision:
        self._record("report_epoch", event_id, trial_number=trial_number, **report)
        reply = self.service.report_epoch(job_id, trial_number, event_id=event_id, **report)
        self._maybe_fail()
        return reply

    def end_trial(
        self,
        job_id: str,
        trial_number: int,
        *,
        event_id: str,
        reason: StopReason,
        batch_size: int | None = None,
    ) -> Any:
        self._record("end_trial", event_id, trial_number=trial_number, reason=reason)
        reply = self.service.end_trial(
            job_id, trial_number, event_id=event_id, reason=reason, batch_size=batch_size
        )
        self._maybe_fail()
        return reply

    def resume_trial(self, event: ResumeTrial) -> TrialAssigned:
        self._record("resume_trial", event.event_id, trial_number=event.trial_number)
        reply = self.service.resume_trial(event)
        self._maybe_fail()
        return reply

    def heartbeat(self, job_id: str, trial_number: int) -> HeartbeatAck:
        self._record("heartbeat", "", trial_number=trial_number)
        return self.service.heartbeat(job_id, trial_number)

    def status(self, job_id: str) -> JobStatus:
        """A read: not recorded in ``calls``."""
        return self.service.status(job_id)

    def methods(self) -> list[str]:
        return [method for method, _, _ in self.calls]

    def trial(self, number: int, job_id: str = "job") -> TrialRecord:
        with self.store.transaction(job_id) as tx:
            trial = tx.get_trial(number)
        assert trial is not None
        return trial


def make(service: RecordingService, spec: JobSpec = SPEC, **options: Any) -> BatchSizeOptimizer:
    options.setdefault("monitor", TimeOnlyMonitor())
    return BatchSizeOptimizer(spec, service=service, environ={}, **options)


def test_importing_the_client_stays_light() -> None:
    code = (
        "import sys, bso_client\n"
        "from bso_client import BatchSizeOptimizer, JobSpec, TrainFailError, ServiceUnavailable\n"
        "import bso_client.distributed, bso_client.integrations\n"
        "heavy = ('torch', 'sqlalchemy', 'bso_workers', 'celery', 'pytorch_lightning',"
        " 'transformers', 'pynvml')\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert out.stdout.strip() == "[]"


def test_the_zeus_call_order_runs_a_trial_to_convergence() -> None:
    service = RecordingService()
    bso = make(service)
    assert bso.job_id == "job"
    assert (bso.trial_number, bso.batch_size) == (None, None)
    assert bso.get_batch_size() == 16  # the default is explored first
    assert bso.get_batch_size() == 16  # asking again is no new trial
    assert bso.trial_number == 1
    bso.on_train_begin()
    assert (bso.on_evaluate(0.5).stop, bso.training_finished) == (False, False)
    decision = bso.on_evaluate(0.95)
    assert (decision.stop, decision.converged, bso.training_finished) == (True, True, True)
    assert bso.epoch == 2
    bso.close()
    bso.close()
    assert service.methods() == ["register", "next_trial", "report_epoch", "report_epoch"]
    assert service.trial(1).status is TrialStatus.CONVERGED
    assert [kw["epoch"] for m, _, kw in service.calls if m == "report_epoch"] == [1, 2]


def test_same_config_registers_again_and_a_different_one_is_config_mismatch() -> None:
    service = RecordingService()
    make(service).close()
    make(service, spec=SPEC.model_copy(update={"hardware": Hardware(gpu_model="x")})).close()
    with pytest.raises(ConfigMismatch, match="eta_knob"):
        make(service, spec=SPEC.model_copy(update={"eta_knob": 0.9}), on_unavailable="raise")


def test_a_mapping_spec_and_a_generated_job_id() -> None:
    service = RecordingService()
    fields = SPEC.model_dump(exclude={"job_id", "hardware"})
    bso = make(service, spec=JobSpec.model_validate({**fields, "job_id_prefix": "nightly"}))
    assert bso.job_id.startswith("nightly-")
    bso.close()
    mapped = BatchSizeOptimizer(
        {**fields, "job_id": "mapped"}, service=service, environ={}, monitor=TimeOnlyMonitor()
    )
    assert mapped.spec.job_id == "mapped"
    mapped.close()


def test_get_batch_size_after_close_without_a_trial_is_an_order_error() -> None:
    bso = make(RecordingService())
    bso.close()
    with pytest.raises(OperationOrderError, match="closed before it got a batch size"):
        bso.get_batch_size()


def test_a_run_stopped_without_convergence_raises_train_fail_error() -> None:
    service = RecordingService()
    bso = make(service, spec=SPEC.model_copy(update={"max_epochs": 2}))
    bso.get_batch_size()
    bso.on_train_begin()
    bso.on_evaluate(0.1)
    with pytest.raises(TrainFailError, match="launch the job again") as caught:
        bso.on_evaluate(0.2)
    err = caught.value
    assert (err.trial_number, err.batch_size, err.reason) == (1, 16, StopReason.MAX_EPOCHS)
    assert bso.training_finished
    bso.close()
    # The service already ended the trial: no EndTrial on top.
    assert "end_trial" not in service.methods()
    assert service.trial(1).stop_reason is StopReason.MAX_EPOCHS


def test_errors_survive_pickling_for_the_other_ranks() -> None:
    err = TrainFailError("job", 3, 64, StopReason.COST_BOUND, "cost 2.1x the best")
    copy = pickle.loads(pickle.dumps(err))
    assert type(copy) is TrainFailError
    assert str(copy) == str(err)
    assert copy.reason is StopReason.COST_BOUND
    mismatch = pickle.loads(pickle.dumps(ConfigMismatch("differs in: eta_knob")))
    assert (type(mismatch), mismatch.message) == (ConfigMismatch, "differs in: eta_knob")


@pytest.mark.parametrize(
    ("error", "status", "reason"),
    [
        (ValueError("bad input"), TrialStatus.FAILED, StopReason.ABANDONED),
        (
            RuntimeError("CUDA out of memory. Tried to allocate"),
            TrialStatus.FAILED,
            StopReason.OUT_OF_MEMORY,
        ),
        (
            type("OutOfMemoryError", (RuntimeError,), {})("x"),
            TrialStatus.FAILED,
            StopReason.OUT_OF_MEMORY,
        ),
        (KeyboardInterrupt(), TrialStatus.INTERRUPTED, StopReason.INTERRUPTED),
    ],
)
def test_an_exception_in_the_with_block_ends_the_trial_once_with_its_reason(
    error: BaseException, status: TrialStatus, reason: StopReason
) -> None:
    service = RecordingService()
    bso = make(service)

    def train() -> None:
        with bso:
            bso.get_batch_size()
            bso.on_train_begin()
            bso.on_evaluate(0.1)
            raise error

    with pytest.raises(type(error)):  # always re-raised
        train()
    bso.close()
    assert service.methods().count("end_trial") == 1
    trial = service.trial(1)
    assert (trial.status, trial.stop_reason) == (status, reason)


def test_a_loop_that_ends_before_convergence_abandons_the_trial() -> None:
    service = RecordingService()
    with make(service) as bso:
        bso.get_batch_size()
        bso.on_train_begin()
        bso.on_evaluate(0.1)
    assert service.trial(1).stop_reason is StopReason.ABANDONED


def test_no_trial_means_nothing_to_end() -> None:
    service = RecordingService()
    with make(service):
        pass
    assert service.methods() == ["register"]


def test_an_unreachable_broker_is_service_unavailable_after_the_outage_window() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    with pytest.raises(ServiceUnavailable, match=r"127\.0\.0\.1.*outage_window_s=0\.3"):
        BatchSizeOptimizer(
            SPEC,
            url,
            monitor=TimeOnlyMonitor(),
            environ={},
            connect_timeout_s=1,
            outage_window_s=0.3,
            on_unavailable="raise",
        )


class Blackhole(Publisher):
    """A broker that accepts events and never delivers them: a service too slow to answer."""

    def publish(
        self, task_name: str, payload_json: str, message_id: str, reply_channel: str | None = None
    ) -> None:
        """Drop the event."""

    def close(self) -> None:
        """Nothing to release."""


def test_a_silent_service_is_service_unavailable_with_the_timeout() -> None:
    client = ServiceClient(Blackhole(), StubReplyBackend(), timeout_s=0.05, retries=1)
    with pytest.raises(ServiceUnavailable, match=r"timeout_s=0\.05"):
        BatchSizeOptimizer(
            SPEC, service=client, monitor=TimeOnlyMonitor(), environ={}, on_unavailable="raise"
        )


def test_exactly_one_of_broker_url_and_service() -> None:
    with pytest.raises(ValueError, match="no broker_url"):
        BatchSizeOptimizer(SPEC, environ={})


def test_world_size_without_a_process_group_is_a_setup_error() -> None:
    with pytest.raises(DistributedSetupError, match="init_process_group"):
        BatchSizeOptimizer(SPEC, service=RecordingService(), environ={"WORLD_SIZE": "2"})


def test_without_gpu_the_default_monitor_warns_and_measures_time(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with (
        caplog.at_level(logging.INFO, "bso_client"),
        pytest.warns(EnergyFallbackWarning, match="measuring time only") as caught,
    ):
        bso = BatchSizeOptimizer(SPEC, service=RecordingService(), environ={})
    # Attributed to the line that built the optimizer, not to bso's own code, and
    # said once: no INFO line repeating it.
    assert [w.filename for w in caught] == [__file__]
    assert "energy monitor" not in caplog.text
    assert bso.monitor is not None
    assert not bso.monitor.measures_energy
    assert bso.hardware.gpu_model == "cpu-time-only"
    bso.close()
    with pytest.raises(RuntimeError, match="closed"):
        bso.monitor.begin_window()  # the optimizer's own monitor is closed with it


class SGD:
    """Looks like torch.optim.SGD to the LR helper (matched by class name)."""

    def __init__(self, lr: float) -> None:
        self.param_groups = [{"lr": lr}]


def test_scale_lr_is_opt_in_and_follows_the_chosen_batch_size() -> None:
    service = RecordingService()
    with make(service) as first:
        first.get_batch_size()
        first.on_train_begin()
        first.on_evaluate(0.95)  # the default size converged: the next run explores another
    bso = make(service)
    optimizer = SGD(0.1)
    factor = bso.scale_lr(optimizer)
    assert bso.batch_size != 16
    assert factor == bso.get_batch_size() / 16
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * factor)
    bso.close()


def test_the_dataloader_sizes_ask_for_the_batch_size_when_read_first() -> None:
    """Read before get_batch_size(), they used to be None, and DataLoader(batch_size=None)
    silently trains one sample at a time."""
    service = RecordingService()
    with make(service) as bso:
        assert bso.per_device_batch_size == bso.batch_size == bso.get_batch_size()
        assert bso.micro_batch_size == bso.per_device_batch_size
        assert bso.accumulation_steps == 1
        assert bso.current_batch_size == bso.batch_size
    assert [name for name, *_ in service.calls].count("next_trial") == 1


def test_no_broker_url_says_where_the_url_comes_from() -> None:
    """``os.environ.get("BSO_BROKER_URL")`` is None when bso up never ran or its
    credentials were not sourced: the error names the URL's source, not the API."""
    with pytest.raises(ValueError, match=r"no broker_url \(None\).*credentials\.env"):
        BatchSizeOptimizer(SPEC, None, environ={}, monitor=TimeOnlyMonitor())
    with pytest.raises(ValueError, match="not both"):
        BatchSizeOptimizer(SPEC, "redis://h/0", service=RecordingService(), environ={})


def test_an_interrupted_trial_says_it_is_not_held_against_its_size(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Ctrl-C in a notebook: the line answers "is this run charged to its batch size?"."""
    service = RecordingService()
    bso = make(service, heartbeat_interval_s=None)
    bso.get_batch_size()
    bso.on_train_begin()
    with caplog.at_level(logging.INFO, logger="bso_client"):
        bso.close(KeyboardInterrupt())
    assert (
        "bso trial 1 of job job ended: interrupted (Ctrl-C, SIGTERM or a cancel): not held "
        "against the batch size, which the next run gets again" in caplog.text
    )


def test_without_broker_url_the_url_comes_from_bso_broker_url_like_the_key() -> None:
    """A script run in a shell that sourced ``credentials.env`` has BSO_BROKER_URL and
    BSO_API_KEY; the key was read from it, the URL was refused as "no broker_url"
    although the file had been sourced."""
    url = "redis://bso-tenant-default:pw@127.0.0.1:1/0"
    bso = BatchSizeOptimizer(
        SPEC,
        environ={"BSO_BROKER_URL": url},
        monitor=TimeOnlyMonitor(),
        heartbeat_interval_s=None,
        unavailable_bound_s=0.5,
    )
    with bso:
        assert bso.get_batch_size() == SPEC.default_batch_size  # nothing listens: detached
    assert bso.detached
    with pytest.raises(ValueError, match="BSO_BROKER_URL is not set"):
        BatchSizeOptimizer(SPEC, environ={"BSO_BROKER_URL": ""}, monitor=TimeOnlyMonitor())
