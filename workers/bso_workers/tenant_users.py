"""Each tenant's Redis user: its ACL line, its URL, and keeping a running Redis in step.

A tenant's training jobs connect as ``bso-tenant-<tenant>``
(:func:`bso.wire.keys.tenant_user`), with the rights of its namespace alone
(:attr:`bso.wire.keys.Namespace.user_rules`): its own queue, replies and
announcement channels.  The user's passwords are the secrets of the tenant's
valid API keys, given to Redis as their SHA-256 hashes, which is exactly what the
store keeps of a key (:class:`bso.apikeys.ApiKeyRecord`).  So:

* the store stays the one truth: ``bso up`` writes every tenant's user into the
  ACL file it starts Redis with, from the key records alone;
* a team is handed one secret, its key, and its URL carries the same secret
  (:func:`as_tenant_url`);
* revoking a key closes the Redis door it opened (:meth:`TenantUsers.apply`
  removes the password and drops the tenant's connections; the last key removes
  the user).

:class:`TenantUsers` applies the records to a running Redis as the ``bso-admin``
user (``ACL SETUSER``/``DELUSER``, then ``ACL SAVE`` where Redis has an ACL file,
so that a restart keeps them) and keeps :data:`bso.wire.keys.TENANTS_KEY`, the set
of tenants whose queues the workers serve (:mod:`bso_workers.tenant_queues`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping
from urllib.parse import quote, urlsplit, urlunsplit

import redis

from bso.apikeys import ApiKeyRecord, TenantLimits, key_id_of
from bso.storage.base import Store
from bso.wire import keys


def active_hashes(records: Iterable[ApiKeyRecord]) -> dict[str, list[str]]:
    """Per tenant, the secret hashes of its keys that are not revoked (sorted, so the
    ACL file is the same for the same keys)."""
    hashes: dict[str, list[str]] = {}
    for record in records:
        if record.revoked_at is None:
            hashes.setdefault(record.tenant, []).append(record.secret_sha256)
    return {tenant: sorted(found) for tenant, found in sorted(hashes.items())}


def user_rules(tenant: str, secret_hashes: Iterable[str]) -> str:
    """``ACL SETUSER``'s rules for ``tenant``'s user: on, its key hashes, its namespace."""
    passwords = " ".join(f"#{digest}" for digest in secret_hashes)
    return f"on {passwords} {keys.tenant_namespace(tenant).user_rules}"


def acl_lines(records: Iterable[ApiKeyRecord]) -> list[str]:
    """The ACL file's lines for the tenants of ``records`` that have a valid key."""
    return [
        f"user {keys.tenant_user(tenant)} {user_rules(tenant, digests)}"
        for tenant, digests in active_hashes(records).items()
    ]


def as_tenant_url(url: str, tenant: str, api_key: str) -> str:
    """``url`` (any Redis URL of the service: scheme, host, port, database, query) with
    ``tenant``'s user and ``api_key``'s secret as its login."""
    parts = urlsplit(url)
    _, secret = key_id_of(api_key)
    host = parts.netloc.rpartition("@")[2]
    login = f"{quote(keys.tenant_user(tenant), safe='')}:{quote(secret, safe='')}"
    return urlunsplit(parts._replace(netloc=f"{login}@{host}"))


class TenantUsers:
    """The tenants' users on a running Redis, as the ``bso-admin`` user sees them."""

    def __init__(self, client: redis.Redis) -> None:
        self.redis = client

    def apply(
        self, tenant: str, records: Iterable[ApiKeyRecord], limits: TenantLimits | None = None
    ) -> bool:
        """Make ``tenant``'s user match its valid keys in ``records``, and its limits key
        its ``limits`` (None: the defaults); returns whether the tenant still has a key.
        Its connections are dropped (``CLIENT KILL USER``, :meth:`drop_connections`)
        when a key goes, since Redis keeps a connection authenticated with a password
        the user no longer has; the jobs with a valid key reconnect on their next call."""
        has_user = self._apply(tenant, active_hashes(records).get(tenant, []), limits)
        self._save()
        return has_user

    def drop_connections(self, tenant: str) -> None:
        """Close every connection of ``tenant``'s user (after a key was revoked)."""
        # An error: the user is gone already (its connections with it).
        with contextlib.suppress(redis.ResponseError):
            self._run("CLIENT", "KILL", "USER", keys.tenant_user(tenant))

    def sync(
        self, records: Iterable[ApiKeyRecord], limits: Mapping[str, TenantLimits]
    ) -> dict[str, bool]:
        """:meth:`apply` for every tenant of ``records`` (``limits``: those given their own),
        the ACL file saved once; per tenant, whether it has a user."""
        listed = list(records)
        hashes = active_hashes(listed)
        applied = {
            tenant: self._apply(tenant, hashes.get(tenant, []), limits.get(tenant))
            for tenant in sorted({r.tenant for r in listed})
        }
        self._save()
        return applied

    def _apply(self, tenant: str, digests: list[str], limits: TenantLimits | None) -> bool:
        """:meth:`apply` for the tenant's key hashes, without saving the ACL file."""
        namespace = keys.tenant_namespace(tenant)
        user = keys.tenant_user(tenant)
        if digests:
            self._run("ACL", "SETUSER", user, "reset", *user_rules(tenant, digests).split())
            write_limits(self.redis, namespace, limits)
            self.redis.sadd(keys.TENANTS_KEY, tenant)
        else:
            self._run("ACL", "DELUSER", user)
            write_limits(self.redis, namespace, None)
            self.redis.srem(keys.TENANTS_KEY, tenant)
        return bool(digests)

    def _run(self, *command: str) -> object:
        """One command as written (redis-py's ``acl_setuser`` takes the rules apart
        into its own arguments; these are the rules the ACL file holds, verbatim)."""
        return self.redis.execute_command(*command)  # type: ignore[no-untyped-call]

    def _save(self) -> None:
        """Persist the users into Redis's ACL file, where it was started with one."""
        try:
            self._run("ACL", "SAVE")
        except redis.ResponseError as exc:
            if "not configured to use an ACL file" not in str(exc):
                raise


def write_limits(
    client: redis.Redis, namespace: keys.Namespace, limits: TenantLimits | None
) -> None:
    """Write the tenant's limits where its door reads them (its limits key) and where the
    workers do (:data:`bso.wire.keys.TENANT_LIMITS_KEY`); the defaults are no entry."""
    tenant = namespace.tenant
    assert tenant is not None, "a tenant's namespace"
    with client.pipeline(transaction=True) as pipe:
        if limits is None or limits == TenantLimits():
            pipe.delete(namespace.limits_key)
            pipe.hdel(keys.TENANT_LIMITS_KEY, tenant)
        else:
            pipe.set(namespace.limits_key, limits.encoded())
            pipe.hset(keys.TENANT_LIMITS_KEY, tenant, limits.encoded())
        pipe.execute()


def serve_tenants(
    client: redis.Redis, records: Iterable[ApiKeyRecord], limits: Mapping[str, TenantLimits]
) -> None:
    """Make the set of tenants the workers serve exactly the tenants of ``records`` with a
    valid key, each with its ``limits`` (``bso up`` at start, as the worker user)."""
    tenants = list(active_hashes(records))
    with client.pipeline(transaction=True) as pipe:
        pipe.delete(keys.TENANTS_KEY)
        if tenants:
            pipe.sadd(keys.TENANTS_KEY, *tenants)
        pipe.execute()
    for tenant in tenants:
        write_limits(client, keys.tenant_namespace(tenant), limits.get(tenant))


def serve_stored_tenants(client: redis.Redis, store: Store) -> list[str]:
    """:func:`serve_tenants` from the store's key records and limits; the tenants served.
    A worker node runs it when Redis lost the set (:mod:`bso_workers.tenant_queues`)."""
    records = store.api_keys()
    serve_tenants(client, records, store.tenant_limits())
    return list(active_hashes(records))
