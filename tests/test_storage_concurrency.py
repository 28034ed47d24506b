"""Race-freedom of the SQL store across real processes.

Several spawned processes, each with its own :class:`SqlStore`, register the
same job at the same moment and then run trials of it through
:class:`BsoService`.  Serialization per job is what keeps the outcome sane: one
registration creates the job, trial numbers are unique and contiguous, every
epoch report lands exactly once, and the best-cost bookkeeping the stop rules
read matches the trials.  Any lost update or interleaving shows up here.
"""

from __future__ import annotations

import multiprocessing
import traceback
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Barrier
from pathlib import Path

import pytest
from sqlalchemy import func, select

from bso.core.vocabulary import StopReason, TrialStatus
from bso.service import BsoService, build_snapshot
from bso.spec import JobSpec
from bso.storage.schema import replies
from bso.storage.sql import SqlStore
from bso.storage.sql.engine import upgrade
from bso.wire.events import (
    EVENT_ADAPTER,
    REPLY_ADAPTER,
    EndTrial,
    EpochDecision,
    EpochReport,
    Event,
    JobRegistered,
    NextTrial,
    RegisterJob,
    Reply,
    TrialAssigned,
)

PROCESSES = 4
ROUNDS = 3
"""Trials each process runs."""
JOB_ID = "contended"
SPEC = JobSpec(
    job_id=JOB_ID,
    batch_sizes=[16, 32, 64, 128],
    default_batch_size=32,
    target_metric=0.9,
    beta_knob=2.0,
    mab_seed=5,
)
RESULT_TIMEOUT_S = 120
JOIN_TIMEOUT_S = 10

Log = list[tuple[Event, Reply]]


def run_worker(index: int, store: SqlStore) -> Log:
    """Register the job, then run ROUNDS trials; every event with its reply."""
    service = BsoService(store)
    log: Log = []

    def send(event: Event) -> Reply:
        reply = service.handle(event)
        log.append((event, reply))
        if reply.kind == "error":
            raise AssertionError(f"process {index}: {event!r} got {reply!r}")
        return reply

    send(RegisterJob(spec=SPEC, event_id=f"register-{index}"))
    for round_ in range(ROUNDS):
        trial = send(NextTrial(job_id=JOB_ID, event_id=f"next-{index}-{round_}"))
        assert isinstance(trial, TrialAssigned)
        speed = 0.15 + 0.02 * index + 0.1 / (1 + abs(trial.batch_size - 48) / 16)
        for epoch in range(1, 8):
            decision = send(
                EpochReport(
                    job_id=JOB_ID,
                    trial_number=trial.trial_number,
                    epoch=epoch,
                    time_s=epoch * (4.0 + index + trial.batch_size / 64),
                    energy_j=epoch * (700.0 + 10 * index),
                    metric=min(1.0, epoch * speed),
                    event_id=f"epoch-{index}-{round_}-{epoch}",
                )
            )
            # Every third process crashes in its first round after one epoch.
            if decision.kind == "epoch_decision" and (
                decision.stop or (index % 3 == 0 and round_ == 0)
            ):
                break
        send(
            EndTrial(
                job_id=JOB_ID, trial_number=trial.trial_number, event_id=f"end-{index}-{round_}"
            )
        )
    return log


def worker(url: str, index: int, barrier: Barrier, results: Queue[tuple[int, str]]) -> None:
    """Process body: its own store, started together with the others."""
    try:
        store = SqlStore(url)
        barrier.wait(RESULT_TIMEOUT_S)
        log = run_worker(index, store)
        store.close()
        # As JSON, the way events and replies travel between processes in production.
        payload = "\n".join(f"{e.model_dump_json()}\t{r.model_dump_json()}" for e, r in log)
        results.put((index, payload))
    except BaseException:
        barrier.abort()  # release the others rather than leave them waiting
        results.put((-1, traceback.format_exc()))


def run_processes(url: str) -> Log:
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(PROCESSES)
    results: Queue[tuple[int, str]] = context.Queue()
    processes = [
        context.Process(target=worker, args=(url, index, barrier, results))
        for index in range(PROCESSES)
    ]
    for process in processes:
        process.start()
    try:
        outputs = [results.get(timeout=RESULT_TIMEOUT_S) for _ in processes]
    finally:
        for process in processes:
            process.join(JOIN_TIMEOUT_S)
            if process.is_alive():
                process.kill()
    failures = [text for index, text in outputs if index < 0]
    assert not failures, "\n".join(failures)
    log: Log = []
    for _, payload in outputs:
        for line in payload.splitlines():
            event_json, reply_json = line.split("\t")
            log.append(
                (EVENT_ADAPTER.validate_json(event_json), REPLY_ADAPTER.validate_json(reply_json))
            )
    return log


@pytest.fixture(
    params=[
        pytest.param("sqlite"),
        pytest.param("postgres", marks=pytest.mark.postgres),
        pytest.param("mariadb", marks=pytest.mark.mysql),
    ]
)
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A migrated database without any job."""
    if request.param == "sqlite":
        sqlite_url = f"sqlite:///{tmp_path / 'bso.db'}"
        upgrade(sqlite_url)
        return sqlite_url
    server_url: str = request.getfixturevalue(f"fresh_{request.param}_url")
    return server_url


def test_processes_share_one_job_without_races(url: str) -> None:
    log = run_processes(url)
    created = [r.created for _, r in log if isinstance(r, JobRegistered)]
    assert sorted(created) == [False] * (PROCESSES - 1) + [True]
    assigned = [r.trial_number for _, r in log if isinstance(r, TrialAssigned)]
    assert sorted(assigned) == list(range(1, PROCESSES * ROUNDS + 1))

    # The last report of each trial, as its process saw it.
    last_report: dict[int, tuple[EpochReport, EpochDecision]] = {}
    reports = 0
    for event, reply in log:
        if isinstance(event, EpochReport) and isinstance(reply, EpochDecision):
            last_report[event.trial_number] = (event, reply)
            reports += 1

    store = SqlStore(url)
    with store.transaction(JOB_ID) as tx:
        job = tx.get_job()
        assert job is not None
        stored = tx.trials()
        # Every event's reply was recorded, once, and is the one its process got.
        for event, reply in log:
            recorded = tx.recorded_reply(event.event_id)
            assert recorded is not None
            assert REPLY_ADAPTER.validate_json(recorded.reply_json) == reply
        snapshot = build_snapshot(tx, job, job.spec.hardware)
    with store.engine.connect() as connection:
        assert connection.execute(select(func.count()).select_from(replies)).scalar() == len(log)

    assert [t.trial_number for t in stored] == list(range(1, PROCESSES * ROUNDS + 1))
    assert sum(t.epochs for t in stored) == reports
    for trial in stored:
        report, decision = last_report[trial.trial_number]
        assert (trial.epochs, trial.time_s, trial.energy_j) == (
            report.epoch,
            report.time_s,
            report.energy_j,
        )
        assert trial.cost == decision.cost
        assert trial.status is not TrialStatus.RUNNING
        if decision.stop:
            assert trial.stop_reason is decision.reason
            assert (trial.status is TrialStatus.CONVERGED) is decision.converged
        else:
            assert trial.stop_reason is StopReason.ABANDONED

    converged = [d.cost for _, d in last_report.values() if d.converged]
    assert converged, "the workload should let some trials converge"
    assert snapshot.min_cost == min(converged)
    status = BsoService(store).status(JOB_ID)
    (lane,) = status.lanes
    assert lane.trials == PROCESSES * ROUNDS
    assert lane.running_trials == 0
    assert sum(size.converged for size in lane.sizes) == len(converged)
    store.close()
