"""The secrets of an embedded service (``bso up``, ``bso demo``) and the Redis ACL users.

Redis gets two users and no anonymous access (the ``default`` user is off):

* ``bso-worker``: Celery workers, beat, Flower and operators' commands; every
  command on bso's keys (``~bso:*``) and channels except the dangerous ones
  (CONFIG, FLUSHALL/FLUSHDB, KEYS, DEBUG, SHUTDOWN, ACL, MODULE, MONITOR...);
* ``bso-client``: training scripts; it may only LPUSH onto the events queue's
  list, GET/GETDEL reply keys, SUBSCRIBE to an announcement channel and
  GET the workers' presence key (:data:`CLIENT_RULES`).  No reading of any
  other key, no scanning, no PUBLISH (Celery's remote control, which could
  shut workers down, travels on pub/sub channels), no configuration.

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
from dataclasses import dataclass, fields
from pathlib import Path
from urllib.parse import quote

from bso.wire import keys

CREDENTIALS_FILE = "credentials.env"
ACL_FILE = "users.acl"
WORKER_USER = "bso-worker"
CLIENT_USER = "bso-client"
FLOWER_USER = "bso"

WORKER_RULES = f"~{keys.KEY_PREFIX}* &* +@all -@dangerous +info +ping +client|setname +client|id"
"""The workers' rights: all of bso's keys and the channels Celery uses (its remote
control and task events), no dangerous command (INFO is read by Celery's inspect)."""

CLIENT_RULES = (
    f"resetchannels -@all +lpush +get +getdel +subscribe +unsubscribe +ping +select "
    f"~{keys.BROKER_KEY_PREFIX}{keys.EVENTS_QUEUE} ~{keys.REPLY_PREFIX}* "
    f"~{keys.WORKERS_ALIVE_KEY} &{keys.ANNOUNCE_PREFIX}{'?' * keys.ANNOUNCE_TOKEN_LENGTH}"
)
"""A training client's rights: publish onto the events queue, take its replies and
hear them announced (SUBSCRIBE to an announcement channel, whose name has the one
length of a token; no PSUBSCRIBE, so only to channels it can name exactly: its own
random one), and read whether any worker runs
(:data:`bso.wire.keys.WORKERS_ALIVE_KEY`, GET only).

Redis 6.2 (the bundled server) has no read-only key patterns, so the commands
above apply to every key named: a client could also GETDEL or LPUSH that one key.
The worst it can do with that is make a waiting caller believe for one refresh
interval (3 s) that no worker runs; it cannot touch an event or another key."""


@dataclass(frozen=True)
class Credentials:
    """What ``credentials.env`` holds; see the module docstring."""

    worker_password: str
    client_password: str
    flower_password: str
    api_key: str = ""
    """The default tenant's API key (``bso_workers.tenant_keys.ensure_key``)."""

    @staticmethod
    def generate() -> Credentials:
        return Credentials(*(secrets.token_urlsafe(32) for _ in range(3)))

    def worker_url(self, host: str, port: int) -> str:
        return redis_url(WORKER_USER, self.worker_password, host, port)

    def client_url(self, host: str, port: int) -> str:
        return redis_url(CLIENT_USER, self.client_password, host, port)

    @property
    def flower_basic_auth(self) -> str:
        """``FLOWER_BASIC_AUTH``: Flower's own login option, as ``user:password``."""
        return f"{FLOWER_USER}:{self.flower_password}"

    def acl(self) -> str:
        """The ACL file: passwords only as SHA-256 hashes (``#<hex>``)."""
        return "".join(
            f"user {user} {rules}\n"
            for user, rules in (
                ("default", "off resetkeys resetchannels -@all"),
                (WORKER_USER, f"on #{_sha256(self.worker_password)} {WORKER_RULES}"),
                (CLIENT_USER, f"on #{_sha256(self.client_password)} {CLIENT_RULES}"),
            )
        )


_ENV_NAMES = {
    "worker_password": "BSO_REDIS_WORKER_PASSWORD",
    "client_password": "BSO_REDIS_CLIENT_PASSWORD",
    "flower_password": "BSO_FLOWER_PASSWORD",
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


def save(data_dir: Path, credentials: Credentials, host: str, port: int, database_url: str) -> Path:
    """Write ``credentials.env`` (0600) and the ACL file (0600); returns the former.

    The env file also spells out the URLs, so that ``set -a; . credentials.env``
    gives a shell what a training script (``BSO_BROKER_URL``, ``BSO_API_KEY``)
    or an operator's command (``BSO_WORKER_BROKER_URL``, ``BSO_DATABASE_URL``)
    needs; the commands read it from the data dir themselves, so that ``bso keys``
    beside a ``bso up`` on PostgreSQL writes its keys where the service reads them.
    """
    lines = {name: getattr(credentials, field) for field, name in _ENV_NAMES.items()}
    lines["BSO_BROKER_URL"] = credentials.client_url(host, port)
    lines["BSO_WORKER_BROKER_URL"] = credentials.worker_url(host, port)
    lines["FLOWER_BASIC_AUTH"] = credentials.flower_basic_auth
    lines[DATABASE_URL_NAME] = database_url
    path = data_dir / CREDENTIALS_FILE
    write_private(path, "".join(f"{k}={v}\n" for k, v in lines.items()))
    write_private(data_dir / ACL_FILE, credentials.acl())
    return path


DATABASE_URL_NAME = "BSO_DATABASE_URL"
"""The database ``bso up`` serves, as ``credentials.env`` records it."""


def read_env_file(path: Path) -> dict[str, str]:
    """``NAME=value`` lines (no quoting: every value bso writes is URL-safe)."""
    values = {}
    for line in path.read_text().splitlines():
        name, sep, value = line.partition("=")
        if sep and not line.startswith("#"):
            values[name.strip()] = value.strip()
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
