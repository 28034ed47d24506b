"""The pipeline end to end: real Redis, real Celery worker processes, SQLite and PostgreSQL.

* 32 trials of one job run concurrently through 4 worker processes and end
  with unique trial numbers, every report counted once, and exactly the state
  (and the very replies) of a serial run of the same events in commit order.
* A trial whose client goes silent is failed by the sweep that a real beat
  process schedules.
* A worker process killed in the middle of an event gets the event redelivered:
  a prefork pool process (the node requeues it at once) and a solo node killed
  by bso's hard time limit (another node restores it after the visibility
  timeout).
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis
from sqlalchemy import select

from bso.cli import main
from bso.core.vocabulary import StopReason, TrialStatus
from bso.errors import OutOfOrder
from bso.service import BsoService
from bso.spec import JobSpec
from bso.storage.memory import MemoryStore
from bso.storage.schema import replies
from bso.storage.sql import SqlStore
from bso.storage.sql.engine import make_engine, upgrade
from bso.wire import keys
from bso.wire.events import (
    EndTrial,
    EpochDecision,
    EpochReport,
    Event,
    NextTrial,
    RegisterJob,
    TrialAssigned,
)
from bso.wire.replies import RedisReplyBackend
from bso_workers.limits import HARD_LIMIT_EXIT_CODE
from bso_workers.stack import node_name, start_worker, wait_for_workers
from tests.fixtures.celery_publisher import CeleryPublisher
from tests.fixtures.celery_workers import WorkerCluster
from tests.fixtures.postgres import PostgresServer

pytestmark = pytest.mark.integration

TRIALS = 32
SIZES = [8, 16, 32, 64]
EPOCHS_TO_TARGET: dict[int, int | None] = {8: None, 16: 3, 32: 2, 64: 4}
"""Epochs each size needs to reach the target; 8 never does."""


def sqlite_url(folder: Path) -> str:
    url = f"sqlite:///{folder / 'bso.sqlite3'}"
    upgrade(url)
    return url


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def database_url(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    if request.param == "sqlite":
        yield sqlite_url(tmp_path_factory.mktemp("sqlite"))
        return
    server: PostgresServer = request.getfixturevalue("postgres_server")
    name = server.create_database()
    yield server.url(name)
    server.drop_database(name)


@pytest.fixture(scope="module")
def four_workers(
    database_url: str, worker_cluster_factory: Callable[..., WorkerCluster]
) -> Iterator[WorkerCluster]:
    """Four solo worker nodes: four worker processes, each its own consumer and store."""
    cluster = worker_cluster_factory(database_url, nodes=4)
    yield cluster
    cluster.stop()  # before the other database's cluster starts


def run_trial(cluster: WorkerCluster, job_id: str, sent: list[Event]) -> list[object]:
    """What one training run does: ask for a trial, report epochs until told to stop, end."""
    client = cluster.client(timeout_s=60)
    answers: list[object] = []

    def request(event: Event) -> object:
        sent.append(event)  # list.append is atomic: safe across the client threads
        reply = client.request(event)
        answers.append(reply)
        return reply

    trial = request(NextTrial(job_id=job_id))
    assert isinstance(trial, TrialAssigned)
    needed = EPOCHS_TO_TARGET[trial.batch_size]
    for epoch in range(1, 100):
        reached = needed is not None and epoch >= needed
        report = EpochReport(
            job_id=job_id,
            trial_number=trial.trial_number,
            epoch=epoch,
            time_s=epoch * 10.0 * trial.batch_size**0.5,
            energy_j=epoch * 1000.0 * trial.batch_size**0.5,
            metric=0.95 if reached else 0.5,
        )
        decision = request(report)
        assert isinstance(decision, EpochDecision)
        if decision.stop:
            break
    request(EndTrial(job_id=job_id, trial_number=trial.trial_number))
    return answers


def test_concurrent_trials_of_one_job_match_a_serial_run(
    four_workers: WorkerCluster, database_url: str
) -> None:
    assert len(four_workers.nodes) == 4
    assert four_workers.pool_pids() == []  # solo: each node runs its tasks itself
    job_id = "concurrent"
    spec = JobSpec(
        job_id=job_id,
        batch_sizes=SIZES,
        default_batch_size=32,
        target_metric=0.9,
        max_epochs=6,
        mab_seed=11,
    )
    register = RegisterJob(spec=spec)
    sent: list[Event] = [register]
    four_workers.client().request(register)

    with ThreadPoolExecutor(TRIALS) as pool:
        futures = [pool.submit(run_trial, four_workers, job_id, sent) for _ in range(TRIALS)]
        answers = [f.result() for f in futures]

    # Unique trial numbers, one per run.
    numbers = sorted(a[0].trial_number for a in answers)  # type: ignore[attr-defined]
    assert numbers == list(range(1, TRIALS + 1))

    # Every report counted exactly once.
    store = SqlStore(database_url)
    try:
        with store.transaction(job_id) as tx:
            trials = {t.trial_number: t for t in tx.trials()}
        recorded = read_replies(database_url, job_id)
    finally:
        store.close()
    reports: dict[int, int] = {}
    for event in sent:
        if isinstance(event, EpochReport):
            reports[event.trial_number] = reports.get(event.trial_number, 0) + 1
    assert {n: t.epochs for n, t in trials.items()} == reports
    assert all(t.status is not TrialStatus.RUNNING for t in trials.values())
    assert sorted(e for e, _ in recorded) == sorted(e.event_id for e in sent)

    # A serial run of the same events in commit order gives the same replies and state.
    by_id = {e.event_id: e for e in sent}
    serial = BsoService(MemoryStore())
    for event_id, reply_json in recorded:
        assert serial.handle(by_id[event_id]).model_dump_json() == reply_json, event_id
    with serial.store.transaction(job_id) as tx:
        serial_trials = {t.trial_number: t for t in tx.trials()}
        serial_lanes = {k: tx.get_lane(k) for k in {t.hardware_key for t in serial_trials.values()}}
    assert {n: comparable(t) for n, t in serial_trials.items()} == {
        n: comparable(t) for n, t in trials.items()
    }
    store = SqlStore(database_url)
    try:
        with store.transaction(job_id) as tx:
            lanes = {k: tx.get_lane(k) for k in serial_lanes}
    finally:
        store.close()
    assert lanes == serial_lanes


def read_replies(database_url: str, job_id: str) -> list[tuple[str, str]]:
    """(event id, reply) of the job in the order the store committed them."""
    engine = make_engine(database_url)
    try:
        with engine.connect() as connection:
            rows = connection.execute(
                select(replies.c.event_id, replies.c.reply)
                .where(replies.c.job_id == job_id)
                .order_by(replies.c.created_at)
            )
            return [(row.event_id, row.reply) for row in rows]
    finally:
        engine.dispose()


def comparable(trial: object) -> tuple[object, ...]:
    """A trial without its wall-clock timestamps."""
    fields = ("batch_size", "phase", "status", "epochs", "time_s", "energy_j", "cost")
    return tuple(getattr(trial, f) for f in (*fields, "last_metric", "stop_reason"))


def test_a_redelivered_event_is_applied_once(four_workers: WorkerCluster) -> None:
    spec = JobSpec(job_id="again", batch_sizes=[8, 16], default_batch_size=16, target_metric=1)
    client = four_workers.client()
    client.register(spec)
    event = NextTrial(job_id="again")
    publisher = CeleryPublisher(four_workers.settings.broker_url, api_key=four_workers.api_key)
    try:
        for attempt in range(3):
            publisher.publish(keys.TASK_NEXT_TRIAL, event.model_dump_json(), f"dup.{attempt}")
    finally:
        publisher.close()
    key = keys.reply_key_for(event.model_dump(mode="json"))
    assert key is not None
    # One key, one reply: each copy's worker stores the same recorded reply there.
    first = client.replies.pop(key, 30)
    assert first is not None
    later = client.replies.pop(key, 2)
    assert later in (None, first)
    assert client.status("again").lanes[0].trials == 1


# -- beat and worker death: one node on SQLite ---------------------------------------------


@pytest.fixture(scope="module")
def swept_cluster(
    worker_cluster_factory: Callable[..., WorkerCluster], tmp_path_factory: pytest.TempPathFactory
) -> WorkerCluster:
    url = sqlite_url(tmp_path_factory.mktemp("swept"))
    return worker_cluster_factory(url, beat=True, heartbeat_timeout_s=1.0, sweep_interval_s=0.5)


def test_beat_interrupts_a_silent_trial(swept_cluster: WorkerCluster) -> None:
    client = swept_cluster.client()
    spec = JobSpec(job_id="silent", batch_sizes=[8, 16], default_batch_size=16, target_metric=1)
    client.register(spec)
    trial = client.next_trial("silent")
    deadline = time.monotonic() + 20
    while client.status("silent").lanes[0].running_trials:
        assert time.monotonic() < deadline, swept_cluster.logs()
        time.sleep(0.2)
    with pytest.raises(OutOfOrder, match="heartbeat_timeout"):
        client.report_epoch("silent", trial.trial_number, epoch=1, time_s=1, energy_j=1, metric=0)
    ended = client.end_trial("silent", trial.trial_number)
    assert (ended.status, ended.reason) == (TrialStatus.INTERRUPTED, StopReason.HEARTBEAT_TIMEOUT)


TRAINING_CHILD = """
import sys, time
from bso.spec import JobSpec
from bso_client import BatchSizeOptimizer, TimeOnlyMonitor
url, key = sys.argv[1], sys.argv[2]
spec = JobSpec(job_id="killed", batch_sizes=[8, 16], default_batch_size=16, target_metric=1)
bso = BatchSizeOptimizer(spec, url, api_key=key, monitor=TimeOnlyMonitor(), environ={},
                         heartbeat_interval_s=1.0, heartbeat_misses=10)
print(bso.get_batch_size(), flush=True)
bso.on_train_begin()
time.sleep(600)  # "training": only the heartbeat thread speaks
"""


def test_a_killed_client_is_interrupted_once_its_heartbeats_stop(
    swept_cluster: WorkerCluster,
) -> None:
    # The child promises a heartbeat every second and may miss 10: a 10 s lease,
    # ten times the cluster's default timeout for callers without heartbeats.
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            TRAINING_CHILD,
            swept_cluster.settings.broker_url,
            swept_cluster.api_key,
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "16"
        client = swept_cluster.client()
        time.sleep(12)  # past the lease: only the heartbeats keep the trial running
        assert client.status("killed").lanes[0].running_trials == 1, swept_cluster.logs()
    finally:
        child.kill()  # SIGKILL: no handler runs, nothing is sent
        child.wait()
    killed_at = time.monotonic()
    while client.status("killed").lanes[0].running_trials:
        assert time.monotonic() - killed_at < 30, swept_cluster.logs()
        time.sleep(0.2)
    noticed_after = time.monotonic() - killed_at
    assert noticed_after > 5  # the lease, not the 1 s default, applied
    (size,) = client.status("killed").lanes[0].sizes
    assert size.outcomes == {"interrupted": 1}
    # Not the size's fault: the next run gets 16 again.
    assert client.next_trial("killed").batch_size == 16


@pytest.fixture(scope="module")
def lone_worker(
    worker_cluster_factory: Callable[..., WorkerCluster], tmp_path_factory: pytest.TempPathFactory
) -> tuple[WorkerCluster, Path]:
    folder = tmp_path_factory.mktemp("lone")
    return worker_cluster_factory(sqlite_url(folder)), folder / "bso.sqlite3"


@pytest.fixture(scope="module")
def lone_prefork_worker(
    worker_cluster_factory: Callable[..., WorkerCluster], tmp_path_factory: pytest.TempPathFactory
) -> tuple[WorkerCluster, Path]:
    folder = tmp_path_factory.mktemp("prefork")
    return worker_cluster_factory(sqlite_url(folder), pool="prefork"), folder / "bso.sqlite3"


def test_an_event_survives_the_death_of_its_prefork_process(
    lone_prefork_worker: tuple[WorkerCluster, Path],
) -> None:
    cluster, database = lone_prefork_worker
    (victim,) = cluster.pool_pids()
    with register_blocked_in_its_transaction(cluster, database, "survivor") as event:
        os.kill(victim, signal.SIGKILL)
        wait_for(
            lambda: victim not in cluster.pool_pids() and len(cluster.pool_pids()) == 1,
            "a replacement pool process",
            cluster,
        )
    client = cluster.client()
    key = keys.reply_key_for(event.model_dump(mode="json"))
    assert key is not None
    reply = client.replies.pop(key, 30)
    assert reply is not None, cluster.logs()
    assert '"created":true' in reply
    assert "WorkerLostError" in cluster.logs()
    assert client.status("survivor").job_id == "survivor"


HARD_LIMIT_S = 3.0


@pytest.fixture(scope="module")
def limited_worker(
    worker_cluster_factory: Callable[..., WorkerCluster], tmp_path_factory: pytest.TempPathFactory
) -> tuple[WorkerCluster, Path]:
    folder = tmp_path_factory.mktemp("limited")
    cluster = worker_cluster_factory(
        sqlite_url(folder),
        soft_time_limit_s=1.5,  # room for a fresh node's first event (opening the store)
        time_limit_s=HARD_LIMIT_S,
        visibility_timeout_s=9.0,  # above 3 s + the watchdog's polling + Celery's 5 s backstop
    )
    return cluster, folder / "bso.sqlite3"


def test_a_solo_node_past_the_hard_limit_dies_and_its_event_is_delivered_again(
    limited_worker: tuple[WorkerCluster, Path],
) -> None:
    cluster, database = limited_worker
    (node,) = cluster.nodes
    # Blocked on SQLite's lock inside a C call: the soft limit cannot interrupt it.
    with register_blocked_in_its_transaction(cluster, database, "rescued") as event:
        node.popen.wait(HARD_LIMIT_S + 10)
    assert node.popen.returncode == HARD_LIMIT_EXIT_CODE, cluster.logs()
    assert "hard time limit (3 s) exceeded by bso.register" in cluster.logs()
    assert unacked(cluster.redis()) == 1  # not acknowledged: it will be delivered again
    replacement = start_worker(cluster.settings, cluster.data_dir, f"{node.name}b")
    cluster.nodes.append(replacement)
    wait_for_workers(cluster.settings, [node_name(replacement.name)], [replacement])
    key = keys.reply_key_for(event.model_dump(mode="json"))
    assert key is not None
    reply = cluster.client().replies.pop(key, 30)
    assert reply is not None, cluster.logs()
    assert '"created":true' in reply
    assert cluster.client().status("rescued").job_id == "rescued"
    broker = cluster.redis()
    assert broker.get(keys.deaths_key(event.event_id)) == "1"  # seen as redelivered, counted
    wait_for(lambda: unacked(broker) == 0, "the redelivered event to be acknowledged", cluster)


def test_a_stopping_worker_finishes_its_running_event(
    lone_worker: tuple[WorkerCluster, Path],
) -> None:
    cluster, database = lone_worker
    (node,) = cluster.nodes
    broker = cluster.redis()
    stopping = threading.Thread(target=cluster.stop)
    with register_blocked_in_its_transaction(cluster, database, "finisher") as event:
        stopping.start()
        time.sleep(1)
        assert node.alive(), "a warm shutdown waits for the running event"
    stopping.join()
    assert node.popen.returncode == 0, cluster.logs()
    key = keys.reply_key_for(event.model_dump(mode="json"))
    assert key is not None
    backend = RedisReplyBackend(cluster.settings.broker_url)
    try:
        reply = backend.pop(key, 5)
    finally:
        backend.close()
    assert reply is not None, cluster.logs()
    assert '"created":true' in reply
    assert unacked(broker) == 0


@contextmanager
def register_blocked_in_its_transaction(
    cluster: WorkerCluster, database: Path, job_id: str
) -> Iterator[RegisterJob]:
    """Publish a register event and hold SQLite's write lock until the block ends.

    The worker takes the event and waits inside its store transaction, which is
    where a dying or stopping worker must not lose or half-apply it.
    """
    spec = JobSpec(job_id=job_id, batch_sizes=[8, 16], default_batch_size=16, target_metric=1)
    event = RegisterJob(spec=spec)
    lock = sqlite3.connect(database, isolation_level=None)
    lock.execute("BEGIN IMMEDIATE")
    try:
        publisher = CeleryPublisher(cluster.settings.broker_url, api_key=cluster.api_key)
        publisher.publish(keys.TASK_REGISTER, event.model_dump_json(), f"{job_id}.1")
        publisher.close()
        broker = cluster.redis()
        wait_for(lambda: unacked(broker) == 1, "the event to be taken", cluster)
        time.sleep(0.5)  # let the pool process enter the transaction
        yield event
    finally:
        lock.execute("ROLLBACK")
        lock.close()


def unacked(broker: redis.Redis) -> int:
    return int(broker.hlen(keys.BROKER_KEY_PREFIX + "unacked"))


def wait_for(condition: Callable[[], bool], what: str, cluster: WorkerCluster) -> None:
    deadline = time.monotonic() + 20
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}\n{cluster.logs()}"
        time.sleep(0.05)


def test_bso_status_reads_the_live_service(
    swept_cluster: WorkerCluster, capsys: pytest.CaptureFixture[str]
) -> None:
    client = swept_cluster.client()
    spec = JobSpec(job_id="shown", batch_sizes=[8, 16], default_batch_size=16, target_metric=1)
    client.register(spec)
    # A lease, or this cluster's 1 s default could sweep the trial before its report
    # on a busy machine.
    trial = client.next_trial("shown", lease_s=60.0)
    client.report_epoch("shown", trial.trial_number, epoch=1, time_s=1, energy_j=1, metric=1)
    url, key = swept_cluster.settings.broker_url, swept_cluster.api_key
    assert main(["status", "shown", "--broker-url", url, "--api-key", key]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("bso-status job=shown ")
    assert "recommended=16" in first
    assert "sizes=16:converged=1" in first
    # Another tenant's key (or none) reads nothing: a user error, with the fix named.
    assert main(["status", "shown", "--broker-url", url, "--api-key", "bso_x"]) == 2
    err = capsys.readouterr().err
    assert "api key is malformed" in err.lower()
    assert "--api-key or BSO_API_KEY" in err
