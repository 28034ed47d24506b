"""Fail-open (bso_client.fail_open): no failure of the service ends a run or stalls it.

In process: the real service behind a switch that makes every call fail as an
unreachable service does, counting the calls that reach it.  Against a real
Redis: a wrong port at start; a Redis stopped mid-run and started again, with
the workers' own task code applying every event (tests/test_broker_outage.py's
worker loop); and real Celery workers refusing a wrong key, then taking the
journal with the right one.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from bso.apikeys import DEFAULT_TENANT
from bso.commands.status import describe
from bso.core.vocabulary import StopReason, TrialPhase, TrialStatus
from bso.errors import (
    ConfigMismatch,
    InvalidSpec,
    NoFeasibleBatchSize,
    RateLimited,
    ServiceUnavailable,
    Unauthorized,
)
from bso.service import BsoService
from bso.spec import JobSpec
from bso.storage.base import TrialRecord
from bso.storage.memory import MemoryStore
from bso.wire import keys
from bso.wire.replies import RedisReplyBackend, StubReplyBackend
from bso_client.detached_journal import job_folder, local_owner, pending_journals
from bso_client.discovery import cache_dir
from bso_client.energy.time_only import TimeOnlyMonitor
from bso_client.errors import TrainFailError
from bso_client.fail_open import (
    DEFAULT_UNAVAILABLE_BOUND_S,
    UNAVAILABLE_BOUND_ENV,
    detached_message,
    unavailable_bound,
)
from bso_client.optimizer import BatchSizeOptimizer
from bso_client.transport import ServiceClient
from bso_workers.settings import WorkerSettings
from bso_workers.supervision import free_port
from bso_workers.tasks import WorkerRuntime, process_event, process_status
from bso_workers.tenant_keys import create_key
from tests.fixtures.celery_workers import WorkerCluster
from tests.test_broker_outage import QUEUE, RestartableRedis
from tests.test_optimizer import Blackhole

SPEC = JobSpec(
    job_id="job",
    batch_sizes=[8, 16, 32],
    default_batch_size=16,
    target_metric=0.9,
    max_epochs=5,
    mab_seed=1,
)

WARNING_LOGGER = "bso_client.optimizer"


class Switch:
    """The in-process service, reachable or not; counts the calls that try it."""

    def __init__(self, store: MemoryStore | None = None) -> None:
        self.store = store or MemoryStore()
        self.service = BsoService(self.store)
        self.up = True
        self.failure: Exception = ServiceUnavailable("bso service at test: no reply (test)")
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self.service, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(name)
            if not self.up:
                raise self.failure
            return method(*args, **kwargs)

        return call

    def trials(self, job_id: str = "job") -> list[TrialRecord]:
        with self.store.read(job_id) as tx:
            return tx.trials()


def make(switch: Switch, spec: JobSpec = SPEC, **options: Any) -> BatchSizeOptimizer:
    options.setdefault("monitor", TimeOnlyMonitor())
    options.setdefault("heartbeat_interval_s", None)
    return BatchSizeOptimizer(spec, service=switch, environ={}, **options)


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno >= logging.WARNING]


def train(bso: BatchSizeOptimizer, metrics: list[float], on_epoch: Callable[[int], None]) -> int:
    """The Zeus loop; returns the epochs trained."""
    bso.get_batch_size()
    bso.on_train_begin()
    trained = 0
    for epoch, metric in enumerate(metrics, start=1):
        on_epoch(epoch)
        trained += 1
        bso.on_evaluate(metric)
        if bso.training_finished:
            break
    return trained


# -- mid-run ------------------------------------------------------------------------------


def test_a_service_lost_mid_run_never_stops_the_run_and_is_delivered_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    switch = Switch()
    calls_when_lost: list[int] = []

    def lose_at_epoch_2(epoch: int) -> None:
        if epoch == 2:
            switch.up = False
            calls_when_lost.append(len(switch.calls))

    with caplog.at_level(logging.INFO, WARNING_LOGGER), make(switch) as bso:
        trained = train(bso, [0.2, 0.4, 0.6, 0.95, 0.97], lose_at_epoch_2)
        assert bso.detached
        assert bso.training_finished  # the target, at epoch 4: not bso's stop
        assert bso.last_decision is not None
        assert bso.last_decision.converged
        # One failed report, then nothing tried the service again during the run.
        assert len(switch.calls) == calls_when_lost[0] + 1
        switch.up = True  # back before the run ends: delivered at exit
    assert trained == 4
    (warning,) = warnings_of(caplog)
    assert "training goes on detached at batch size" in warning.getMessage()
    assert "journaled to" in warning.getMessage()
    assert "check the URL and port" in warning.getMessage()
    assert "delivered the detached run" in caplog.text
    (trial,) = switch.trials()
    assert (trial.status, trial.stop_reason, trial.epochs, trial.detached) == (
        TrialStatus.CONVERGED,
        StopReason.TARGET_REACHED,
        4,
        True,
    )
    assert not list(job_folder("job").glob("*.json"))  # acknowledged, so removed
    status = switch.service.status("job")
    assert status.lanes[0].detached_trials == 1


def test_a_door_that_refuses_is_an_outage_the_run_trains_through() -> None:
    """The tenant's door refuses past its limits (RateLimited): the run goes on detached,
    as in any outage, and its journal is delivered once the door admits again."""
    switch = Switch()
    switch.failure = RateLimited("tenant team-a's event was refused at the door", 4.0)

    def refused_from_epoch_2(epoch: int) -> None:
        if epoch == 2:
            switch.up = False

    with make(switch) as bso:
        trained = train(bso, [0.2, 0.4, 0.6, 0.95, 0.97], refused_from_epoch_2)
        assert bso.detached
        switch.up = True
    assert trained == 4
    (trial,) = switch.trials()
    assert (trial.status, trial.epochs, trial.detached) == (TrialStatus.CONVERGED, 4, True)


def test_a_detached_run_finishes_at_max_epochs_without_raising() -> None:
    switch = Switch()
    with make(switch) as bso:
        trained = train(bso, [0.1] * 9, lambda epoch: setattr(switch, "up", epoch < 2))
        assert bso.training_finished
        assert bso.last_decision is not None
        assert not bso.last_decision.converged
        switch.up = True
    assert trained == SPEC.max_epochs
    (trial,) = switch.trials()
    assert (trial.status, trial.stop_reason, trial.detached) == (
        TrialStatus.FAILED,
        StopReason.MAX_EPOCHS,
        True,
    )


def test_a_crash_while_detached_is_delivered_with_its_reason() -> None:
    switch = Switch()
    bso = make(switch)
    bso.get_batch_size()
    bso.on_train_begin()
    bso.on_evaluate(0.1)
    switch.up = False
    bso.on_evaluate(0.2)
    switch.up = True
    bso.close(ZeroDivisionError())  # what ``with`` passes when training raises
    (trial,) = switch.trials()
    assert (trial.status, trial.stop_reason, trial.epochs) == (
        TrialStatus.FAILED,
        StopReason.ABANDONED,
        2,
    )


def test_heartbeats_stop_once_detached() -> None:
    switch = Switch()
    bso = make(switch, heartbeat_interval_s=0.01)
    bso.get_batch_size()
    bso.on_train_begin()
    switch.up = False
    bso.on_evaluate(0.1)
    assert bso.detached
    tried = len(switch.calls)
    for _ in range(3):  # epochs go on; nothing, heartbeats included, asks the service
        bso.on_evaluate(0.1)
    assert len(switch.calls) == tried
    bso.close()


class OneSlowHeartbeat(Switch):
    """The in-process service; its next heartbeat goes unanswered within the bound (a
    worker node restarting, a sweep holding SQLite's writer lock), every other call
    is answered."""

    def __init__(self) -> None:
        super().__init__()
        self.blips = 1

    def __getattr__(self, name: str) -> Callable[..., Any]:
        call = super().__getattr__(name)

        def answered(*args: Any, **kwargs: Any) -> Any:
            if name == "heartbeat" and self.blips:
                self.blips -= 1
                raise ServiceUnavailable("bso service at test: no reply within 5 s (test)")
            return call(*args, **kwargs)

        return answered


def test_one_unanswered_heartbeat_does_not_detach_a_days_long_run() -> None:
    """A run of three days sends 8,640 heartbeats from a thread that blocks nothing; one
    of them unanswered within the bound used to mark the service down for the rest of
    the run, which then trained detached: bso never stopped it early for the days
    left, though every later call would have been answered."""
    switch = OneSlowHeartbeat()
    bso = make(switch, heartbeat_interval_s=0.02)
    bso.get_batch_size()
    bso.on_train_begin()
    bso.on_evaluate(0.1)
    deadline = time.monotonic() + 5
    while switch.blips and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not switch.blips
    heartbeats = switch.calls.count("heartbeat")
    while switch.calls.count("heartbeat") == heartbeats and time.monotonic() < deadline:
        time.sleep(0.01)  # the next heartbeat, answered: the thread went on
    assert not bso.on_evaluate(0.2).stop
    try:
        assert not bso.detached
        assert switch.trials()[0].epochs == 2  # the report after the blip was taken
    finally:
        bso.close()


# -- at start -----------------------------------------------------------------------------


def test_a_run_that_cannot_register_trains_at_the_last_recommendation_known_here(
    caplog: pytest.LogCaptureFixture,
) -> None:
    switch = Switch()
    for _ in range(8):  # enough recurrences for a recommendation
        with make(switch) as bso:
            train(bso, [0.95], lambda _: None)
    recommended = switch.service.status("job").lanes[0].recommended_batch_size
    assert recommended is not None
    caplog.clear()  # those runs met the target at epoch 1: each warned of an easy target
    switch.up = False
    with caplog.at_level(logging.INFO, WARNING_LOGGER), make(switch) as bso:
        assert bso.detached
        assert bso.get_batch_size() == recommended
        assert bso.trial_number is None
        assert switch.calls[-1] == "register"  # nothing after the first failure
        train(bso, [0.5, 0.95], lambda _: None)
    (warning,) = warnings_of(caplog)
    assert "(the last recommendation known on this machine)" in warning.getMessage()
    (journal,) = pending_journals("job")  # the service is still down: kept for later
    switch.up = True
    before = len(switch.trials())
    with make(switch) as bso:  # the next run of the job on this machine delivers it
        bso.get_batch_size()
    delivered = switch.trials()[before]
    assert delivered.detached
    assert delivered.phase is TrialPhase.CONCURRENT
    assert (delivered.status, delivered.epochs) == (TrialStatus.CONVERGED, 2)
    assert not journal.path.exists()


def test_without_a_recommendation_a_detached_start_trains_at_the_default() -> None:
    switch = Switch()
    switch.up = False
    with make(switch) as bso:
        assert bso.get_batch_size() == SPEC.default_batch_size


def test_a_refused_key_is_one_error_line_naming_the_fix(
    caplog: pytest.LogCaptureFixture,
) -> None:
    switch = Switch()
    switch.up = False
    switch.failure = Unauthorized("the API key bso_... was revoked")
    with caplog.at_level(logging.INFO, WARNING_LOGGER), make(switch) as bso:
        train(bso, [0.1, 0.2], lambda _: None)
    (line,) = warnings_of(caplog)
    assert line.levelno == logging.ERROR
    assert "refused this client" in line.getMessage()
    assert "BSO_API_KEY" in line.getMessage()
    assert "ask the operator for a new file" in line.getMessage()
    assert "once the service accepts a key" in line.getMessage()


class LateTrial(Switch):
    """A service too slow for the client's bound: it assigns the trial, but its reply
    comes after the run stopped waiting (a locked database, frozen workers)."""

    def next_trial(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append("next_trial")
        assigned = self.service.next_trial(*args, **kwargs)
        if self.calls.count("next_trial") == 1:  # applied, its answer too late
            raise ServiceUnavailable("bso service at test: no reply after 4 s (test)")
        return assigned


def test_a_trial_assigned_too_late_for_the_run_is_ended_as_no_sizes_fault(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The run trains detached; at its exit, the service back, the trial it never got
    is ended as interrupted before its first epoch (which counts against no size),
    rather than left to its lease, whose expiry counts towards three interruptions in a
    row of the size.  The run's journal is delivered as a trial of its own."""
    switch = LateTrial()
    with caplog.at_level(logging.INFO, WARNING_LOGGER), make(switch) as bso:
        bso.get_batch_size()
        assert bso.detached
        bso.on_train_begin()
        bso.on_evaluate(0.5)
        bso.on_evaluate(0.95)
    orphan, delivered = switch.trials()
    assert (orphan.status, orphan.stop_reason, orphan.epochs) == (
        TrialStatus.INTERRUPTED,
        StopReason.INTERRUPTED,
        0,
    )
    assert (delivered.status, delivered.detached) == (TrialStatus.CONVERGED, True)
    assert len(warnings_of(caplog)) == 1  # the detach; the clean-up is an INFO line
    assert f"bso trial {orphan.trial_number} of job job" in caplog.text


# -- exactly once, and the opt-out ---------------------------------------------------------


def test_a_journal_delivered_again_is_applied_once() -> None:
    switch = Switch()
    switch.up = False
    with make(switch) as bso:
        train(bso, [0.95], lambda _: None)
    (journal,) = pending_journals("job")
    switch.up = True
    switch.service.register(SPEC)  # the job's first run never reached the service
    first = switch.service.deliver_detached_run(journal.run)
    again = switch.service.deliver_detached_run(journal.run)
    assert again == first
    assert len(switch.trials()) == 1


def test_a_killed_runs_journal_is_delivered_as_interrupted(tmp_path: Path) -> None:
    switch = Switch()
    switch.up = False
    bso = make(switch)
    train(bso, [0.1, 0.2], lambda _: None)
    (path,) = job_folder("job").glob("*.json")
    bso._lease.stop_heartbeats()  # the process "dies" here: no close, no atexit
    bso._close_at_exit.cancel()
    assert bso._fail_open.run is not None
    assert bso._fail_open.run.journal is not None
    bso._fail_open.run.journal.release()  # the kernel drops a dead writer's lock
    document = json.loads(path.read_text())
    document["pid"] = _a_dead_pid()
    path.write_text(json.dumps(document))
    switch.up = True
    with make(switch) as other:
        other.get_batch_size()
    interrupted = switch.trials()[0]
    assert (interrupted.status, interrupted.stop_reason, interrupted.epochs) == (
        TrialStatus.INTERRUPTED,
        StopReason.INTERRUPTED,
        2,
    )


def _a_dead_pid() -> int:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


def test_a_running_writers_journal_is_not_delivered_by_another_run() -> None:
    switch = Switch()
    switch.up = False
    bso = make(switch)
    train(bso, [0.1], lambda _: None)
    assert pending_journals("job") == []  # this process is alive and not done
    bso.close()
    assert len(pending_journals("job")) == 1


def test_on_unavailable_raise_keeps_raising() -> None:
    switch = Switch()
    bso = make(switch, on_unavailable="raise")
    bso.get_batch_size()
    bso.on_train_begin()
    switch.up = False
    with pytest.raises(ServiceUnavailable):
        bso.on_evaluate(0.1)
    assert not bso.detached
    bso.close()
    assert not job_folder("job").exists()


def test_raise_mode_still_raises_train_fail_error_when_bso_stops_a_run() -> None:
    switch = Switch()
    with pytest.raises(TrainFailError), make(switch, on_unavailable="raise") as bso:
        train(bso, [0.1] * SPEC.max_epochs, lambda _: None)


def test_the_bound_and_the_mode_are_checked() -> None:
    assert unavailable_bound(None, {}) == DEFAULT_UNAVAILABLE_BOUND_S
    assert unavailable_bound(None, {UNAVAILABLE_BOUND_ENV: "1.5"}) == 1.5
    assert unavailable_bound(2.0, {UNAVAILABLE_BOUND_ENV: "1.5"}) == 2.0
    for bad in ("0", "-1", "nan", "soon"):
        with pytest.raises(ValueError, match=UNAVAILABLE_BOUND_ENV):
            unavailable_bound(None, {UNAVAILABLE_BOUND_ENV: bad})
    with pytest.raises(ValueError, match="on_unavailable"):
        make(Switch(), on_unavailable="ignore")
    for wrong_type in ("5", True):  # a setting named, not math.isfinite's "must be real number"
        with pytest.raises(TypeError, match="unavailable_bound_s="):
            unavailable_bound(wrong_type, {})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("setting", "value"),
    [("heartbeat_interval_s", "30"), ("heartbeat_misses", "3"), ("heartbeat_misses", 2.5)],
)
def test_a_heartbeat_setting_of_the_wrong_type_is_named(setting: str, value: object) -> None:
    with pytest.raises(TypeError, match=f"{setting} must be"):
        make(Switch(), **{setting: value})


# -- the transport's bound -----------------------------------------------------------------


def test_a_silent_service_answers_within_the_call_deadline() -> None:
    # timeout_s alone would wait a minute per try; the deadline ends the call.
    client = ServiceClient(Blackhole(), StubReplyBackend(), timeout_s=60, call_deadline_s=0.2)
    with pytest.raises(ServiceUnavailable, match=r"call_deadline_s=0\.2"):
        client.register(SPEC)


@pytest.fixture
def wrong_port() -> str:
    return f"redis://:hunter2@127.0.0.1:{free_port()}/0"


def test_a_wrong_port_at_start_proceeds_detached_with_one_warning(
    wrong_port: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG):
        bso = BatchSizeOptimizer(
            SPEC, wrong_port, monitor=TimeOnlyMonitor(), environ={}, unavailable_bound_s=0.3
        )
        assert bso.detached
        assert bso.get_batch_size() == SPEC.default_batch_size
        bso.on_train_begin()
        bso.on_evaluate(0.5)
        bso.on_evaluate(0.95)  # at epoch 2: no warning of a target met at once
        assert bso._client is not None
        assert bso._client.calls == 1  # the register that found it; nothing since
        bso.close()
    (warning,) = warnings_of(caplog)
    assert "hunter2" not in caplog.text
    assert "redis://:***@127.0.0.1" in warning.getMessage()
    assert "Connection refused" in warning.getMessage()


def test_a_run_of_no_team_says_its_epochs_are_not_journaled(
    wrong_port: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``bso up`` never ran and nothing was exported: a guessed URL that names no team and
    no API key.  Such a journal belongs to no team and no later run may deliver it, so
    none is written, and the one line says so rather than promising a delivery."""
    monkeypatch.delenv("BSO_API_KEY", raising=False)
    with caplog.at_level(logging.WARNING):
        bso = BatchSizeOptimizer(
            SPEC, wrong_port, monitor=TimeOnlyMonitor(), environ={}, unavailable_bound_s=0.3
        )
        bso.get_batch_size()
        bso.on_train_begin()
        bso.on_evaluate(0.5)
        bso.close()
    (warning,) = warnings_of(caplog)
    assert "its epochs are not journaled (no valid API key" in warning.getMessage()
    assert "delivered" not in warning.getMessage()
    assert not list((cache_dir(None) / "detached").rglob("*.json"))


@pytest.fixture
def not_redis() -> Iterator[str]:
    """A port where another server answers (an HTTP server on a typo'd port)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    stopped = threading.Event()

    def answer() -> None:
        server.settimeout(0.1)
        while not stopped.is_set():
            try:
                connection, _ = server.accept()
            except TimeoutError:
                continue
            with connection:
                connection.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    yield f"redis://127.0.0.1:{server.getsockname()[1]}/0"
    stopped.set()
    thread.join(5)
    server.close()


def test_a_port_where_another_server_answers_detaches_with_the_fix(
    not_redis: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, WARNING_LOGGER):
        bso = BatchSizeOptimizer(
            SPEC, not_redis, monitor=TimeOnlyMonitor(), environ={}, unavailable_bound_s=0.5
        )
        assert bso.detached
        bso.close()
    (warning,) = warnings_of(caplog)
    assert "is not Redis" in warning.getMessage()
    assert "check the URL's host and port" in warning.getMessage()


def test_a_port_where_another_server_answers_is_service_unavailable_in_raise_mode(
    not_redis: str,
) -> None:
    with pytest.raises(ServiceUnavailable, match="is not Redis"):
        BatchSizeOptimizer(
            SPEC, not_redis, monitor=TimeOnlyMonitor(), environ={}, on_unavailable="raise"
        )


# -- a real Redis stopped mid-run, and real workers ------------------------------------------


class WorkerLoop:
    """The workers' task code over a real Redis, in a thread: BRPOP the events queue and
    process each item (tests/test_broker_outage.py); rides out the Redis restart."""

    def __init__(self, url: str, store: MemoryStore) -> None:
        self.url = url
        self.runtime = WorkerRuntime(
            WorkerSettings(_env_file=None),
            store_factory=lambda: store,
            replies_factory=lambda: RedisReplyBackend(url),
        )
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> WorkerLoop:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopped.set()
        self.thread.join(10)
        self.runtime.close()

    def _serve(self, item: bytes) -> None:
        """One queue item, as a worker's task runs it (events and status reads)."""
        message = json.loads(item)
        (payload,), _, _ = json.loads(message["body"])
        headers = message["headers"]
        key, channel = headers.get(keys.API_KEY_HEADER), headers.get(keys.REPLY_CHANNEL_HEADER)
        if headers["task"] == keys.TASK_STATUS:
            process_status(self.runtime, payload, api_key=key, reply_channel=channel)
        else:
            process_event(
                self.runtime, headers["task"], payload, api_key=key, reply_channel=channel
            )

    def _run(self) -> None:
        while not self.stopped.is_set():
            client = redis.Redis.from_url(self.url, socket_timeout=2, retry=Retry(NoBackoff(), 0))
            try:
                # A live worker says so (bso_workers.presence); the AOF keeps it.
                client.set(keys.WORKERS_ALIVE_KEY, "test-worker", ex=600)
                while not self.stopped.is_set():
                    popped = client.brpop([QUEUE], timeout=0.1)
                    if popped is not None:
                        self._serve(popped[1])
            except (redis.ConnectionError, redis.TimeoutError, OSError):
                time.sleep(0.05)  # Redis is down: try again
            finally:
                client.close()


@pytest.fixture
def restartable(tmp_path: Path) -> Iterator[RestartableRedis]:
    """A real Redis with its append-only file on, that a test may stop and start again."""
    server = RestartableRedis(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def test_redis_stopped_mid_run_the_run_finishes_and_is_delivered_after_the_restart(
    restartable: RestartableRedis, caplog: pytest.LogCaptureFixture
) -> None:
    store = MemoryStore()
    api_key = create_key(store, DEFAULT_TENANT)
    with WorkerLoop(restartable.url, store), caplog.at_level(logging.INFO):
        bso = BatchSizeOptimizer(
            SPEC,
            restartable.url,
            api_key=api_key,
            monitor=TimeOnlyMonitor(),
            environ={},
            heartbeat_interval_s=None,
            unavailable_bound_s=1.0,
        )
        assert bso._client is not None
        bso.get_batch_size()
        bso.on_train_begin()
        assert not bso.on_evaluate(0.3).stop
        restartable.stop()
        for metric in (0.5, 0.7, 0.95):  # every epoch trains; the target ends it
            bso.on_evaluate(metric)
        assert bso.detached
        assert bso.training_finished
        calls = bso._client.calls
        restartable.start()
        assert bso._client.calls == calls  # nothing tried the service since the failure
        bso.close()
        assert not pending_journals("job")
        with store.read("job") as tx:
            (trial,) = tx.trials()
        assert (trial.status, trial.epochs, trial.detached) == (TrialStatus.CONVERGED, 4, True)
        assert bso._fail_open.run is not None
        assert bso._fail_open.run.journal is not None
        journal = bso._fail_open.run.journal.run
        with ServiceClient.connect(restartable.url, api_key=api_key) as again:
            assert again.deliver_detached_run(journal).trial_number == trial.trial_number
        with store.read("job") as tx:
            assert tx.trials() == [trial]  # delivered twice, applied once
    detaching = [r for r in warnings_of(caplog) if r.name == WARNING_LOGGER]
    assert len(detaching) == 1
    assert "delivered the detached run" in caplog.text


@pytest.fixture(scope="module")
def cluster(
    worker_cluster_factory: Callable[..., WorkerCluster],
    tmp_path_factory: pytest.TempPathFactory,
) -> WorkerCluster:
    folder = tmp_path_factory.mktemp("fail-open-db")
    return worker_cluster_factory(f"sqlite:///{folder / 'bso.sqlite3'}")


def test_a_refused_key_trains_detached_and_a_good_key_delivers_it_through_real_workers(
    cluster: WorkerCluster, caplog: pytest.LogCaptureFixture
) -> None:
    spec = SPEC.model_copy(update={"job_id": "refused-key"})
    wrong = cluster.api_key[:-1] + ("0" if cluster.api_key[-1] != "0" else "1")
    url = cluster.settings.broker_url

    def run(key: str) -> BatchSizeOptimizer:
        return BatchSizeOptimizer(
            spec,
            url,
            api_key=key,
            monitor=TimeOnlyMonitor(),
            environ={},
            heartbeat_interval_s=None,
            unavailable_bound_s=5.0,
        )

    with caplog.at_level(logging.INFO, WARNING_LOGGER), run(wrong) as bso:
        assert bso.detached
        bso.get_batch_size()
        bso.on_train_begin()
        for metric in (0.5, 0.95):
            bso.on_evaluate(metric)
    (error,) = warnings_of(caplog)
    assert error.levelno == logging.ERROR
    assert "BSO_API_KEY" in error.getMessage()
    assert wrong not in caplog.text
    # Kept (refused again at exit) as the key's: the URL names no team, so the key's
    # id stands in for it, and a fixed secret of the same key finds it.
    owner = local_owner(url, wrong)
    assert owner == local_owner(url, cluster.api_key) == f"key:{wrong[4:16]}"
    assert len(pending_journals("refused-key", owner=owner)) == 1
    with run(cluster.api_key) as bso:  # registers, then delivers the journal
        bso.get_batch_size()
    assert not pending_journals("refused-key", owner=owner)
    status = cluster.client().status("refused-key")
    (lane,) = status.lanes
    assert lane.detached_trials == 1
    assert "detached=1" in describe(status)


@pytest.mark.parametrize(
    ("failure", "fix"),
    [
        (
            RateLimited("tenant team-a's event was refused at the door", 0.5),
            "fix: send fewer events, or ask the operator for higher limits (bso keys limits)",
        ),
        (
            Unauthorized("API key 0123456789ab was revoked"),
            "a revoked key's stop working (ask the operator for a new file)",
        ),
        (ServiceUnavailable("cannot reach the bso broker"), "fix: check the URL and port"),
    ],
    ids=["rate-limited", "refused", "unreachable"],
)
def test_the_detaching_line_names_the_fix_for_what_failed(failure: Exception, fix: str) -> None:
    line = detached_message(
        "redis://h:6379/0", failure, bound_s=5, batch_size=32, size_source="x", journal="j"
    )
    assert fix in line
    assert line.count("fix:") == 1


# -- a lane with no size left --------------------------------------------------------------

STUCK = JobSpec(
    job_id="stuck", batch_sizes=[16], default_batch_size=16, target_metric=0.9, max_epochs=2
)


def stuck_run(switch: Switch, **options: Any) -> BatchSizeOptimizer:
    return BatchSizeOptimizer(
        STUCK, service=switch, environ={}, monitor=TimeOnlyMonitor(),
        heartbeat_interval_s=None, **options,
    )  # fmt: skip


def test_a_lane_with_no_size_left_trains_the_run_at_the_default_after_one_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A run that reaches max_epochs short of the target rules out the job's one
    size (nothing converged, nothing left to try); the next nightly run used to die
    in get_batch_size() with NoFeasibleBatchSize, before it trained.  It trains
    now, at the default, without bso, after one ERROR with the service's message
    (what ruled the sizes out, the commands that get the job going); nothing is
    recorded or journaled, and on_unavailable="raise" still raises."""
    switch = Switch()
    with pytest.raises(TrainFailError, match="max_epochs"), stuck_run(switch) as bso:
        train(bso, [0.1, 0.2], lambda _: None)
    with caplog.at_level(logging.INFO, WARNING_LOGGER), stuck_run(switch) as bso:
        assert bso.get_batch_size() == 16
        assert train(bso, [0.1, 0.2], lambda _: None) == 2
        assert bso.training_finished
        assert bso.trial_number is None
    (error,) = warnings_of(caplog)
    assert error.levelno == logging.ERROR
    message = error.getMessage()
    assert "job stuck has no feasible batch size" in message
    assert "16: failed (max_epochs)" in message
    assert "bso jobs reset stuck" in message
    assert "training goes on at the job's default batch size 16 without bso" in message
    assert len(switch.trials("stuck")) == 1
    assert pending_journals("stuck") == []
    with pytest.raises(NoFeasibleBatchSize, match="16: failed"):
        stuck_run(switch, on_unavailable="raise").get_batch_size()


# -- a job whose configuration changed --------------------------------------------------


def test_a_changed_configuration_trains_the_run_at_the_default_after_one_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A nightly job whose owner raised max_epochs (a new configuration under the same
    job id) used to die at construction with ConfigMismatch, before it trained.  It
    trains now, at the new spec's default, without bso, after one ERROR with the
    service's message (the field that differs, both values, and the fix); nothing is
    recorded or journaled, and on_unavailable="raise" still raises."""
    switch = Switch()
    with make(switch) as bso:
        train(bso, [0.5, 0.95], lambda _: None)
    longer = SPEC.model_copy(update={"max_epochs": 7})
    with caplog.at_level(logging.INFO, WARNING_LOGGER), make(switch, longer) as bso:
        assert bso.get_batch_size() == 16
        assert train(bso, [0.1, 0.2, 0.95], lambda _: None) == 3
        assert bso.training_finished
        assert (bso.trial_number, bso.detached) == (None, True)
    (error,) = warnings_of(caplog)
    assert error.levelno == logging.ERROR
    message = error.getMessage()
    assert "max_epochs (registered 5, this registration 7)" in message
    assert "bso jobs delete job" in message
    assert "training goes on at the job's default batch size 16 without bso" in message
    assert len(switch.trials()) == 1
    assert pending_journals("job") == []
    with pytest.raises(ConfigMismatch, match="max_epochs"):
        make(switch, longer, on_unavailable="raise")


def test_energy_only_where_no_energy_is_measured_trains_the_run_at_the_default(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """eta_knob=1 on a node whose energy cannot be read (a container given the GPU's
    compute capability but not NVML's library, a driver whose NVML fails) used to die
    at construction with InvalidSpec, before it trained, while the same script trains
    on every other node.  It trains now, at the default, without bso, after one
    ERROR naming the cause and the fix; nothing reaches the service or is journaled,
    and on_unavailable="raise" still raises."""
    switch = Switch()
    energy_only = SPEC.model_copy(update={"eta_knob": 1.0})
    with caplog.at_level(logging.INFO, WARNING_LOGGER), make(switch, energy_only) as bso:
        assert bso.get_batch_size() == 16
        assert train(bso, [0.1, 0.2, 0.95], lambda _: None) == 3
        assert bso.training_finished
        assert (bso.trial_number, bso.detached) == (None, True)
    (error,) = warnings_of(caplog)
    assert error.levelno == logging.ERROR
    message = error.getMessage()
    assert "eta_knob=1 optimizes energy alone, but no energy can be measured" in message
    assert "training goes on at the job's default batch size 16 without bso" in message
    assert switch.calls == []
    assert pending_journals("job") == []
    with pytest.raises(InvalidSpec, match="eta_knob=1"):
        make(switch, energy_only, on_unavailable="raise")


def test_a_run_resumed_under_a_changed_configuration_trains_at_the_checkpoints_size(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A run whose bug ended it, fixed together with its spec and started again from
    its checkpoint: the model was trained at the checkpoint's size, so it goes on at
    that size without bso, after one ERROR naming the mismatch; the trial is not
    touched."""
    switch = Switch()
    with make(switch) as bso:
        train(bso, [0.5, 0.95], lambda _: None)
    crashed = make(switch)
    saved: dict[str, Any] = {}

    def crash_in_epoch_1(epoch: int) -> None:
        saved.update(crashed.state_dict())
        raise RuntimeError("typo")

    with pytest.raises(RuntimeError, match="typo"), crashed:
        train(crashed, [0.5, 0.95], crash_in_epoch_1)
    assert saved["batch_size"] != SPEC.default_batch_size
    trials = [(t.trial_number, t.status) for t in switch.trials()]
    fixed = SPEC.model_copy(update={"target_metric": 0.8})
    with caplog.at_level(logging.INFO, WARNING_LOGGER), make(switch, fixed, resume=saved) as bso:
        assert bso.get_batch_size() == saved["batch_size"]
        assert train(bso, [0.5, 0.85], lambda _: None) == 2
        assert bso.training_finished
    (error,) = warnings_of(caplog)
    assert error.levelno == logging.ERROR
    message = error.getMessage()
    assert "target_metric (registered 0.9, this registration 0.8)" in message
    assert f"the checkpoint's batch size {saved['batch_size']} without bso" in message
    assert [(t.trial_number, t.status) for t in switch.trials()] == trials


# -- the job deleted or reset under a running run --------------------------------------


def test_a_job_deleted_mid_run_lets_the_run_train_on_without_bso(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``bso jobs delete JOB`` while a run of the job trains: its next epoch report got
    UnknownJob and the run died mid-training.  It trains on now at its size without bso
    (nothing journaled: the job it ran for is gone), after one WARNING that says why;
    nothing is ended and no line promises what the service cannot do."""
    switch = Switch()

    def delete_at_epoch_2(epoch: int) -> None:
        if epoch == 2:
            switch.service.delete_job("job")

    with caplog.at_level(logging.INFO, WARNING_LOGGER), make(switch) as bso:
        assert train(bso, [0.2, 0.4, 0.6, 0.95], delete_at_epoch_2) == 4
        assert bso.training_finished
        assert bso.detached
    (warning,) = warnings_of(caplog)
    message = warning.getMessage()
    assert "bso trial 1 of job job no longer takes this run's reports" in message
    assert "job 'job' is not registered" in message
    assert "training goes on at batch size 16 without bso" in message
    assert pending_journals("job") == []
    assert switch.trials() == []


def test_a_run_ending_after_its_job_was_deleted_says_there_is_nothing_to_end(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The script raised after ``bso jobs delete`` took its job: the line said the
    service would end the trial once its lease ran out, for a trial it no longer has."""
    switch = Switch()
    bso = make(switch)
    bso.get_batch_size()
    bso.on_train_begin()
    switch.service.delete_job("job")
    with caplog.at_level(logging.INFO, WARNING_LOGGER):
        bso.close(RuntimeError("typo"))  # what `with` does as the script's error unwinds
    (warning,) = warnings_of(caplog)
    message = warning.getMessage()
    assert "could not end bso trial 1 of job job (job 'job' is not registered)" in message
    assert "lease" not in message
    assert "nothing is left to end" in message


@pytest.mark.parametrize("lost_at", [0, 2], ids=["at-start", "mid-run"])
def test_a_journal_that_cannot_be_written_is_said_once_with_its_cause(
    lost_at: int,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A read-only or full cache folder while the service is down: the run's one line
    says the epochs are not journaled because the journal cannot be written (not that
    the job has no job_id), and names BSO_CACHE_DIR, the setting that fixes it."""
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    monkeypatch.setenv("BSO_CACHE_DIR", str(not_a_folder))
    switch = Switch()
    switch.up = lost_at != 0
    with caplog.at_level(logging.INFO, WARNING_LOGGER), make(switch) as bso:
        trained = train(
            bso, [0.1, 0.2, 0.3, 0.95], lambda epoch: setattr(switch, "up", epoch < lost_at)
        )
    assert trained == 4
    (warning,) = warnings_of(caplog)
    message = warning.getMessage()
    assert "training goes on detached" in message
    assert "its epochs are not journaled (cannot write the journal" in message
    assert "BSO_CACHE_DIR" in message
    assert "no job_id" not in message
