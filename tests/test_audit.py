"""bso.audit and bso.storage.history: a store equals the serial replay of its recorded events.

Two jobs' events are applied, interleaved, to a SQLite store; the history read
back per job in commit order replays to the same replies, trials and lanes.
Then the store is tampered with, one way at a time, and the audit names what
differs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import Update, update

from bso.audit import AuditReport, audit
from bso.service import BsoService
from bso.spec import JobSpec
from bso.storage.history import replies_in_commit_order
from bso.storage.schema import lanes, replies, trials
from bso.storage.sql import SqlStore
from bso.storage.sql.engine import make_engine, upgrade
from bso.wire.events import (
    EndTrial,
    EpochDecision,
    EpochReport,
    Event,
    NextTrial,
    RegisterJob,
    TrialAssigned,
)

JOBS = ("audit-a", "audit-b")
B_TRIALS = trials.c.job_id == "audit-b"


def spec(job_id: str) -> JobSpec:
    return JobSpec(
        job_id=job_id,
        batch_sizes=[8, 16, 32],
        default_batch_size=16,
        target_metric=0.9,
        max_epochs=5,
        mab_seed=3,
    )


@pytest.fixture
def database(tmp_path: Path) -> tuple[str, dict[str, Event]]:
    """A SQLite store holding two jobs' recurrences, and every event sent to it."""
    url = f"sqlite:///{tmp_path / 'bso.sqlite3'}"
    upgrade(url)
    store = SqlStore(url)
    service = BsoService(store)
    sent: dict[str, Event] = {}

    def send(event: Event) -> object:
        sent[event.event_id] = event
        return service.request(event)

    try:
        for job_id in JOBS:
            send(RegisterJob(spec=spec(job_id)))
        for recurrence in range(4):
            for job_id in JOBS:  # the two jobs interleave in commit order
                trial = send(NextTrial(job_id=job_id))
                assert isinstance(trial, TrialAssigned)
                number = trial.trial_number
                for epoch in range(1, 6):
                    metric = 0.95 if epoch >= 2 + recurrence % 3 else 0.5
                    decision = send(
                        EpochReport(
                            job_id=job_id,
                            trial_number=number,
                            epoch=epoch,
                            time_s=10.0 * epoch,
                            energy_j=1000.0 * epoch * (1 + trial.batch_size / 64),
                            metric=metric,
                        )
                    )
                    assert isinstance(decision, EpochDecision)
                    if decision.stop:
                        break
                send(EndTrial(job_id=job_id, trial_number=number))
    finally:
        store.close()
    return url, sent


def run_audit(url: str, sent: dict[str, Event]) -> AuditReport:
    store = SqlStore(url)
    try:
        return audit(replies_in_commit_order(url, JOBS), sent, store)
    finally:
        store.close()


def test_history_is_per_job_in_commit_order(database: tuple[str, dict[str, Event]]) -> None:
    url, sent = database
    history = replies_in_commit_order(url)
    assert set(history) == set(JOBS)
    assert sum(len(h) for h in history.values()) == len(sent)
    for job_id, entries in history.items():
        kinds = [sent[e.event_id].kind for e in entries]
        assert kinds[0] == "register"
        assert all(getattr(sent[e.event_id], "job_id", job_id) == job_id for e in entries)
        assert kinds.count("next_trial") == 4
    assert replies_in_commit_order(url, ["audit-a"]).keys() == {"audit-a"}


def test_an_untouched_store_equals_its_serial_replay(
    database: tuple[str, dict[str, Event]],
) -> None:
    url, sent = database
    report = run_audit(url, sent)
    assert report.ok, report.differences
    assert report.jobs == 2
    assert report.replayed == len(sent)
    assert report.trials == 8


@pytest.mark.parametrize(
    ("tamper", "what"),
    [
        (update(trials).where(B_TRIALS, trials.c.trial_number == 2).values(epochs=9), "trial"),
        (update(trials).where(B_TRIALS, trials.c.trial_number == 3).values(cost=1.5), "trial"),
        (update(lanes).where(lanes.c.job_id == "audit-b").values(rng_state='{"s": 0}'), "lane"),
    ],
    ids=["epochs", "cost", "rng_state"],
)
def test_a_changed_row_is_reported(
    database: tuple[str, dict[str, Event]], tamper: Update, what: str
) -> None:
    url, sent = database
    engine = make_engine(url)
    try:
        with engine.begin() as connection:
            connection.execute(tamper)
    finally:
        engine.dispose()
    report = run_audit(url, sent)
    assert not report.ok
    assert {d.what for d in report.differences} == {what}
    assert {d.job_id for d in report.differences} == {"audit-b"}


def test_a_changed_reply_and_an_unknown_event_are_reported(
    database: tuple[str, dict[str, Event]],
) -> None:
    url, sent = database
    history = replies_in_commit_order(url)
    changed = history["audit-a"][-1].event_id  # the last end of a trial
    engine = make_engine(url)
    try:
        with engine.begin() as connection:
            connection.execute(
                update(replies).where(replies.c.event_id == changed).values(reply='{"kind":"x"}')
            )
    finally:
        engine.dispose()
    forgotten = history["audit-b"][-1].event_id
    report = run_audit(url, {k: v for k, v in sent.items() if k != forgotten})
    found = {(d.job_id, d.what) for d in report.differences}
    assert found == {("audit-a", "reply"), ("audit-b", "unknown_event")}


def test_a_trial_missing_from_the_history_is_an_extra_trial(
    database: tuple[str, dict[str, Event]],
) -> None:
    url, sent = database
    history = replies_in_commit_order(url, JOBS)
    # Drop the job's last recurrence from the history: its trial is then in the store only.
    a = history["audit-a"]
    last_next = max(i for i, e in enumerate(a) if sent[e.event_id].kind == "next_trial")
    history["audit-a"] = a[:last_next]
    store = SqlStore(url)
    try:
        report = audit(history, sent, store)
    finally:
        store.close()
    assert {d.what for d in report.differences} >= {"extra_trial"}
    assert {d.job_id for d in report.differences} == {"audit-a"}


def test_two_tenants_jobs_of_one_id_replay_each_as_its_tenants(tmp_path: Path) -> None:
    """Job ids are per tenant: the history is per job key, and each is replayed as
    the tenant it belongs to, so two teams' ``nightly`` are audited apart."""
    url = f"sqlite:///{tmp_path / 'bso.sqlite3'}"
    upgrade(url)
    store = SqlStore(url)
    sent: dict[str, Event] = {}
    try:
        service = BsoService(store)
        for tenant, time_s in (("default", 10.0), ("team-a", 20.0)):
            for event in (RegisterJob(spec=spec("nightly")), NextTrial(job_id="nightly")):
                sent[event.event_id] = event
                service.handle(event, tenant)
            report = EpochReport(
                job_id="nightly", trial_number=1, epoch=1, time_s=time_s, energy_j=1e3, metric=0.5
            )
            sent[report.event_id] = report
            assert isinstance(service.handle(report, tenant), EpochDecision)
        history = replies_in_commit_order(url)
        assert sorted(history) == ["nightly", "team-a/nightly"]
        audited = audit(history, sent, store)
    finally:
        store.close()
    assert audited.ok, audited.differences
    assert (audited.jobs, audited.replayed, audited.trials) == (2, 6, 2)
