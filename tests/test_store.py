"""bso.storage.sql.store: what only the SQL store has: timestamps, driver errors and
its connections."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import pytest
from sqlalchemy import Engine, exc, text

from bso.core.vocabulary import TrialPhase
from bso.spec import JobSpec
from bso.storage.base import StoredReply
from bso.storage.sql import SqlStore
from bso.storage.sql.engine import make_engine, upgrade

T0 = datetime(2026, 3, 1, 8, 30, tzinfo=UTC)
SPEC = JobSpec(job_id="job", batch_sizes=[8, 16], default_batch_size=8, target_metric=1.0)


@pytest.fixture(
    params=[pytest.param("sqlite"), pytest.param("postgres", marks=pytest.mark.postgres)]
)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[SqlStore]:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'bso.db'}"
        upgrade(url)
    else:
        url = request.getfixturevalue("fresh_postgres_url")
    built = SqlStore(url)
    yield built
    built.close()


def test_timestamps_come_back_as_utc_aware_datetimes(store: SqlStore) -> None:
    plus_five = timezone(timedelta(hours=5, minutes=30))
    with store.transaction("job") as tx:
        tx.create_job(SPEC, T0.astimezone(plus_five))
        tx.add_trial("cpu x1", 8, TrialPhase.EXPLORATION, T0.astimezone(plus_five))
    with store.transaction("job") as tx:
        job = tx.get_job()
        (trial,) = tx.trials()
    assert job is not None
    for moment in (job.created_at, trial.created_at, trial.updated_at):
        assert moment == T0
        assert moment.tzinfo is UTC


def test_naive_datetimes_are_refused(store: SqlStore) -> None:
    naive = datetime(2026, 3, 1, 8, 30)
    with store.transaction("job") as tx, pytest.raises(ValueError, match="naive"):
        tx.create_job(SPEC, naive)
    assert store.job_ids() == []


def _backend_pid(store: SqlStore) -> int:
    with store.engine.connect() as connection:
        pid: int = connection.execute(text("SELECT pg_backend_pid()")).scalar_one()
        return pid


FORK_SCENARIO = """
import json, multiprocessing, sys
from datetime import UTC, datetime
from sqlalchemy import create_engine, text
from sqlalchemy.pool import NullPool
from bso.spec import JobSpec
from bso.storage.sql import SqlStore

def backend_pid(store):
    with store.engine.connect() as connection:
        return connection.execute(text("SELECT pg_backend_pid()")).scalar_one()

def last_query(pid):  # what backend pid's session ran last, read on a connection of its own
    probe = create_engine(sys.argv[1], poolclass=NullPool)
    with probe.connect() as connection:
        return connection.execute(
            text("SELECT query FROM pg_stat_activity WHERE pid = :pid"), {"pid": pid}
        ).scalar_one()

def register_in_child(store, pids):
    spec = JobSpec(job_id="from-child", batch_sizes=[8], default_batch_size=8, target_metric=1)
    with store.transaction("from-child") as tx:
        tx.create_job(spec, datetime(2026, 1, 1, tzinfo=UTC))
    pids.put(backend_pid(store))

store = SqlStore(sys.argv[1])
parent = backend_pid(store)  # the pool now holds this process's connection
before = last_query(parent)
context = multiprocessing.get_context("fork")
pids = context.SimpleQueue()
child = context.Process(target=register_in_child, args=(store, pids))
child.start()
child.join(60)
print(json.dumps({
    "exitcode": child.exitcode,
    "child": pids.get() if child.exitcode == 0 else None,
    "parents_session_untouched": last_query(parent) == before,
    "parent": parent,
    "parent_after": backend_pid(store),
    "jobs": store.job_ids(),
}))
store.close()
"""


@pytest.mark.postgres
def test_forked_child_opens_its_own_connections(fresh_postgres_url: str) -> None:
    """A store inherited across fork (Celery prefork) must not share the parent's sockets.

    The parent is a fresh interpreter, as a prefork worker's parent is: a fork of
    this long-lived test process inherits whatever earlier tests left in it."""
    run = subprocess.run(
        [sys.executable, "-c", FORK_SCENARIO, fresh_postgres_url],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    found = json.loads(run.stdout)
    assert found["exitcode"] == 0, run.stderr
    assert found["child"] != found["parent"]
    # Nothing of the child's, not even the pool's ping, went over the parent's socket.
    assert found["parents_session_untouched"], found
    assert found["parent_after"] == found["parent"]
    assert found["jobs"] == ["from-child"]


def test_driver_errors_surface_as_sqlalchemy_errors_and_roll_back(store: SqlStore) -> None:
    with store.transaction("job") as tx:
        tx.create_job(SPEC, T0)
        tx.record_reply("event", StoredReply("{}"), T0)

    def reuse_the_event_id() -> None:
        with store.transaction("job") as tx:
            tx.add_trial("cpu x1", 8, TrialPhase.EXPLORATION, T0)
            tx.record_reply("event", StoredReply("{}"), T0)

    with pytest.raises(exc.IntegrityError):
        reuse_the_event_id()
    with store.transaction("job") as tx:
        assert tx.trials() == []
        assert tx.add_trial("cpu x1", 8, TrialPhase.EXPLORATION, T0).trial_number == 1


def read_on_a_connection_ended_mid_transaction(
    store: SqlStore, admin: Engine, ended: list[int]
) -> None:
    """Read a trial in a transaction whose connection ``admin`` ends just before; the
    connection's backend pid is appended to ``ended``."""
    with store.transaction("job") as tx:
        pid = tx._session.one("SELECT pg_backend_pid()", {})[0]
        ended.append(pid)
        with admin.begin() as connection:
            connection.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
        tx.get_trial(1)


@pytest.mark.postgres
def test_a_lost_connection_is_invalidated_and_replaced(
    fresh_postgres_url: str, postgres_url: str
) -> None:
    """The workers retry on OperationalError; the retry must not get the dead connection.
    The connection is lost in the middle of the event's transaction (one lost while
    idle in the pool is replaced before use: tests/test_engine.py)."""
    store = SqlStore(fresh_postgres_url)
    with store.transaction("job") as tx:
        tx.create_job(SPEC, T0)
    admin = make_engine(postgres_url)
    ended: list[int] = []
    with pytest.raises(exc.OperationalError) as lost:
        read_on_a_connection_ended_mid_transaction(store, admin, ended)
    admin.dispose()
    assert lost.value.connection_invalidated
    with store.transaction("job") as tx:
        assert tx.get_job() is not None
    assert _backend_pid(store) not in ended
    store.close()
