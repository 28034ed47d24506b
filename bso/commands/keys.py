"""``bso keys``: create, list and revoke the API keys of tenants (:mod:`bso.apikeys`).

A key is shown once, when it is created; the store keeps only its hash, so a
lost key is revoked and replaced, never recovered.  ``create`` also writes the
team's file, ``<data dir>/teams/<tenant>-<key id>.env`` (0600): the tenant's own
Redis URL (its user, the key's secret as password) and the new key, all a team's
training jobs need, and what to hand the team instead of ``credentials.env``
(which holds the worker, Flower and database secrets too).  The database is the
one ``bso up`` uses: ``--database-url``, else ``$BSO_DATABASE_URL``, else the
SQLite file in ``--data-dir``.

``create`` and ``revoke`` also bring the running Redis in step, as the
``bso-admin`` user (:class:`bso_workers.tenant_users.TenantUsers`): the tenant's
Redis user gains or loses the key's password, and the workers start serving its
queue.  ``sync`` does that for every tenant (after a Redis that lost its users).
Without a reachable Redis, ``bso up`` does it when it next starts.
"""

from __future__ import annotations

import argparse
import os
import re
import string
import sys
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import redis

from bso.apikeys import (
    ADMISSION_WINDOW_S,
    DEFAULT_MAX_QUEUE,
    DEFAULT_PER_SECOND,
    DEFAULT_TENANT,
    MAX_LIMIT,
    TenantLimits,
)
from bso.commands.failures import UserError
from bso.commands.migrate import add_database_arguments, database_url
from bso.ids import TENANT_PATTERN
from bso.storage.sql import SqlStore
from bso.storage.sql.engine import create_if_new
from bso.wire.connection import redact_url, redis_client
from bso.wire.keys import tenant_user
from bso.wire.urls import redact_urls_in
from bso_workers.credentials import ADMIN_URL_NAME, DATABASE_URL_NAME
from bso_workers.stack import DEFAULT_DATA_DIR
from bso_workers.tenant_keys import (
    create_key,
    read_saved,
    remove_team_files,
    team_file_text,
    write_team_file,
)
from bso_workers.tenant_users import TenantUsers, as_tenant_url

ACTIONS = {
    "create": "Make a key for a tenant and print it once.",
    "list": "List the key ids, their tenants, creation and revocation times.",
    "revoke": "Refuse a key from now on.",
    "sync": "Give the running Redis every tenant's user as the keys say (bso up does at start).",
    "limits": "Show or set a tenant's admission limits (its queue's bound and its rate).",
}


def _tenant(text: str) -> str:
    if not re.fullmatch(TENANT_PATTERN, text):
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
    for name in ("create", "revoke", "sync", "limits"):  # the actions that update Redis
        actions.choices[name].add_argument(
            "--admin-url",
            help=f"the bso-admin user's Redis URL, to update the running Redis (default: "
            f"${ADMIN_URL_NAME}, else --data-dir's credentials.env)",
        )
    create.add_argument(
        "--tenant", type=_tenant, default=DEFAULT_TENANT, help="the tenant the key acts for"
    )
    create.add_argument(
        "--broker-url",
        help="a Redis URL of the service, whose scheme, host, port and database the team "
        "file's URL takes (with the tenant's own user and key); default: BSO_BROKER_URL of "
        "--data-dir's credentials.env, which bso up writes",
    )
    create.add_argument(
        "--redis-host",
        help="the name teams reach Redis at, put in the team file's URL instead of the one "
        "bso up listens on (needed when it listens on every address, 0.0.0.0)",
    )
    create.add_argument(
        "--print-team-file",
        action="store_true",
        help="print the team file (URL and key) instead of writing it, e.g. into a secret store",
    )
    revoke.add_argument("key_id", help="the 12 hex digits after 'bso_' (see `bso keys list`)")
    limits = actions.choices["limits"]
    limits.add_argument(
        "tenant", nargs="?", type=_tenant, help="the tenant whose limits to show or set"
    )
    limits.add_argument(
        "--tenant",
        dest="tenant_option",
        type=_tenant,
        help="the same, spelled as `bso keys create --tenant` spells it",
    )
    limits.add_argument(
        "--max-queue",
        type=_limit,
        help=f"events it may have waiting (default for every tenant: {DEFAULT_MAX_QUEUE})",
    )
    limits.add_argument(
        "--per-second",
        type=_limit,
        help=f"events it may send per second, over {ADMISSION_WINDOW_S} s "
        f"(default for every tenant: {DEFAULT_PER_SECOND})",
    )
    limits.add_argument("--defaults", action="store_true", help="back to the defaults")


def _limit(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_LIMIT:
        raise argparse.ArgumentTypeError(f"{text!r}: a whole number from 1 to {MAX_LIMIT}")
    return value


def describe_limits(limits: TenantLimits) -> str:
    """One phrase for ``bso keys list`` and ``bso keys limits``."""
    default = " (the defaults)" if limits == TenantLimits() else ""
    events = "event" if limits.max_queue == 1 else "events"
    return (
        f"at most {limits.max_queue} {events} waiting, {limits.per_second} per second "
        f"(bursts of {limits.burst} within {ADMISSION_WINDOW_S} s){default}"
    )


SHELL_SAFE = frozenset(string.ascii_letters + string.digits + "-._~:/?#[]@!%+,=")
"""Characters a team file's URL may hold: it is sourced by a shell (``set -a; .
FILE``), so no quote, space, ``$``, backtick, ``;``, ``&``, ``|``, ``<``, ``>``, ``*``
or parenthesis; percent-encode such characters in a password."""
LOCAL_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", ""})


def _team_url(args: argparse.Namespace, key_database: str) -> tuple[str | None, str]:
    """The clients' URL for the team file, or None and why there is none."""
    served = read_saved(args.data_dir)
    if args.broker_url is not None:
        url = args.broker_url
    elif not served.get("BSO_BROKER_URL"):
        return None, f"{args.data_dir} has no credentials.env with the clients' URL"
    elif served.get(DATABASE_URL_NAME, key_database) != key_database:
        return None, (
            f"the key is in {redact_url(key_database)}, but the bso up of {args.data_dir} "
            f"serves {redact_url(served[DATABASE_URL_NAME])}"
        )
    else:
        url = served["BSO_BROKER_URL"]
    if args.redis_host:
        url = _with_host(url, args.redis_host)
    return url, ""


def _check_base_url(url: str) -> None:
    """Refuse ``url`` as the service's address for a team file unless one can be made of it."""
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss") or not parts.hostname:
        raise UserError(
            f"the service's URL must be a redis:// or rediss:// URL with a host, got "
            f"{redact_url(url)}"
        )
    if not set(url.rpartition("@")[2]) <= SHELL_SAFE:
        raise UserError(
            "the service's URL has characters a shell would act on in the sourced team file "
            "(quotes, spaces, $, ;, &, ...) after its login"
        )
    if parts.hostname in WILDCARD_HOSTS:
        raise UserError(
            f"the clients' URL names {parts.hostname!r}, where Redis listens on every address "
            "but no team can connect: give --redis-host, the name teams reach it at"
        )


def _with_host(url: str, host: str) -> str:
    parts = urlsplit(url)
    login = parts.netloc.rpartition("@")[0]
    port = f":{parts.port}" if parts.port else ""
    return urlunsplit(parts._replace(netloc=f"{login}@{host}{port}" if login else f"{host}{port}"))


def _admin_url(args: argparse.Namespace) -> str | None:
    return (
        args.admin_url
        or os.environ.get(ADMIN_URL_NAME)
        or read_saved(args.data_dir).get(ADMIN_URL_NAME)
    )


def _update_redis(args: argparse.Namespace, store: SqlStore, tenant: str, *, revoked: bool) -> str:
    """Bring the running Redis's user of ``tenant`` in step with the store; one line on
    what was done (never raises for a Redis that is down: the store has the truth)."""
    url = _admin_url(args)
    if not url:
        return (
            f"no bso-admin URL (--admin-url or ${ADMIN_URL_NAME}): tenant {tenant}'s Redis user "
            "is updated when bso up next starts, or by `bso keys sync`"
        )
    try:
        with redis_client(url) as client:
            users = TenantUsers(client)
            has_user = users.apply(tenant, store.api_keys(), store.tenant_limits().get(tenant))
            if revoked:
                users.drop_connections(tenant)
    except (redis.RedisError, OSError) as exc:
        return (
            f"Redis at {redact_url(url)} was not updated ({type(exc).__name__}: "
            f"{redact_urls_in(str(exc))}); run `bso keys sync` once it answers"
        )
    if has_user:
        return f"Redis user {tenant_user(tenant)} is up to date; the workers serve its queue"
    return f"Redis user {tenant_user(tenant)} removed: tenant {tenant} has no valid key left"


def _create(args: argparse.Namespace, store: SqlStore, key_database: str) -> int:
    base_url, missing = _team_url(args, key_database)
    if base_url is None and args.print_team_file:
        raise UserError(f"no team file to print: {missing} (give --broker-url)")
    if base_url is not None:
        _check_base_url(base_url)
    key = create_key(store, args.tenant)
    client_url = None if base_url is None else as_tenant_url(base_url, args.tenant, key)
    redis_line = _update_redis(args, store, args.tenant, revoked=False)
    if client_url is not None and args.print_team_file:
        print(team_file_text(args.tenant, key, client_url), end="")
        print(redis_line, file=sys.stderr)
        return 0
    print(f"API key for tenant {args.tenant} (shown once; give it as BSO_API_KEY):")
    print(key)
    print(redis_line)
    if client_url is None:
        print(
            f"no team file: {missing} (give --broker-url redis://HOST:PORT/0); hand the team "
            f"this key and a URL of user {tenant_user(args.tenant)} with the key's secret "
            "(after its last '_') as password, never the worker, Flower or database secrets"
        )
        return 0
    path = write_team_file(
        args.data_dir, args.tenant, key, team_file_text(args.tenant, key, client_url)
    )
    print(
        f"team file {path} (0600): hand team {args.tenant} this file and nothing else; "
        "`set -a; . FILE; set +a` gives its training jobs BSO_BROKER_URL and BSO_API_KEY"
    )
    if urlsplit(client_url).hostname in LOCAL_HOSTS:
        print(
            "its URL names this machine's loopback address: only jobs on this machine reach "
            "it (bso up --host, and --redis-host NAME here, for teams elsewhere)"
        )
    return 0


def _revoke(args: argparse.Namespace, store: SqlStore, url: str) -> int:
    if not store.revoke_api_key(args.key_id, datetime.now(UTC)):
        known = store.get_api_key(args.key_id)
        state = "was already revoked" if known is not None else "is not"
        raise UserError(
            f"API key {args.key_id!r} {state} in {redact_url(url)}; `bso keys list` shows "
            "the key ids"
        )
    print(f"revoked API key {args.key_id}")
    for path in remove_team_files(args.data_dir, args.key_id):
        print(f"removed its team file {path}")
    record = store.get_api_key(args.key_id)
    if record is not None:
        print(_update_redis(args, store, record.tenant, revoked=True))
    return 0


def _list(store: SqlStore, url: str) -> int:
    records = store.api_keys()
    if not records:
        print(f"no API keys in {redact_url(url)}")
    for r in records:
        revoked = f"revoked {r.revoked_at:%Y-%m-%d %H:%M}" if r.revoked_at else "active"
        print(f"{r.key_id}  {r.tenant:<24} created {r.created_at:%Y-%m-%d %H:%M}  {revoked}")
    own = store.tenant_limits()
    for tenant in sorted({r.tenant for r in records} | set(own)):
        print(f"limits of {tenant}: {describe_limits(own.get(tenant, TenantLimits()))}")
    return 0


def _limits(args: argparse.Namespace, store: SqlStore) -> int:
    if args.tenant and args.tenant_option and args.tenant != args.tenant_option:
        raise UserError(f"two tenants named: {args.tenant} and --tenant {args.tenant_option}")
    args.tenant = args.tenant or args.tenant_option
    if not args.tenant:
        raise UserError("name the tenant: bso keys limits TEAM (or --tenant TEAM)")
    current = store.tenant_limits().get(args.tenant, TenantLimits())
    if args.defaults and (args.max_queue or args.per_second):
        raise UserError("--defaults sets both limits: give it alone")
    if not (args.defaults or args.max_queue or args.per_second):
        print(f"limits of {args.tenant}: {describe_limits(current)}")
        return 0
    wanted = (
        TenantLimits()
        if args.defaults
        else TenantLimits(
            args.max_queue or current.max_queue, args.per_second or current.per_second
        )
    )
    store.set_tenant_limits(args.tenant, None if wanted == TenantLimits() else wanted)
    print(f"limits of {args.tenant}: {describe_limits(wanted)}")
    if any(r.tenant == args.tenant and r.revoked_at is None for r in store.api_keys()):
        print(_update_redis(args, store, args.tenant, revoked=False))
    else:  # kept for a key made later; said, in case the name is a typo
        print(
            f"tenant {args.tenant} has no API key yet: the limits apply once "
            f"`bso keys create --tenant {args.tenant}` makes one"
        )
    return 0


def _sync(args: argparse.Namespace, store: SqlStore) -> int:
    url = _admin_url(args)
    if not url:
        raise UserError(f"no bso-admin URL: give --admin-url or set ${ADMIN_URL_NAME}")
    try:
        with redis_client(url) as client:
            users = TenantUsers(client).sync(store.api_keys(), store.tenant_limits())
    except (redis.RedisError, OSError) as exc:
        raise UserError(
            f"Redis at {redact_url(url)} was not updated ({type(exc).__name__}: "
            f"{redact_urls_in(str(exc))}); is bso up running? When it starts it gives "
            "every tenant its user itself; else check --admin-url"
        ) from exc
    for tenant, has_user in users.items():
        state = "up to date" if has_user else "removed (no valid key)"
        print(f"{tenant_user(tenant)}: {state}")
    if not users:
        print("no tenants: no API keys in the store")
    return 0


def run(args: argparse.Namespace) -> int:
    # No new database in the default data dir (./.bso): an operator in the wrong folder
    # would write keys no service reads, silently.  A data dir named is meant, but a
    # list reads: a typo'd --data-dir is not made (folders and all) for it.
    named = Path(args.data_dir) != DEFAULT_DATA_DIR
    url = database_url(args, create=named and args.action != "list")
    if args.action != "list":  # a list reads: it creates no database
        create_if_new(url)
    store = SqlStore(url)
    try:
        if args.action == "create":
            return _create(args, store, url)
        if args.action == "list":
            return _list(store, url)
        if args.action == "sync":
            return _sync(args, store)
        if args.action == "limits":
            return _limits(args, store)
        return _revoke(args, store, url)
    finally:
        store.close()
