"""The secrets of an embedded service (``bso up``, ``bso demo``) and the Redis ACL users.

Redis has no anonymous access (the ``default`` user is off) and these users:

* ``bso-worker``: Celery workers, beat, Flower and operators' commands; every
  command on bso's keys (``~bso:*``) and channels except the dangerous ones
  (CONFIG, FLUSHALL/FLUSHDB, KEYS, DEBUG, SHUTDOWN, ACL, MODULE, MONITOR...);
* ``bso-tenant-<tenant>``, one per tenant with a valid API key
  (:mod:`bso_workers.tenant_users`): that tenant's training jobs; it may only
  LPUSH onto its own events queue, GET/GETDEL its own reply keys, SUBSCRIBE to its
  own announcement channels and GET the workers' presence key
  (:attr:`bso.wire.keys.Namespace.user_rules`).  No reading of any other key, no
  scanning, no PUBLISH (Celery's remote control, which could shut workers down,
  travels on pub/sub channels), no configuration.  Its passwords are the secrets
  of the tenant's API keys, so a revoked key also closes its Redis door;
* ``bso-admin``: ``bso keys``, which adds and removes the tenants' users on a
  running Redis (``ACL SETUSER``/``DELUSER``/``SAVE``, ``CLIENT KILL``) and keeps
  the set of tenants the workers serve; nothing else;
* ``bso-client``: the shared user of deployments from before tenants had users
  of their own, kept so that their training jobs go on working until their keys
  are rotated (docs/security.md, "Upgrading"): the same rights as a tenant's, on
  the shared queue and replies (:data:`CLIENT_RULES`).

Passwords are generated once (256 bits each), kept with the API key in
``<data dir>/credentials.env`` (mode 0600, reused on the next start so the
URLs and the key handed to users stay valid) and given to Redis as SHA-256
hashes in an ACL file, so no password is ever on a command line, where ``ps``
shows it, nor in a log.  Flower's login goes through ``FLOWER_BASIC_AUTH``.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from urllib.parse import quote

from bso.apikeys import DEFAULT_TENANT
from bso.wire import keys
from bso_workers.tenant_users import as_tenant_url

CREDENTIALS_FILE = "credentials.env"
ACL_FILE = "users.acl"
WORKER_USER = "bso-worker"
CLIENT_USER = "bso-client"
ADMIN_USER = "bso-admin"
FLOWER_USER = "bso"
FLOWER_LOGIN = f"login {FLOWER_USER}, password BSO_FLOWER_PASSWORD in the credentials"
"""How ``bso up`` tells a person to log in to Flower and to the metrics (one login)."""

WORKER_RULES = f"~{keys.KEY_PREFIX}* &* +@all -@dangerous +info +ping +client|setname +client|id"
"""The workers' rights: all of bso's keys and the channels Celery uses (its remote
control and task events), no dangerous command (INFO is read by Celery's inspect)."""

CLIENT_RULES = keys.SHARED.user_rules
"""A training client's rights: publish onto the events queue, take its replies and
hear them announced (SUBSCRIBE to an announcement channel, whose name has the one
length of a token; no PSUBSCRIBE, so only to channels it can name exactly: its own
random one), and read whether any worker runs
(:data:`bso.wire.keys.WORKERS_ALIVE_KEY`, GET only).

Redis 6.2 (the bundled server) has no read-only key patterns, so the commands
above apply to every key named: a client could also GETDEL or LPUSH that one key.
The worst it can do with that is make a waiting caller believe for one refresh
interval (3 s) that no worker runs; it cannot touch an event or another key."""

ADMIN_RULES = (
    "resetchannels -@all +acl|setuser +acl|deluser +acl|save +client|kill +ping +select "
    "+sadd +srem +set +del +hset +hdel +multi +exec "
    f"~{keys.TENANTS_KEY} ~{keys.TENANT_LIMITS_KEY} ~{keys.TENANT_KEY_PREFIX}*:limits"
)
"""``bso keys``'s rights on a running Redis: the tenants' users, their limits and the
set of tenants the workers serve; it reads no key.  ACL SETUSER makes it as
powerful as Redis's own administrator (it could give itself any right): its URL
is a root password, for operators only."""


@dataclass(frozen=True)
class Credentials:
    """What ``credentials.env`` holds; see the module docstring."""

    worker_password: str
    client_password: str
    flower_password: str
    admin_password: str
    api_key: str = ""
    """The default tenant's API key (``bso_workers.tenant_keys.ensure_key``)."""

    @staticmethod
    def generate() -> Credentials:
        return Credentials(*(secrets.token_urlsafe(32) for _ in range(4)))

    def worker_url(self, host: str, port: int) -> str:
        return redis_url(WORKER_USER, self.worker_password, host, port)

    def client_url(self, host: str, port: int) -> str:
        """The shared ``bso-client`` user's URL (clients set up before tenant users)."""
        return redis_url(CLIENT_USER, self.client_password, host, port)

    def admin_url(self, host: str, port: int) -> str:
        return redis_url(ADMIN_USER, self.admin_password, host, port)

    @property
    def flower_basic_auth(self) -> str:
        """``FLOWER_BASIC_AUTH``: Flower's own login option, as ``user:password``."""
        return f"{FLOWER_USER}:{self.flower_password}"

    def acl(self, tenant_users: Sequence[str] = (), *, shared_client: bool = True) -> str:
        """The ACL file: passwords only as SHA-256 hashes (``#<hex>``); ``tenant_users``:
        the tenants' lines (:func:`bso_workers.tenant_users.acl_lines`); the shared
        ``bso-client`` user off unless ``shared_client``."""
        client_state = "on" if shared_client else "off"
        return "".join(
            f"user {user} {rules}\n"
            for user, rules in (
                ("default", "off resetkeys resetchannels -@all"),
                (WORKER_USER, f"on #{_sha256(self.worker_password)} {WORKER_RULES}"),
                (CLIENT_USER, f"{client_state} #{_sha256(self.client_password)} {CLIENT_RULES}"),
                (ADMIN_USER, f"on #{_sha256(self.admin_password)} {ADMIN_RULES}"),
            )
        ) + "".join(f"{line}\n" for line in tenant_users)


_ENV_NAMES = {
    "worker_password": "BSO_REDIS_WORKER_PASSWORD",
    "client_password": "BSO_REDIS_CLIENT_PASSWORD",
    "flower_password": "BSO_FLOWER_PASSWORD",
    "admin_password": "BSO_REDIS_ADMIN_PASSWORD",
    "api_key": "BSO_API_KEY",
}


def load_or_create(data_dir: Path) -> Credentials:
    """The data dir's credentials; missing ones are generated (not yet saved)."""
    path = data_dir / CREDENTIALS_FILE
    saved = read_env_file(path) if path.exists() else {}
    fresh = Credentials.generate()
    values = {
        f.name: saved.get(_ENV_NAMES[f.name]) or getattr(fresh, f.name) for f in fields(fresh)
    }
    return Credentials(**values)


def save(
    data_dir: Path,
    credentials: Credentials,
    host: str,
    port: int,
    database_url: str,
    *,
    tenant_users: Sequence[str] = (),
    shared_client: bool = True,
) -> Path:
    """Write ``credentials.env`` (0600) and the ACL file (0600, with ``tenant_users``'
    lines); returns the former.

    The env file also spells out the URLs, so that ``set -a; . credentials.env``
    gives a shell what a training script of the default tenant (``BSO_BROKER_URL``,
    its own Redis user, and ``BSO_API_KEY``) or an operator's command
    (``BSO_WORKER_BROKER_URL``, ``BSO_ADMIN_BROKER_URL``, ``BSO_DATABASE_URL``)
    needs; the commands read it from the data dir themselves, so that ``bso keys``
    beside a ``bso up`` on PostgreSQL writes its keys where the service reads them.
    ``BSO_SHARED_BROKER_URL`` is the shared ``bso-client`` user's, for clients set up
    before tenants had users of their own.

    Each value is written as the shell reads it (:func:`shlex.quote`, which leaves
    the generated secrets and URLs as they are): the database URL is the operator's,
    and a password or query holding ``$``, ``;`` or ``&`` (``?charset=utf8mb4&...``)
    would otherwise be expanded, run as a command or cut short when the file is
    sourced, and the shell's mangled ``$BSO_DATABASE_URL`` would then win over this
    file in every ``bso`` command run from it.
    """
    lines = {name: getattr(credentials, field) for field, name in _ENV_NAMES.items()}
    lines["BSO_BROKER_URL"] = as_tenant_url(
        credentials.client_url(host, port), DEFAULT_TENANT, credentials.api_key
    )
    lines["BSO_SHARED_BROKER_URL"] = credentials.client_url(host, port)
    lines["BSO_WORKER_BROKER_URL"] = credentials.worker_url(host, port)
    lines[ADMIN_URL_NAME] = credentials.admin_url(host, port)
    lines["FLOWER_BASIC_AUTH"] = credentials.flower_basic_auth
    lines[DATABASE_URL_NAME] = database_url
    path = data_dir / CREDENTIALS_FILE
    write_private(path, "".join(f"{k}={shlex.quote(v)}\n" for k, v in lines.items()))
    write_private(data_dir / ACL_FILE, credentials.acl(tenant_users, shared_client=shared_client))
    return path


ADMIN_URL_NAME = "BSO_ADMIN_BROKER_URL"
"""The ``bso-admin`` user's URL, as ``credentials.env`` records it (``bso keys``)."""


DATABASE_URL_NAME = "BSO_DATABASE_URL"
"""The database ``bso up`` serves, as ``credentials.env`` records it."""


def read_env_file(path: Path) -> dict[str, str]:
    """``NAME=value`` lines; a value in single quotes (:func:`save`'s quoting of one
    the shell would act on) is read as the shell reads it, any other as it stands
    (the files of earlier bso releases, and compose's ``.env``)."""
    values = {}
    for line in path.read_text().splitlines():
        name, sep, value = line.partition("=")
        if sep and not line.startswith("#"):
            value = value.strip()
            values[name.strip()] = shlex.split(value)[0] if value.startswith("'") else value
    return values


def write_private(path: Path, text: str) -> None:
    """Write ``text`` readable by the owner only, also when the file existed."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as file:
        file.write(text)
    os.chmod(path, 0o600)


def redis_url(user: str, password: str, host: str, port: int, db: int = 0) -> str:
    return f"redis://{quote(user)}:{quote(password, safe='')}@{host}:{port}/{db}"


def _sha256(password: str) -> str:
    return hashlib.sha256(password.encode()).hexdigest()
