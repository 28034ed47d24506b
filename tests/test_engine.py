"""bso.storage.sql.engine: engines, the migrations, and the check of the schema."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.config import main as alembic_main
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from psycopg import sql
from sqlalchemy import Engine, event, inspect, text

from bso.apikeys import DEFAULT_TENANT
from bso.spec import JobSpec
from bso.storage.base import StoredReply
from bso.storage.schema import SCHEMA_REVISION, metadata
from bso.storage.sql import SqlStore
from bso.storage.sql.engine import (
    MIGRATIONS_DIR,
    NoSqliteFileError,
    SchemaNotCurrentError,
    SchemaTooNewError,
    alembic_config,
    known_revisions,
    make_engine,
    upgrade,
)
from tests.fixtures.postgres import DatabaseFactory, PostgresServer

T0 = datetime(2026, 3, 1, 8, 30, tzinfo=UTC)
SPEC = JobSpec(job_id="job", batch_sizes=[8, 16], default_batch_size=8, target_metric=1.0)

EmptyDatabase = Callable[[], str]


@pytest.fixture(
    params=[
        pytest.param("sqlite"),
        pytest.param("postgres", marks=pytest.mark.postgres),
        pytest.param("mariadb", marks=pytest.mark.mysql),
    ]
)
def empty_database(request: pytest.FixtureRequest, tmp_path: Path) -> EmptyDatabase:
    """``make()``: URL of a new database without any table."""
    if request.param == "sqlite":
        names = iter(range(1000))

        def empty_sqlite_file() -> str:
            path = tmp_path / f"bso-{next(names)}.db"
            path.touch()  # an empty file is an empty SQLite database
            return f"sqlite:///{path}"

        return empty_sqlite_file
    factory: DatabaseFactory = request.getfixturevalue(f"{request.param}_database_factory")
    return lambda: factory(migrated=False)


def test_store_refuses_a_database_without_tables(empty_database: EmptyDatabase) -> None:
    with pytest.raises(SchemaNotCurrentError, match=r"no bso tables.*upgrade\(url\)"):
        SqlStore(empty_database())


def test_a_store_on_a_sqlite_file_that_is_not_there_makes_no_file(tmp_path: Path) -> None:
    """A typo'd --database-url of bso status left an empty file at the typo's path."""
    missing = tmp_path / "typo.sqlite3"
    with pytest.raises(NoSqliteFileError, match=f"no SQLite database at {missing}"):
        SqlStore(f"sqlite:///{missing}")
    assert not missing.exists()


def migrated_then_marked(url: str, revision: str) -> None:
    """Migrate ``url``, then mark it at ``revision``: what the check reads."""
    upgrade(url)
    engine = make_engine(url)
    with engine.begin() as connection:
        connection.execute(text("UPDATE alembic_version SET version_num = :r"), {"r": revision})
    engine.dispose()


def test_store_refuses_a_database_an_older_bso_migrated(empty_database: EmptyDatabase) -> None:
    """One migration behind: ``bso migrate`` is the fix, and the message says so."""
    url = empty_database()
    previous = ScriptDirectory.from_config(alembic_config()).get_revision(SCHEMA_REVISION)
    assert isinstance(previous.down_revision, str)
    migrated_then_marked(url, previous.down_revision)
    with pytest.raises(SchemaNotCurrentError) as refused:
        SqlStore(url)
    assert not isinstance(refused.value, SchemaTooNewError)
    assert f"found {previous.down_revision}, need {SCHEMA_REVISION}" in str(refused.value)
    assert "apply the migrations" in str(refused.value)


def test_a_database_at_a_revision_of_a_newer_bso_is_named_so(
    empty_database: EmptyDatabase,
) -> None:
    """Neither the store nor an upgrade sends an operator back to ``bso migrate`` for a
    database a newer bso migrated: it would fail on the revision it does not know."""
    url = empty_database()
    migrated_then_marked(url, "9999")
    with pytest.raises(SchemaTooNewError, match=r"found 9999, need .*a newer bso migrated it"):
        SqlStore(url)
    with pytest.raises(SchemaTooNewError, match="never downgrades a database"):
        upgrade(url)


def test_the_revisions_read_from_file_names_are_alembics() -> None:
    script = ScriptDirectory.from_config(alembic_config())
    assert known_revisions() == {r.revision for r in script.walk_revisions()}
    assert SCHEMA_REVISION in known_revisions()


def test_the_revision_the_store_requires_is_the_migrations_head() -> None:
    heads = ScriptDirectory.from_config(alembic_config()).get_heads()
    assert heads == [SCHEMA_REVISION]


def test_opening_a_store_does_not_import_alembic(tmp_path: Path) -> None:
    """Workers open stores; only migrations need Alembic, which is slow to import."""
    url = f"sqlite:///{tmp_path / 'bso.db'}"
    upgrade(url)
    probe = (
        "import sys; from bso.storage.sql import SqlStore; "
        f"SqlStore({url!r}).close(); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'alembic'))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"


def test_upgrade_is_idempotent_and_matches_the_metadata(
    empty_database: EmptyDatabase, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The migrations are found next to the module, not in the working directory.
    monkeypatch.chdir(tmp_path)
    url = empty_database()
    upgrade(url)
    upgrade(url)
    engine = make_engine(url)
    with engine.connect() as connection:
        context = MigrationContext.configure(connection, opts={"compare_type": True})
        assert context.get_current_heads() == (SCHEMA_REVISION,)
        assert compare_metadata(context, metadata) == []
        assert set(inspect(connection).get_table_names()) == {
            "alembic_version",
            "jobs",
            "lanes",
            "trials",
            "replies",
            "api_keys",
            "tenant_limits",
            "retired_jobs",
        }
    engine.dispose()
    SqlStore(url).close()


@pytest.mark.mysql
def test_mysql_releases_the_migration_lock_only_once_the_revision_is_committed(
    mariadb_database_factory: DatabaseFactory,
) -> None:
    """Released before the commit, the lock let a waiting upgrade read the revision
    before the last and run the last migration again ("Table 'retired_jobs' already
    exists", seen with four upgrades at once under load)."""
    url = mariadb_database_factory(migrated=False)
    seen_at_release: list[set[str]] = []

    def look_at_release(_conn: Any, _cursor: Any, statement: str, *_rest: Any) -> None:
        if "RELEASE_LOCK" in statement:
            other = make_engine(url)
            with other.connect() as connection:
                versions = connection.execute(text("SELECT version_num FROM alembic_version"))
                seen_at_release.append(set(versions.scalars()))
            other.dispose()

    event.listen(Engine, "before_cursor_execute", look_at_release)
    try:
        upgrade(url)
    finally:
        event.remove(Engine, "before_cursor_execute", look_at_release)
    assert seen_at_release == [{SCHEMA_REVISION}]


def test_concurrent_upgrades_apply_the_migrations_once(empty_database: EmptyDatabase) -> None:
    url = empty_database()
    errors: list[BaseException] = []
    barrier = threading.Barrier(4)

    def run() -> None:
        barrier.wait()
        try:
            upgrade(url)
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    SqlStore(url).close()


def test_alembic_command_line_upgrades_and_prints_sql(
    empty_database: EmptyDatabase, capsys: pytest.CaptureFixture[str]
) -> None:
    url = empty_database()
    ini = str(MIGRATIONS_DIR / "alembic.ini")
    alembic_main(["-c", ini, "-x", f"url={url}", "upgrade", "head", "--sql"])
    assert "CREATE TABLE trials" in capsys.readouterr().out
    with pytest.raises(SchemaNotCurrentError):
        SqlStore(url)  # --sql only printed the DDL
    alembic_main(["-c", ini, "-x", f"url={url}", "upgrade", "head"])
    SqlStore(url).close()


def test_in_memory_sqlite_is_refused() -> None:
    with pytest.raises(ValueError, match="in-memory"):
        make_engine("sqlite://")


def test_plain_postgresql_urls_use_psycopg_3() -> None:
    engine = make_engine("postgresql://bso@db.invalid/bso")
    assert engine.url.drivername == "postgresql+psycopg"
    engine.dispose()


@pytest.mark.postgres
def test_postgres_connections_the_server_ended_are_replaced_unnoticed(
    fresh_postgres_url: str, postgres_server: PostgresServer
) -> None:
    """A PostgreSQL restart or failover ends every pooled connection: the next event
    must not be the one to find out (the soak's db_drop fault)."""
    store = SqlStore(fresh_postgres_url)
    with store.transaction("job") as tx:
        tx.create_job(SPEC, T0)
    with store.engine.connect() as connection:
        pooled = connection.execute(text("SELECT pg_backend_pid()")).scalar_one()
    postgres_server.admin(sql.SQL("SELECT pg_terminate_backend({})").format(sql.Literal(pooled)))
    with store.transaction("job") as tx:
        assert tx.get_job() is not None
    store.close()


def test_0002_gives_existing_rows_the_default_tenant_and_per_job_event_ids(
    empty_database: EmptyDatabase,
) -> None:
    """A database of revision 0001 with data keeps it: its jobs and replies belong to
    the default tenant, and event ids become per job (the same id may recur in another)."""
    from alembic import command

    url = empty_database()
    engine = make_engine(url)
    with engine.begin() as connection:
        config = alembic_config()
        config.attributes["connection"] = connection
        command.upgrade(config, "0001")
        connection.execute(
            text(
                "INSERT INTO jobs (job_id, spec, created_at, next_trial_number) "
                "VALUES ('old-job', :spec, :at, 1)"
            ),
            {"spec": SPEC.model_copy(update={"job_id": "old-job"}).model_dump_json(), "at": T0},
        )
        connection.execute(
            text(
                "INSERT INTO replies (event_id, job_id, reply, created_at) "
                "VALUES ('e1', 'old-job', '{}', :at)"
            ),
            {"at": T0},
        )
    engine.dispose()
    upgrade(url)
    store = SqlStore(url)
    try:
        with store.transaction("old-job") as tx:
            job = tx.get_job()
            assert job is not None
            assert job.owner == DEFAULT_TENANT
            assert tx.recorded_reply("e1") == StoredReply("{}", None, DEFAULT_TENANT)
        with store.transaction("new-job") as tx:
            tx.create_job(SPEC.model_copy(update={"job_id": "new-job"}), T0, owner="team-a")
            tx.record_reply("e1", StoredReply("{}", "ab" * 32, "team-a"), T0)
    finally:
        store.close()


def test_trials_recorded_before_revision_0005_read_back_as_not_detached(
    empty_database: EmptyDatabase,
) -> None:
    from alembic import command

    from bso.storage.sql.engine import alembic_config

    url = empty_database()
    engine = make_engine(url)
    try:
        with engine.begin() as connection:
            config = alembic_config()
            config.attributes["connection"] = connection
            command.upgrade(config, "0004")
            connection.execute(
                text(
                    "INSERT INTO jobs (job_id, spec, created_at, next_trial_number, owner) "
                    "VALUES ('job', :spec, :at, 2, :owner)"
                ),
                {
                    "spec": SPEC.model_dump_json(),
                    "at": "2026-03-01 08:30:00.000000",
                    "owner": DEFAULT_TENANT,
                },
            )
            connection.execute(
                text(
                    "INSERT INTO trials (job_id, trial_number, hardware_key, batch_size, phase, "
                    "status, epochs, time_s, energy_j, cost, created_at, updated_at) VALUES "
                    "('job', 1, 'cpu x1', 8, 'exploration', 'converged', 2, 1.0, 1.0, 1.0, "
                    ":at, :at)"
                ),
                {"at": "2026-03-01 08:30:00.000000"},
            )
    finally:
        engine.dispose()
    upgrade(url)
    store = SqlStore(url)
    try:
        with store.read("job") as tx:
            (trial,) = tx.trials()
        assert not trial.detached
    finally:
        store.close()


def test_0009_moves_other_tenants_jobs_under_their_keys(empty_database: EmptyDatabase) -> None:
    """A database of revision 0008 keeps every job: the default tenant's where it was,
    team-a's under ``team-a/<id>`` with its lanes, trials and replies, and a deleted
    job's replies with their tenant.  Then another tenant may use the same job id."""
    from alembic import command

    from bso.service import BsoService
    from bso.wire.events import JobRegistered, RegisterJob

    url = empty_database()
    engine = make_engine(url)
    at = "2026-03-01 08:30:00.000000"
    try:
        with engine.begin() as connection:
            config = alembic_config()
            config.attributes["connection"] = connection
            command.upgrade(config, "0008")
            for job_id, owner in (("shared", DEFAULT_TENANT), ("nightly", "team-a")):
                connection.execute(
                    text(
                        "INSERT INTO jobs (job_id, spec, created_at, next_trial_number, owner) "
                        "VALUES (:job, :spec, :at, 2, :owner)"
                    ),
                    {
                        "job": job_id,
                        "spec": SPEC.model_copy(update={"job_id": job_id}).model_dump_json(),
                        "at": at,
                        "owner": owner,
                    },
                )
                connection.execute(
                    text(
                        "INSERT INTO lanes (job_id, hardware_key, hardware) VALUES "
                        "(:job, :key, :hardware)"
                    ),
                    {
                        "job": job_id,
                        "key": SPEC.hardware.key,
                        "hardware": SPEC.hardware.model_dump_json(),
                    },
                )
                connection.execute(
                    text(
                        "INSERT INTO trials (job_id, trial_number, hardware_key, batch_size, "
                        "phase, status, epochs, time_s, energy_j, cost, created_at, updated_at) "
                        "VALUES (:job, 1, :key, 8, 'exploration', 'converged', 2, 1.0, 1.0, "
                        "1.0, :at, :at)"
                    ),
                    {"job": job_id, "key": SPEC.hardware.key, "at": at},
                )
            for job_id, owner in (("nightly", "team-a"), ("gone", "team-b")):
                connection.execute(
                    text(
                        "INSERT INTO replies (event_id, job_id, reply, created_at, owner) "
                        "VALUES ('e1', :job, '{}', :at, :owner)"
                    ),
                    {"job": job_id, "at": at, "owner": owner},
                )
    finally:
        engine.dispose()
    upgrade(url)
    store = SqlStore(url)
    try:
        assert store.job_ids() == ["shared", "team-a/nightly"]
        with store.transaction("team-a/nightly") as tx:
            job = tx.get_job()
            assert job is not None
            assert job.owner == "team-a"
            assert [t.trial_number for t in tx.trials()] == [1]
            assert tx.get_lane(SPEC.hardware.key) is not None
            assert tx.recorded_reply("e1") == StoredReply("{}", None, "team-a")
        with store.transaction("team-b/gone") as tx:
            assert tx.recorded_reply("e1") == StoredReply("{}", None, "team-b")
        service = BsoService(store)
        assert service.status("nightly", "team-a").lanes[0].trials == 1
        assert service.status("shared").lanes[0].trials == 1
        assert [j.job_id for j in service.list_jobs("team-a")] == ["nightly"]
        mine = service.handle(RegisterJob(spec=SPEC.model_copy(update={"job_id": "nightly"})))
        assert isinstance(mine, JobRegistered)
        assert mine.created
    finally:
        store.close()
    upgrade(url)  # a second upgrade finds nothing left to move
    store = SqlStore(url)
    try:
        assert store.job_ids() == ["nightly", "shared", "team-a/nightly"]
    finally:
        store.close()
