"""``bso keys``: create, list and revoke the API keys of tenants (:mod:`bso.apikeys`).

A key is shown once, when it is created; the store keeps only its hash, so a
lost key is revoked and replaced, never recovered.  The database is the one
``bso up`` uses: ``--database-url``, else ``$BSO_DATABASE_URL``, else the SQLite
file in ``--data-dir``.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from datetime import UTC, datetime
from pathlib import Path

from bso.apikeys import DEFAULT_TENANT, TENANT_PATTERN, new_api_key
from bso.errors import Unauthorized
from bso.service import BsoService
from bso.storage.base import Store
from bso.storage.sql import SqlStore, upgrade
from bso_client.replies import redact_url
from bso_workers.credentials import Credentials

DEFAULT_DATA_DIR = Path(".bso")
"""The folder ``bso up`` keeps its SQLite database in (``bso_workers.launcher``)."""


def database_url_of(data_dir: Path, database_url: str | None = None) -> str:
    """The store ``bso up`` uses for ``data_dir`` unless a URL names another
    (the data dir is created, as ``bso up`` would)."""
    if database_url:
        return database_url
    data_dir.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{data_dir.resolve() / 'bso.sqlite3'}"


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


def _tenant(text: str) -> str:
    if not re.match(TENANT_PATTERN, text):
        raise argparse.ArgumentTypeError(
            f"{text!r}: 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit"
        )
    return text


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=DEFAULT_DATA_DIR,
        help="bso up's data dir, whose SQLite database holds the keys (default: %(default)s)",
    )
    parser.add_argument(
        "--database-url",
        default=os.environ.get("BSO_DATABASE_URL"),
        help="SQLAlchemy URL of the store (default: $BSO_DATABASE_URL, else SQLite in --data-dir)",
    )
    actions = parser.add_subparsers(dest="action", required=True)
    create = actions.add_parser("create", help="make a key for a tenant and print it once")
    create.add_argument("--tenant", type=_tenant, default=DEFAULT_TENANT)
    actions.add_parser("list", help="key ids, tenants, creation and revocation times")
    revoke = actions.add_parser("revoke", help="refuse a key from now on")
    revoke.add_argument("key_id", help="the 12 hex digits after 'bso_' (see `bso keys list`)")


def run(args: argparse.Namespace) -> int:
    url = database_url_of(args.data_dir, args.database_url)
    upgrade(url)
    store = SqlStore(url)
    try:
        if args.action == "create":
            key = create_key(store, args.tenant)
            print(f"API key for tenant {args.tenant} (shown once; give it as BSO_API_KEY):")
            print(key)
            return 0
        if args.action == "list":
            records = store.api_keys()
            if not records:
                print(f"no API keys in {redact_url(url)}")
            for r in records:
                revoked = f"revoked {r.revoked_at:%Y-%m-%d %H:%M}" if r.revoked_at else "active"
                print(
                    f"{r.key_id}  {r.tenant:<24} created {r.created_at:%Y-%m-%d %H:%M}  {revoked}"
                )
            return 0
        if store.revoke_api_key(args.key_id, datetime.now(UTC)):
            print(f"revoked API key {args.key_id}")
            return 0
        print(f"bso keys: no active API key {args.key_id!r}", file=sys.stderr)
        return 1
    finally:
        store.close()


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
