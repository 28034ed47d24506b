"""MySQL/MariaDB as bso's store: what InnoDB does differently from SQLite and PostgreSQL.

The store contract (tests/test_storage_contract.py), the real-process race test
(tests/test_storage_concurrency.py) and the migration tests (tests/test_engine.py)
run on MariaDB too; these tests cover what only MySQL needs: its locking's
deadlock retry, its URLs, its collations and timestamps, a database that an
earlier bso migrated, and connections the server closes.
"""

from __future__ import annotations

import multiprocessing
import threading
from collections.abc import Mapping
from datetime import UTC, datetime
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Barrier
from typing import Any

import pytest
from sqlalchemy import event, text
from sqlalchemy.engine import make_url
from sqlalchemy.pool import ConnectionPoolEntry, PoolProxiedConnection

from bso.apikeys import TenantLimits
from bso.cli import main
from bso.spec import JobSpec
from bso.storage.schema import SCHEMA_REVISION
from bso.storage.sql import SqlStore
from bso.storage.sql.engine import alembic_config, make_engine, upgrade
from bso.storage.sql.session import DbapiSession
from tests.fixtures.mariadb import MariadbServer
from tests.fixtures.postgres import DatabaseFactory

T0 = datetime(2026, 3, 1, 8, 30, 15, 654321, tzinfo=UTC)


def spec(job_id: str) -> JobSpec:
    return JobSpec(job_id=job_id, batch_sizes=[8, 16], default_batch_size=8, target_metric=1.0)


# -- without a server ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "driver"),
    [
        ("mysql://bso:pw@db.invalid/bso", "mysql+pymysql"),
        ("mariadb://bso:pw@db.invalid/bso", "mariadb+pymysql"),
        ("mysql+pymysql://bso:pw@db.invalid/bso", "mysql+pymysql"),
    ],
)
def test_mysql_urls_use_pymysql_and_utf8mb4(given: str, driver: str) -> None:
    engine = make_engine(given)
    assert engine.url.drivername == driver
    assert engine.url.query["charset"] == "utf8mb4"
    engine.dispose()


def test_a_charset_the_url_names_is_kept() -> None:
    engine = make_engine("mysql://bso@db.invalid/bso?charset=utf8mb3")
    assert engine.url.query["charset"] == "utf8mb3"
    engine.dispose()


# -- on the machine's MariaDB ------------------------------------------------------------


@pytest.mark.mysql
def test_a_registration_that_deadlocks_is_tried_again(
    fresh_mariadb_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A deadlock made on purpose: two registrations of one new job at REPEATABLE
    READ (not bso's level) each take a gap lock with their locking read, then each
    inserts the placeholder into the other's gap.  InnoDB rolls one back; bso
    takes its lock again, and the job is created once with no error."""
    store = SqlStore(fresh_mariadb_url)
    _at_repeatable_read(store)
    both_have_read = threading.Barrier(2)
    waited = threading.local()
    original_one = DbapiSession.one

    def one_then_meet(self: DbapiSession, statement: str, params: Mapping[str, Any]) -> Any:
        row = original_one(self, statement, params)
        if "FOR UPDATE" in statement and not getattr(waited, "done", False):
            waited.done = True  # only each thread's first locking read
            both_have_read.wait(30)
        return row

    monkeypatch.setattr(DbapiSession, "one", one_then_meet)
    created: list[str] = []
    errors: list[BaseException] = []

    def register() -> None:
        try:
            with store.transaction("job") as tx:
                if tx.get_job() is None:
                    tx.create_job(spec("job"), T0)
                    created.append(threading.current_thread().name)
        except BaseException as error:  # the assertion below shows it
            errors.append(error)

    deadlocks_before = _deadlocks(store)
    threads = [threading.Thread(target=register, name=f"register-{n}") for n in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []
    assert len(created) == 1
    assert _deadlocks(store) == deadlocks_before + 1
    assert store.job_ids() == ["job"]
    store.close()


@pytest.mark.mysql
def test_registrations_racing_at_repeatable_read_all_complete(fresh_mariadb_url: str) -> None:
    """Processes open, register or abandon the same new job ids at once, their
    sessions at REPEATABLE READ, where InnoDB's gap locks make some deadlock (how
    many varies from run to run; the test above makes one for certain): every unit
    of work completes and each job is created once."""
    store = SqlStore(fresh_mariadb_url)
    # Forks of a fresh server process, not of this long-lived test process: the test
    # is about InnoDB's locking, and a fork inherits whatever earlier tests left
    # (in a full run such forks hung before their first statement).
    context = multiprocessing.get_context("forkserver")
    barrier = context.Barrier(PROCESSES)
    results: Queue[tuple[list[str], list[str]]] = context.Queue()
    processes = [
        context.Process(target=_register, args=(fresh_mariadb_url, index, barrier, results))
        for index in range(PROCESSES)
    ]
    for process in processes:
        process.start()
    outcomes = [results.get(timeout=120) for _ in processes]
    for process in processes:
        process.join(10)
    assert [errors for _, errors in outcomes] == [[]] * PROCESSES
    created = sorted(job_id for made, _ in outcomes for job_id in made)
    assert created == ["job-0", "job-1", "job-2", "job-3", "job-4"]
    assert store.job_ids() == created
    store.close()


PROCESSES = 6
ROUNDS = 150
SAME_JOB_ROUNDS = 30
"""Consecutive rounds on one job id: most abandon it (its placeholder is deleted),
one in 25 registers it."""


def _register(
    url: str, index: int, barrier: Barrier, results: Queue[tuple[list[str], list[str]]]
) -> None:
    store = SqlStore(url)
    _at_repeatable_read(store)
    created: list[str] = []
    errors: list[str] = []
    barrier.wait(60)
    for round_ in range(ROUNDS):
        job_id = f"job-{round_ // SAME_JOB_ROUNDS}"
        try:
            with store.transaction(job_id) as tx:
                if tx.get_job() is None and (index + round_) % 25 == 0:
                    tx.create_job(spec(job_id), T0)
                    created.append(job_id)
        except Exception as error:
            errors.append(repr(error))
    store.close()
    results.put((created, errors))


def _at_repeatable_read(store: SqlStore) -> None:
    """Every connection the store checks out runs at REPEATABLE READ, InnoDB's default."""

    @event.listens_for(store.engine, "checkout")
    def _repeatable_read(
        dbapi_connection: Any, _record: ConnectionPoolEntry, _proxy: PoolProxiedConnection
    ) -> None:
        cursor = dbapi_connection.cursor()
        cursor.execute("SET SESSION TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        cursor.close()


def _deadlocks(store: SqlStore) -> int:
    """InnoDB's count of deadlocks since the server started (all its databases)."""
    with store.engine.connect() as connection:
        row = connection.execute(text("SHOW GLOBAL STATUS LIKE 'Innodb_deadlocks'")).one()
    return int(row[1])


@pytest.mark.mysql
def test_job_ids_differ_by_case_and_times_keep_their_microseconds(fresh_mariadb_url: str) -> None:
    """Most servers' default collation ignores case; SQLite and PostgreSQL do not."""
    store = SqlStore(fresh_mariadb_url)
    for job_id in ("Job-A", "job-a"):
        with store.transaction(job_id) as tx:
            assert tx.get_job() is None
            tx.create_job(spec(job_id), T0)
    assert store.job_ids() == ["Job-A", "job-a"]
    with store.read("job-a") as reader:
        job = reader.get_job()
    assert job is not None
    assert job.created_at == T0
    store.close()


@pytest.mark.mysql
def test_tenants_that_differ_by_case_keep_their_own_limits(fresh_mariadb_url: str) -> None:
    """Revision 0008 left tenant_limits with the server's collation: setting Team-B's
    limits deleted team-b's, which fell back to the defaults (0010 makes it exact)."""
    store = SqlStore(fresh_mariadb_url)
    store.set_tenant_limits("team-b", TenantLimits(5, 1))
    store.set_tenant_limits("Team-B", TenantLimits(900, 900))
    assert store.tenant_limits() == {
        "Team-B": TenantLimits(900, 900),
        "team-b": TenantLimits(5, 1),
    }
    store.set_tenant_limits("Team-B", None)
    assert store.tenant_limits() == {"team-b": TenantLimits(5, 1)}
    store.close()


@pytest.mark.mysql
def test_a_database_an_earlier_bso_migrated_is_made_exact(
    mariadb_database_factory: DatabaseFactory,
) -> None:
    """``bso migrate`` accepted MySQL before the store did: such a database has the
    server's collation and whole-second DATETIMEs until revision 0006."""
    from alembic import command

    url = mariadb_database_factory(migrated=False)
    engine = make_engine(url)
    with engine.begin() as connection:
        config = alembic_config()
        config.attributes["connection"] = connection
        command.upgrade(config, "0005")
    assert _column(engine, "jobs", "created_at") == ("datetime", "utf8mb4_general_ci")
    upgrade(url)
    assert _column(engine, "jobs", "created_at") == ("datetime(6)", "utf8mb4_bin")
    assert _column(engine, "trials", "job_id")[1] == "utf8mb4_bin"
    engine.dispose()
    store = SqlStore(url)
    with store.transaction("Job-A") as tx:
        tx.create_job(spec("Job-A"), T0)
    with store.transaction("job-a") as tx:
        assert tx.get_job() is None
    with store.read("Job-A") as reader:
        job = reader.get_job()
    assert job is not None
    assert job.created_at == T0
    store.close()


def _column(engine: object, table: str, column: str) -> tuple[str, str]:
    """The column's type, and its table's collation."""
    with engine.connect() as connection:  # type: ignore[attr-defined]
        column_type = connection.execute(
            text(
                "SELECT column_type FROM information_schema.columns WHERE "
                "table_schema = DATABASE() AND table_name = :t AND column_name = :c"
            ),
            {"t": table, "c": column},
        ).scalar_one()
        collation = connection.execute(
            text(
                "SELECT table_collation FROM information_schema.tables WHERE "
                "table_schema = DATABASE() AND table_name = :t"
            ),
            {"t": table},
        ).scalar_one()
    return column_type, collation


@pytest.mark.mysql
def test_bso_migrate_prepares_a_mariadb_database_the_store_opens(
    mariadb_database_factory: DatabaseFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    given = make_url(mariadb_database_factory(migrated=False)).set(drivername="mysql")
    url = given.render_as_string(hide_password=False)  # plain mysql://, as users write it
    assert main(["migrate", "--database-url", url]) == 0
    assert capsys.readouterr().out == f"database at the latest schema: {url}\n"
    store = SqlStore(url)
    with store.engine.connect() as connection:
        version = connection.execute(text("SELECT version_num FROM alembic_version")).scalar()
    assert version == SCHEMA_REVISION
    store.close()


@pytest.mark.mysql
def test_connections_the_server_closed_are_replaced_unnoticed(
    fresh_mariadb_url: str, mariadb_server: MariadbServer
) -> None:
    """MySQL closes connections idle past ``wait_timeout``: the pool must not hand
    one out to the next event after a quiet night."""
    store = SqlStore(fresh_mariadb_url)
    with store.transaction("job") as tx:
        tx.create_job(spec("job"), T0)
    with store.engine.connect() as connection:
        pooled = connection.execute(text("SELECT CONNECTION_ID()")).scalar_one()
    mariadb_server.admin(f"KILL CONNECTION {int(pooled)}")
    with store.transaction("job") as tx:
        assert tx.get_job() is not None
    store.close()
