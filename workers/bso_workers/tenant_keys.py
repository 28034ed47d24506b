"""Tenants' API keys in the service's store: made, kept valid across restarts.

A key is shown once, when it is created; the store keeps only its hash
(:mod:`bso.apikeys`), so a lost key is revoked and replaced, never recovered.
``bso up`` and ``bso demo`` keep the default tenant's key in the data dir's
credentials (:func:`ensure_api_key`); ``bso keys`` (:mod:`bso.commands.keys`)
manages the others, and writes each team a file of its own
(:func:`write_team_file`): its key and the clients' URL, never the data dir's
other secrets.
"""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path

from bso.apikeys import (
    DEFAULT_TENANT,
    MAX_LIMIT,
    ApiKeyRecord,
    TenantLimits,
    key_id_of,
    new_api_key,
)
from bso.errors import Unauthorized
from bso.service import BsoService
from bso.storage.base import Store
from bso.storage.sql import SqlStore
from bso_workers.credentials import (
    CREDENTIALS_FILE,
    DATABASE_URL_NAME,
    Credentials,
    read_env_file,
    write_private,
)

DATABASE_URL_ENV = DATABASE_URL_NAME
"""The database of every command that takes ``--database-url``, when it is not given."""


def database_url_of(
    data_dir: Path,
    database_url: str | None = None,
    environ: Mapping[str, str] | None = None,
    *,
    create: bool = True,
) -> str:
    """The store of ``bso up``, ``bso migrate`` and ``bso keys``: ``database_url``, else
    ``$BSO_DATABASE_URL``, else the database a ``bso up`` with this ``data_dir``
    served (its ``credentials.env``), else the SQLite file in ``data_dir`` (then
    created, as ``bso up`` would, unless not ``create``: :class:`FileNotFoundError`
    when it is not there).

    The one rule for all three, so that ``bso migrate`` migrates the database
    ``bso up`` then serves and ``bso keys`` writes the keys it checks.
    """
    env = os.environ if environ is None else environ
    if database_url or (database_url := env.get(DATABASE_URL_ENV)):
        return database_url
    saved = data_dir / CREDENTIALS_FILE
    if saved.is_file() and (served := read_env_file(saved).get(DATABASE_URL_NAME)):
        return served
    database = data_dir.resolve() / "bso.sqlite3"
    if not create and not database.is_file():
        raise FileNotFoundError(errno.ENOENT, "no bso database", str(database))
    data_dir.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{database}"


def create_key(store: Store, tenant: str) -> str:
    """A new key for ``tenant``, stored hashed; the returned key is never stored."""
    key, record = new_api_key(tenant, datetime.now(UTC))
    store.add_api_key(record)
    return key


def ensure_key(store: Store, known: str | None, tenant: str = DEFAULT_TENANT) -> str:
    """``known`` if the store still accepts it for ``tenant``, else a new key for it.

    How ``bso up`` keeps the key it printed last time valid across restarts,
    and makes a new one when the data dir's copy is gone or was revoked.
    """
    if known:
        try:
            if BsoService(store).authenticate(known) == tenant:
                return known
        except Unauthorized:
            pass
    return create_key(store, tenant)


def ensure_api_key(database_url: str, credentials: Credentials) -> str:
    """The default tenant's key for ``bso up``/``bso demo``: the one in the data dir's
    credentials if the store still accepts it, else a new one (the caller saves it).

    So the two-command start needs no extra step, and a restart keeps the key the
    user's jobs already use.
    """
    store = SqlStore(database_url)
    try:
        return ensure_key(store, credentials.api_key or None)
    finally:
        store.close()


def key_records(database_url: str) -> tuple[list[ApiKeyRecord], dict[str, TenantLimits]]:
    """Every key record of the store at ``database_url`` (hashes only) and the tenants'
    own limits, for the tenants' Redis users (:mod:`bso_workers.tenant_users`)."""
    store = SqlStore(database_url)
    try:
        return store.api_keys(), store.tenant_limits()
    finally:
        store.close()


def set_limits(database_url: str, tenant: str, limits: TenantLimits) -> None:
    """Give ``tenant`` its own admission limits in the store at ``database_url``."""
    store = SqlStore(database_url)
    try:
        store.set_tenant_limits(tenant, limits)
    finally:
        store.close()


LOAD_GENERATOR_LIMITS = TenantLimits(MAX_LIMIT, MAX_LIMIT)
"""The default tenant's limits while a soak or a benchmark drives it: as high as they
go, since those measure the pipeline, not a team's door."""


TEAMS_DIR = "teams"
"""Where ``bso keys create`` writes each team's file, inside the data dir."""


def read_saved(data_dir: Path) -> dict[str, str]:
    """What a ``bso up`` with this data dir saved in its ``credentials.env`` (empty
    without one): the clients' URL and the database it serves, among others."""
    saved = data_dir / CREDENTIALS_FILE
    return read_env_file(saved) if saved.is_file() else {}


def team_file_text(tenant: str, api_key: str, client_url: str) -> str:
    """What a team's training jobs need, and nothing else: the client URL (the
    ``bso-client`` Redis user, which may only publish events and read replies) and
    the team's own API key.  No worker, Flower or database secret."""
    return (
        f"# bso: what the training jobs of team {tenant} need (set -a; . THIS_FILE; set +a)\n"
        f"BSO_BROKER_URL={client_url}\n"
        f"BSO_API_KEY={api_key}\n"
    )


def write_team_file(data_dir: Path, tenant: str, api_key: str, text: str) -> Path:
    """``<data dir>/teams/<tenant>-<key id>.env``, readable by the owner only (one
    file a key: a rotated key gets a new file, :func:`remove_team_files` removes the
    old one when it is revoked)."""
    folder = data_dir / TEAMS_DIR
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = folder / f"{tenant}-{key_id_of(api_key)[0]}.env"
    write_private(path, text)
    return path


def remove_team_files(data_dir: Path, key_id: str) -> list[Path]:
    """Delete the team file of key ``key_id`` (revoked: the file is worthless); the
    paths removed."""
    folder = data_dir / TEAMS_DIR
    if not re.fullmatch(r"[0-9a-f]{12}", key_id) or not folder.is_dir():
        return []
    removed = sorted(folder.glob(f"*-{key_id}.env"))
    for path in removed:
        path.unlink()
    return removed
