"""The SQL of the store's units of work, rendered once per dialect, and its rows.

The units of work (:mod:`bso.storage.sql.store`) run these statements as plain
strings on the DBAPI connection (:mod:`bso.storage.sql.session`): SQLAlchemy's
execution machinery costs several times what SQLite needs to run one of them,
and every worker pays it on every event.  So the Core expressions here are
compiled once per process, for the one dialect in use, with named parameters.
Rows come back as plain tuples, in the column order of the SELECTs below.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from functools import cache, lru_cache
from typing import Any, cast

from sqlalchemy import Dialect, Table, bindparam, delete, insert, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.dialects.postgresql import psycopg as postgresql_psycopg
from sqlalchemy.sql import ClauseElement

from bso.core.micro_batch import Timings
from bso.core.vocabulary import StopReason, TrialPhase, TrialStatus
from bso.spec import Hardware, JobSpec
from bso.storage.base import TrialRecord
from bso.storage.schema import UtcDateTime, api_keys, jobs, lanes, replies, retired_jobs, trials
from bso.storage.sql.engine import MYSQL_DIALECTS

# Distinct specs and hardware documents whose parsed models are kept: every event
# reads the job's spec, and validating it again costs more than the whole query.
_PARSED_CACHE_SIZE = 4096
# Trial rows whose records are kept (a few hundred bytes each): every event reads
# all trials of a hardware key, nearly all of them unchanged since the last event.
_TRIAL_CACHE_SIZE = 16384

# Trial columns in the order the SELECTs return them and trial_from_row unpacks them.
_TRIAL_COLUMNS = [
    trials.c[name]
    for name in (
        "trial_number",
        "hardware_key",
        "batch_size",
        "phase",
        "status",
        "epochs",
        "time_s",
        "energy_j",
        "cost",
        "last_metric",
        "stop_reason",
        "created_at",
        "updated_at",
        "lease_s",
        "current_batch_size",
        "detached",
        "micro_batches",
    )
]
# Parameter names in WHERE clauses carry a ``w_`` prefix: SET and VALUES take the
# column names.
_OF_JOB = jobs.c.job_id == bindparam("w_job_id")
_OF_TRIAL = (trials.c.job_id == bindparam("w_job_id")) & (
    trials.c.trial_number == bindparam("w_trial_number")
)
_SELECT_TRIALS = (
    select(*_TRIAL_COLUMNS)
    .where(trials.c.job_id == bindparam("w_job_id"))
    .order_by(trials.c.trial_number)
)
SELECT_JOB = select(jobs.c.spec, jobs.c.created_at, jobs.c.next_trial_number, jobs.c.owner).where(
    _OF_JOB
)
"""The job row a unit of work reads first: what the locking strategies lock."""

# Timestamps go through UtcDateTime's own conversions (see statements_for), so the
# raw statements store exactly what the Core statements of the maintenance scans
# compare against.
Encode = Callable[[datetime], Any]
Decode = Callable[[Any], datetime]


def _set(*columns: str) -> dict[str, Any]:
    return {name: bindparam(name) for name in columns}


@dataclass(frozen=True, slots=True)
class Statements:
    """The units of work's SQL for one dialect, all with named parameters."""

    read_job: str
    insert_job: str
    fill_job: str
    set_next_trial_number: str
    delete_trials: str
    delete_finished_trials: str
    delete_lanes: str
    delete_job: str
    select_retired: str
    delete_retired: str
    insert_retired: str
    select_trials: str
    select_trials_of_key: str
    select_trial: str
    insert_trial: str
    update_trial: str
    select_lane: str
    upsert_lane: str
    select_reply: str
    insert_reply: str
    select_api_key: str
    encode_time: Encode
    decode_time: Decode


@cache
def _dialect(dialect_name: str) -> Dialect:
    if dialect_name == "sqlite":
        return sqlite.dialect(paramstyle="named")
    if dialect_name == "postgresql":
        return postgresql_psycopg.dialect()  # type: ignore[no-untyped-call]
    if dialect_name in MYSQL_DIALECTS:
        # Imported here: only a MySQL store should pay its import (30 ms).
        from sqlalchemy.dialects.mysql import pymysql

        return pymysql.dialect(paramstyle="pyformat")  # named, like the others
    raise ValueError(
        f"the SQL store runs on SQLite, PostgreSQL or MySQL/MariaDB, not {dialect_name}"
    )


def render(statement: ClauseElement, dialect_name: str) -> str:
    """``statement`` as the driver of ``dialect_name`` takes it, with named parameters."""
    return str(statement.compile(dialect=_dialect(dialect_name)))


@cache
def statements_for(dialect_name: str) -> Statements:
    """Render the statements once per process, for the one dialect in use."""
    dialect = _dialect(dialect_name)

    def rendered(statement: ClauseElement) -> str:
        return render(statement, dialect_name)

    time_type = UtcDateTime().dialect_impl(dialect)
    return Statements(
        read_job=rendered(SELECT_JOB),
        insert_job=rendered(insert(jobs)),
        fill_job=rendered(
            update(jobs)
            .where(_OF_JOB)
            .values(_set("spec", "created_at", "next_trial_number", "owner"))
        ),
        set_next_trial_number=rendered(
            update(jobs).where(_OF_JOB).values(_set("next_trial_number"))
        ),
        delete_trials=rendered(delete(trials).where(trials.c.job_id == bindparam("w_job_id"))),
        delete_finished_trials=rendered(
            delete(trials).where(
                trials.c.job_id == bindparam("w_job_id"),
                trials.c.status != bindparam("w_running"),
            )
        ),
        delete_lanes=rendered(delete(lanes).where(lanes.c.job_id == bindparam("w_job_id"))),
        delete_job=rendered(delete(jobs).where(_OF_JOB)),
        select_retired=rendered(
            select(retired_jobs.c.next_trial_number).where(
                retired_jobs.c.job_id == bindparam("w_job_id")
            )
        ),
        delete_retired=rendered(
            delete(retired_jobs).where(retired_jobs.c.job_id == bindparam("w_job_id"))
        ),
        insert_retired=rendered(insert(retired_jobs)),
        select_trials=rendered(_SELECT_TRIALS),
        select_trials_of_key=rendered(
            _SELECT_TRIALS.where(trials.c.hardware_key == bindparam("w_hardware_key"))
        ),
        select_trial=rendered(select(*_TRIAL_COLUMNS).where(_OF_TRIAL)),
        insert_trial=rendered(insert(trials)),
        update_trial=rendered(
            update(trials).where(_OF_TRIAL).values(_set(*(c.name for c in _TRIAL_COLUMNS[1:])))
        ),
        select_lane=rendered(
            select(
                lanes.c.hardware, lanes.c.rng_state, lanes.c.memory_reprobed_through, lanes.c.plan
            ).where(
                lanes.c.job_id == bindparam("w_job_id"),
                lanes.c.hardware_key == bindparam("w_hardware_key"),
            )
        ),
        upsert_lane=rendered(_upsert_lane(dialect_name)),
        select_reply=rendered(
            select(replies.c.reply, replies.c.body_sha256, replies.c.owner).where(
                replies.c.job_id == bindparam("w_job_id"),
                replies.c.event_id == bindparam("w_event_id"),
            )
        ),
        insert_reply=rendered(insert(replies)),
        select_api_key=rendered(
            select(
                api_keys.c.key_id,
                api_keys.c.tenant,
                api_keys.c.secret_sha256,
                api_keys.c.created_at,
                api_keys.c.revoked_at,
            ).where(api_keys.c.key_id == bindparam("w_key_id"))
        ),
        # UtcDateTime converts both ways, so neither processor is None.
        encode_time=cast(Encode, time_type.bind_processor(dialect)),
        decode_time=cast(Decode, time_type.result_processor(dialect, None)),
    )


def _upsert_lane(dialect_name: str) -> ClauseElement:
    """Insert a lane, or overwrite its columns if it exists: ``ON CONFLICT DO UPDATE``
    on SQLite and PostgreSQL, ``ON DUPLICATE KEY UPDATE`` on MySQL."""
    columns = ("hardware", "rng_state", "memory_reprobed_through", "plan")
    if dialect_name in MYSQL_DIALECTS:
        from sqlalchemy.dialects import mysql

        insert_or_update = mysql.insert(lanes)
        return insert_or_update.on_duplicate_key_update(
            {name: insert_or_update.inserted[name] for name in columns}
        )
    dialect_insert: Callable[[Table], sqlite.Insert | postgresql.Insert] = (
        sqlite.insert if dialect_name == "sqlite" else postgresql.insert
    )
    upsert = dialect_insert(lanes)
    return upsert.on_conflict_do_update(
        index_elements=[lanes.c.job_id, lanes.c.hardware_key],
        set_={name: upsert.excluded[name] for name in columns},
    )


@lru_cache(maxsize=_PARSED_CACHE_SIZE)
def spec_from_json(document: str) -> JobSpec:
    """The stored spec, validated once per distinct text; JobSpec is frozen, so shared."""
    return JobSpec.model_validate_json(document)


@lru_cache(maxsize=_PARSED_CACHE_SIZE)
def hardware_from_json(document: str) -> Hardware:
    """The stored hardware, validated once per distinct text; Hardware is frozen."""
    return Hardware.model_validate_json(document)


@lru_cache(maxsize=_TRIAL_CACHE_SIZE)
def trial_from_row(job_id: str, row: tuple[Any, ...], decode_time: Decode) -> TrialRecord:
    """The record of a trial row (columns as in ``_TRIAL_COLUMNS``).

    Keyed by the row's whole content, so a cached record can never be stale:
    a changed row is a new key.  Records are frozen, so they are shared.
    """
    (
        number,
        key,
        size,
        phase,
        status,
        epochs,
        time_s,
        energy_j,
        cost,
        metric,
        reason,
        created_at,
        updated_at,
        lease_s,
        current_batch_size,
        detached,
        micro_batches,
    ) = row
    return TrialRecord(
        job_id=job_id,
        trial_number=number,
        hardware_key=key,
        batch_size=size,
        phase=TrialPhase(phase),
        created_at=decode_time(created_at),
        updated_at=decode_time(updated_at),
        status=TrialStatus(status),
        epochs=epochs,
        time_s=time_s,
        energy_j=energy_j,
        cost=cost,
        last_metric=metric,
        stop_reason=StopReason(reason) if reason is not None else None,
        lease_s=lease_s,
        current_batch_size=current_batch_size,
        detached=bool(detached),
        micro_batches=timings_from_json(micro_batches),
    )


def trial_values(trial: TrialRecord, encode_time: Encode) -> dict[str, Any]:
    """Every non-key column of ``trial``, as the driver takes it."""
    return {
        "hardware_key": trial.hardware_key,
        "batch_size": trial.batch_size,
        "phase": trial.phase.value,
        "status": trial.status.value,
        "epochs": trial.epochs,
        "time_s": trial.time_s,
        "energy_j": trial.energy_j,
        "cost": trial.cost,
        "last_metric": trial.last_metric,
        "stop_reason": trial.stop_reason.value if trial.stop_reason is not None else None,
        "created_at": encode_time(trial.created_at),
        "updated_at": encode_time(trial.updated_at),
        "lease_s": trial.lease_s,
        "current_batch_size": trial.current_batch_size,
        "detached": trial.detached,
        "micro_batches": timings_to_json(trial.micro_batches),
    }


def timings_to_json(timings: tuple[tuple[int, Timings], ...]) -> str | None:
    """A run's micro-batch timings as the column keeps them: ``{"16": [steps,
    mean, squares]}``; None for a run without an exploration."""
    if not timings:
        return None
    return json.dumps({str(m): [t.steps, t.mean, t.squares] for m, t in timings})


def timings_from_json(document: str | None) -> tuple[tuple[int, Timings], ...]:
    if document is None:
        return ()
    return tuple(
        (int(m), Timings(int(steps), float(mean), float(squares)))
        for m, (steps, mean, squares) in json.loads(document).items()
    )
