"""Tables of the SQL store, as SQLAlchemy Core metadata.

This metadata is the reference the migrations are checked against (a test
runs Alembic's ``compare_metadata`` on a migrated database); tables are only
ever created by the migrations in ``bso/storage/migrations``, so any change here
must come with a new migration, and :data:`SCHEMA_REVISION` set to its revision.

JSON documents (specs, hardware, RNG states, replies) are stored as TEXT rather
than a JSON column type: the RNG state holds 128-bit integers that JSON column
types of some databases would round to floats, and TEXT behaves the same on
SQLite and PostgreSQL.  Enums are stored as their string values so that adding
a member needs no ``ALTER TYPE``.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    Boolean,
    Column,
    DateTime,
    Dialect,
    Double,
    ForeignKeyConstraint,
    Index,
    Integer,
    MetaData,
    PrimaryKeyConstraint,
    String,
    Table,
    Text,
    TypeDecorator,
    false,
)
from sqlalchemy.types import TypeEngine

SCHEMA_REVISION = "0011"
"""The Alembic revision whose migrations create exactly these tables.

:class:`~bso.storage.sql.SqlStore` compares the database's ``alembic_version``
with it instead of loading Alembic's script directory, which would import
Alembic into every worker; a test keeps it equal to the migrations' head.
"""
VERSION_TABLE = "alembic_version"
"""Where Alembic (with its defaults, as in migrations/env.py) records the revision."""

# Upper bounds from the models: job ids and event ids are at most 128 characters,
# hardware keys are a GPU model (at most 128) plus " x<count>" and, for a
# data-parallel run, " dp<devices>" (at most 141 characters in all).
JOB_ID_LENGTH = 128
EVENT_ID_LENGTH = 128
TENANT_LENGTH = 64
"""bso.apikeys.TENANT_PATTERN allows at most 64 characters."""
JOB_KEY_LENGTH = TENANT_LENGTH + 1 + JOB_ID_LENGTH
"""A job's key in the store: ``<tenant>/<job id>`` (:func:`bso.apikeys.job_key`)."""
JOB_KEY = String(JOB_KEY_LENGTH).with_variant(String(JOB_ID_LENGTH), "sqlite")
"""The type of every ``job_id`` column.  SQLite checks no length, so revision 0009
widens the column everywhere but there: rebuilding SQLite's four tables, one of them
the parent of two foreign keys, would risk the data for a declaration SQLite ignores."""
HARDWARE_KEY_LENGTH = 160
ENUM_LENGTH = 32
SHA256_HEX_LENGTH = 64
_NAIVE_MICROSECOND_DIALECTS = frozenset({"mysql", "mariadb"})
"""Dialects whose timestamps are DATETIME(6): no time zone, microseconds."""

# Explicit constraint names make the migrations reproducible on every backend.
NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class UtcDateTime(TypeDecorator[datetime]):
    """Timestamps stored in UTC and always read back timezone-aware.

    PostgreSQL keeps the instant in ``timestamp with time zone``; SQLite has no
    timezone support, so the UTC wall time is stored naive (its fixed-width text
    form then sorts chronologically) and UTC is attached again on the way out.
    Naive input is refused because its meaning would depend on the host.
    MySQL's DATETIME is naive too, and keeps microseconds only when declared
    with them (revision 0006).
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def load_dialect_impl(self, dialect: Dialect) -> TypeEngine[Any]:
        if dialect.name in _NAIVE_MICROSECOND_DIALECTS:
            # Imported here: only a MySQL engine needs it, and it has loaded it already.
            from sqlalchemy.dialects import mysql

            return dialect.type_descriptor(mysql.DATETIME(fsp=6))
        return dialect.type_descriptor(self.impl)

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value!r}: the store needs timezone-aware times")
        value = value.astimezone(UTC)
        naive = dialect.name == "sqlite" or dialect.name in _NAIVE_MICROSECOND_DIALECTS
        return value.replace(tzinfo=None) if naive else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


metadata = MetaData(naming_convention=NAMING_CONVENTION)

jobs = Table(
    "jobs",
    metadata,
    Column("job_id", JOB_KEY, nullable=False),
    # NULL only in the placeholder row a transaction inserts to lock a job id that
    # is not registered yet; placeholders are removed before commit, never seen.
    Column("spec", Text, nullable=True),
    Column("created_at", UtcDateTime, nullable=False),
    Column("next_trial_number", Integer, nullable=False),
    # The tenant whose API key registered the job (bso.apikeys); jobs from before
    # revision 0002 belong to the default tenant.
    Column("owner", String(TENANT_LENGTH), nullable=False, server_default="default"),
    PrimaryKeyConstraint("job_id"),
)

lanes = Table(
    "lanes",
    metadata,
    Column("job_id", JOB_KEY, nullable=False),
    Column("hardware_key", String(HARDWARE_KEY_LENGTH), nullable=False),
    Column("hardware", Text, nullable=False),
    Column("rng_state", Text, nullable=True),
    # Out-of-memory trials numbered up to this are forgotten (revision 0003; NULL: 0).
    Column("memory_reprobed_through", Integer, nullable=True),
    # The lane's own batch plan as JSON (revision 0004); NULL: the job spec's.
    Column("plan", Text, nullable=True),
    PrimaryKeyConstraint("job_id", "hardware_key"),
    ForeignKeyConstraint(["job_id"], ["jobs.job_id"]),
)

trials = Table(
    "trials",
    metadata,
    Column("job_id", JOB_KEY, nullable=False),
    Column("trial_number", Integer, nullable=False),
    Column("hardware_key", String(HARDWARE_KEY_LENGTH), nullable=False),
    Column("batch_size", Integer, nullable=False),
    Column("phase", String(ENUM_LENGTH), nullable=False),
    Column("status", String(ENUM_LENGTH), nullable=False),
    Column("epochs", Integer, nullable=False),
    Column("time_s", Double, nullable=False),
    Column("energy_j", Double, nullable=False),
    Column("cost", Double, nullable=False),
    Column("last_metric", Double, nullable=True),
    Column("stop_reason", String(ENUM_LENGTH), nullable=True),
    Column("created_at", UtcDateTime, nullable=False),
    Column("updated_at", UtcDateTime, nullable=False),
    # Seconds the caller may stay silent (revision 0003); NULL: the service default.
    Column("lease_s", Double, nullable=True),
    # The batch size of the latest epoch under online growth (revision 0004).
    Column("current_batch_size", Integer, nullable=True),
    # A run delivered from the client's journal after an outage (revision 0005).
    Column("detached", Boolean, nullable=False, server_default=false()),
    # The run's micro-batch exploration, as JSON (revision 0007); NULL: none.
    Column("micro_batches", Text, nullable=True),
    # The primary key doubles as the uniqueness guard on trial numbers, which come
    # from jobs.next_trial_number under the job's lock.
    PrimaryKeyConstraint("job_id", "trial_number"),
    ForeignKeyConstraint(["job_id"], ["jobs.job_id"]),
    # The heartbeat janitor scans running trials by last event time.
    Index(None, "status", "updated_at"),
)

replies = Table(
    "replies",
    metadata,
    Column("event_id", String(EVENT_ID_LENGTH), nullable=False),
    # No foreign key: replies outlive their job so that a redelivered delete event
    # gets the same reply.
    Column("job_id", JOB_KEY, nullable=False),
    Column("reply", Text, nullable=False),
    Column("created_at", UtcDateTime, nullable=False),
    # SHA-256 of the event's body: the same id with another body is refused.
    # NULL in rows recorded before revision 0002.
    Column("body_sha256", String(SHA256_HEX_LENGTH), nullable=True),
    Column("owner", String(TENANT_LENGTH), nullable=False, server_default="default"),
    # Event ids are unique per job: the same id in another job is another event.
    PrimaryKeyConstraint("job_id", "event_id"),
    # prune_replies deletes (deleted jobs' replies) by age.
    Index(None, "created_at"),
)

api_keys = Table(
    "api_keys",
    metadata,
    Column("key_id", String(16), nullable=False),
    Column("tenant", String(TENANT_LENGTH), nullable=False),
    # Only a hash of the secret: bso.apikeys explains why SHA-256 suffices.
    Column("secret_sha256", String(SHA256_HEX_LENGTH), nullable=False),
    Column("created_at", UtcDateTime, nullable=False),
    Column("revoked_at", UtcDateTime, nullable=True),
    PrimaryKeyConstraint("key_id"),
)

retired_jobs = Table(
    "retired_jobs",
    metadata,
    # A deleted job's next trial number: the job registered again under its id numbers
    # on from there, so a run of the deleted job that still trains (or its journal)
    # names no trial of the new one.
    Column("job_id", JOB_KEY, nullable=False),
    Column("next_trial_number", Integer, nullable=False),
    PrimaryKeyConstraint("job_id"),
)

tenant_limits = Table(
    "tenant_limits",
    metadata,
    # A tenant without a row has the defaults (bso.apikeys.TenantLimits()).
    Column("tenant", String(TENANT_LENGTH), nullable=False),
    Column("max_queue", Integer, nullable=False),
    Column("per_second", Integer, nullable=False),
    PrimaryKeyConstraint("tenant"),
)
