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

from bso.apikeys import DEFAULT_TENANT, TENANT_PATTERN
from bso.storage.sql import SqlStore
from bso.storage.sql.engine import upgrade
from bso.wire.connection import redact_url
from bso_workers.stack import DEFAULT_DATA_DIR
from bso_workers.tenant_keys import create_key, database_url_of


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
    formatter = parser.formatter_class
    create = actions.add_parser(
        "create", help="make a key for a tenant and print it once", formatter_class=formatter
    )
    create.add_argument(
        "--tenant", type=_tenant, default=DEFAULT_TENANT, help="the tenant the key acts for"
    )
    actions.add_parser(
        "list", help="key ids, tenants, creation and revocation times", formatter_class=formatter
    )
    revoke = actions.add_parser(
        "revoke", help="refuse a key from now on", formatter_class=formatter
    )
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
