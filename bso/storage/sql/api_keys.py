"""Writing and listing API key records and tenants' limits in the SQL store
(:mod:`bso.apikeys`): both change rarely, so plain SQLAlchemy Core on a connection
the store opens is fast enough.  The lookup every event makes is a per-event statement
(:mod:`bso.storage.sql.statements`)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import Connection, delete, insert, select, update

from bso.apikeys import ApiKeyRecord, TenantLimits
from bso.storage.schema import api_keys, tenant_limits

_COLUMNS = (
    api_keys.c.key_id,
    api_keys.c.tenant,
    api_keys.c.secret_sha256,
    api_keys.c.created_at,
    api_keys.c.revoked_at,
)


def add_key(connection: Connection, record: ApiKeyRecord) -> None:
    connection.execute(
        insert(api_keys).values(
            key_id=record.key_id,
            tenant=record.tenant,
            secret_sha256=record.secret_sha256,
            created_at=record.created_at,
            revoked_at=record.revoked_at,
        )
    )


def all_keys(connection: Connection) -> list[ApiKeyRecord]:
    rows = connection.execute(select(*_COLUMNS).order_by(api_keys.c.created_at, api_keys.c.key_id))
    return [_record(row) for row in rows]


def revoke_key(connection: Connection, key_id: str, now: datetime) -> bool:
    result = connection.execute(
        update(api_keys)
        .where(api_keys.c.key_id == key_id, api_keys.c.revoked_at.is_(None))
        .values(revoked_at=now)
    )
    return bool(result.rowcount == 1)


def _record(row: Any) -> ApiKeyRecord:
    key_id, tenant, secret_sha256, created_at, revoked_at = row
    return ApiKeyRecord(key_id, tenant, secret_sha256, created_at, revoked_at)


def set_limits(connection: Connection, tenant: str, limits: TenantLimits | None) -> None:
    """Replace ``tenant``'s row (a delete, then an insert: the same on every dialect)."""
    connection.execute(delete(tenant_limits).where(tenant_limits.c.tenant == tenant))
    if limits is not None:
        connection.execute(
            insert(tenant_limits).values(
                tenant=tenant, max_queue=limits.max_queue, per_second=limits.per_second
            )
        )


def all_limits(connection: Connection) -> dict[str, TenantLimits]:
    rows = connection.execute(
        select(
            tenant_limits.c.tenant, tenant_limits.c.max_queue, tenant_limits.c.per_second
        ).order_by(tenant_limits.c.tenant)
    )
    return {tenant: TenantLimits(max_queue, per_second) for tenant, max_queue, per_second in rows}
