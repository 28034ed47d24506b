"""``bso keys``: create, list and revoke the API keys of tenants (:mod:`bso.apikeys`).

A key is shown once, when it is created; the store keeps only its hash, so a
lost key is revoked and replaced, never recovered.  ``create`` also writes the
team's file, ``<data dir>/teams/<tenant>-<key id>.env`` (0600): the clients'
Redis URL and the new key, all a team's training jobs need, and what to hand
the team instead of ``credentials.env`` (which holds the worker, Flower and
database secrets too).  The database is the one
``bso up`` uses: ``--database-url``, else ``$BSO_DATABASE_URL``, else the SQLite
file in ``--data-dir``.
"""

from __future__ import annotations

import argparse
import re
from datetime import UTC, datetime

from bso.apikeys import DEFAULT_TENANT, TENANT_PATTERN
from bso.commands.failures import UserError
from bso.commands.migrate import add_database_arguments, database_url
from bso.storage.sql import SqlStore
from bso.storage.sql.engine import upgrade
from bso.wire.connection import redact_url
from bso_workers.tenant_keys import (
    client_url_of,
    create_key,
    team_file_text,
    write_team_file,
)

ACTIONS = {
    "create": "Make a key for a tenant and print it once.",
    "list": "List the key ids, their tenants, creation and revocation times.",
    "revoke": "Refuse a key from now on.",
}


def _tenant(text: str) -> str:
    if not re.match(TENANT_PATTERN, text):
        raise argparse.ArgumentTypeError(
            f"{text!r}: 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit"
        )
    return text


def configure_parser(parser: argparse.ArgumentParser) -> None:
    add_database_arguments(parser)
    actions = parser.add_subparsers(dest="action", required=True)
    formatter = parser.formatter_class
    for name, summary in ACTIONS.items():
        actions.add_parser(name, help=summary, description=summary, formatter_class=formatter)
    create, revoke = actions.choices["create"], actions.choices["revoke"]
    create.add_argument(
        "--tenant", type=_tenant, default=DEFAULT_TENANT, help="the tenant the key acts for"
    )
    create.add_argument(
        "--broker-url",
        help="the training clients' Redis URL for the team file (default: BSO_BROKER_URL of "
        "--data-dir's credentials.env, which bso up writes)",
    )
    create.add_argument(
        "--print-team-file",
        action="store_true",
        help="print the team file (URL and key) instead of writing it, e.g. into a secret store",
    )
    revoke.add_argument("key_id", help="the 12 hex digits after 'bso_' (see `bso keys list`)")


def _create(args: argparse.Namespace, store: SqlStore) -> int:
    key = create_key(store, args.tenant)
    client_url = args.broker_url or client_url_of(args.data_dir)
    if client_url is not None and args.print_team_file:
        print(team_file_text(args.tenant, key, client_url), end="")
        return 0
    print(f"API key for tenant {args.tenant} (shown once; give it as BSO_API_KEY):")
    print(key)
    if client_url is None:
        print(
            f"no team file: {args.data_dir} has no credentials.env with the clients' URL "
            "(give --broker-url redis://bso-client:...); hand the team this key and the "
            "bso-client URL, never the worker, Flower or database secrets"
        )
        return 0
    path = write_team_file(
        args.data_dir, args.tenant, key, team_file_text(args.tenant, key, client_url)
    )
    print(
        f"team file {path} (0600): hand team {args.tenant} this file and nothing else; "
        "`set -a; . FILE; set +a` gives its training jobs BSO_BROKER_URL and BSO_API_KEY"
    )
    return 0


def run(args: argparse.Namespace) -> int:
    url = database_url(args)
    upgrade(url)
    store = SqlStore(url)
    try:
        if args.action == "create":
            return _create(args, store)
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
        raise UserError(
            f"no active API key {args.key_id!r} in {redact_url(url)}; `bso keys list` shows "
            "the key ids"
        )
    finally:
        store.close()
