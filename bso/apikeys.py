"""Tenants and their API keys: who may touch which job.

A *tenant* (a team, or a single job's owner) holds one or more API keys.  Every
event names a job and carries a key; the job belongs to the tenant whose key
registered it.  Job ids are per tenant: the store keeps tenant T's job J under
:func:`job_key` ``T/J``, so two tenants may each have a job ``nightly``, and a
tenant naming another's job finds nothing there (it reads exactly like a job that
does not exist).

A key is ``bso_<key id>_<secret>``: the key id (12 hex digits) finds the stored
record, the secret (32 random bytes, URL-safe base64) proves possession.  Only
the SHA-256 of the secret is stored: the secret is 256 random bits, so a fast
hash is enough (no password to stretch), and a stolen database holds no usable
key.  The fixed shape also lets logs and dead-letter previews blank any key
they might carry (:func:`redact_keys`).
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass
from datetime import datetime
from typing import Annotated, Final

from pydantic import Field

from bso.errors import Unauthorized
from bso.ids import TENANT_PATTERN, is_tenant

DEFAULT_TENANT: Final = "default"
"""The tenant of the embedded service's generated key and of in-process callers
(:class:`bso.service.BsoService` used directly, with no transport in between)."""

TenantName = Annotated[str, Field(pattern=TENANT_PATTERN)]
"""1-64 letters, digits, '.', '_' or '-', starting with a letter or digit."""

JOB_KEY_SEPARATOR: Final = "/"
"""Between the tenant and the job id in a job's key: in neither a tenant name nor a
job id (:mod:`bso.ids`), so two tenants' keys never meet and a key splits one way."""


def job_key(tenant: str, job_id: str) -> str:
    """Where the store keeps ``tenant``'s job ``job_id``.

    The default tenant's key is the job id itself, so a database from before job
    ids were per tenant keeps its default jobs where they were (revision 0009 moves
    the other tenants' ones); any other tenant's is ``<tenant>/<job id>``.
    """
    return job_id if tenant == DEFAULT_TENANT else f"{tenant}{JOB_KEY_SEPARATOR}{job_id}"


def split_job_key(key: str) -> tuple[str, str]:
    """The tenant and the job id a :func:`job_key` was made of."""
    tenant, separator, job_id = key.rpartition(JOB_KEY_SEPARATOR)
    return (tenant, job_id) if separator else (DEFAULT_TENANT, job_id)


KEY_ID_HEX: Final = 12
_KEY_RE: Final = re.compile(rf"^bso_([0-9a-f]{{{KEY_ID_HEX}}})_([A-Za-z0-9_-]{{43}})$")
_ANY_KEY_RE: Final = re.compile(rf"bso_([0-9a-f]{{{KEY_ID_HEX}}})_[A-Za-z0-9_-]+")
_BYTES_KEY_RE: Final = re.compile(rf"bso_([0-9a-f]{{{KEY_ID_HEX}}})_[A-Za-z0-9_-]+".encode())
MAX_KEY_LENGTH: Final = 4 + KEY_ID_HEX + 1 + 43
"""Length of every key: what a transport may cap the key header at."""


@dataclass(frozen=True, slots=True)
class ApiKeyRecord:
    """What the store keeps of a key: never the key itself."""

    key_id: str
    tenant: str
    secret_sha256: str
    created_at: datetime
    revoked_at: datetime | None = None


def new_api_key(tenant: str, now: datetime) -> tuple[str, ApiKeyRecord]:
    """A fresh key for ``tenant`` and the record to store; show the key once, keep the record."""
    if not is_tenant(tenant):
        raise ValueError(
            f"tenant {tenant!r} must be 1-64 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    key_id = secrets.token_hex(KEY_ID_HEX // 2)
    secret = secrets.token_urlsafe(32)
    return f"bso_{key_id}_{secret}", ApiKeyRecord(key_id, tenant, _digest(secret), now)


def key_id_of(api_key: str | None) -> tuple[str, str]:
    """The key id and secret of a well-formed key; :class:`Unauthorized` otherwise.

    The message never repeats the key: it may be a real key with a typo.
    """
    if api_key is None or api_key == "":
        raise Unauthorized(
            "no API key: pass api_key= (or set BSO_API_KEY) to the key `bso up` printed "
            "or `bso keys create` made"
        )
    match = _KEY_RE.match(api_key)
    if match is None:
        raise Unauthorized("the API key is malformed (expected bso_<12 hex>_<43 characters>)")
    return match.group(1), match.group(2)


def check_secret(record: ApiKeyRecord | None, key_id: str, secret: str) -> str:
    """The tenant of a valid, unrevoked key; :class:`Unauthorized` otherwise (one
    message for an unknown key and a wrong secret, compared in constant time)."""
    expected = record.secret_sha256 if record is not None else _digest("")
    valid = hmac.compare_digest(expected, _digest(secret)) and record is not None
    if not valid or record is None:
        raise Unauthorized(f"API key {key_id} is not valid")
    if record.revoked_at is not None:
        raise Unauthorized(f"API key {key_id} was revoked")
    return record.tenant


def redact_keys(text: str) -> str:
    """``text`` with the secret part of every API key in it blanked (key ids stay)."""
    return _ANY_KEY_RE.sub(r"bso_\1_***", text)


def redact_key_bytes(data: bytes) -> bytes:
    """:func:`redact_keys` for raw queue items."""
    return _BYTES_KEY_RE.sub(rb"bso_\1_***", data)


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


DEFAULT_MAX_QUEUE: Final = 1000
"""Events a tenant may have waiting in its queue.  A training job has a few in flight
(epochs are minutes apart; rank 0 alone talks to bso), so a thousand is a hundred
busy jobs' worth, and a full queue is a few seconds of two workers' time."""

DEFAULT_PER_SECOND: Final = 20
"""Events a tenant may send per second, on average over :data:`ADMISSION_WINDOW_S`:
twenty times what a hundred jobs sending one event every five seconds need."""

ADMISSION_WINDOW_S: Final = 5
"""The rate is counted over this many seconds, so a burst of ``5 x per_second``
events passes at once."""

MAX_LIMIT: Final = 1_000_000
"""Largest limit a tenant can be given (either one)."""


@dataclass(frozen=True, slots=True)
class TenantLimits:
    """How much one tenant may put on its queue: at most ``max_queue`` events waiting,
    at most ``per_second`` sent per second (over :data:`ADMISSION_WINDOW_S`).  Past
    either, the door refuses an event with :class:`~bso.errors.RateLimited`."""

    max_queue: int = DEFAULT_MAX_QUEUE
    per_second: int = DEFAULT_PER_SECOND

    def __post_init__(self) -> None:
        for name in ("max_queue", "per_second"):
            value = getattr(self, name)
            if not (isinstance(value, int) and 1 <= value <= MAX_LIMIT):
                raise ValueError(f"{name} must be a whole number from 1 to {MAX_LIMIT}")

    @property
    def burst(self) -> int:
        """Events admitted within any one :data:`ADMISSION_WINDOW_S`."""
        return self.per_second * ADMISSION_WINDOW_S

    def encoded(self) -> str:
        """The value of the tenant's limits key in Redis (read by the door's script)."""
        return f"{self.max_queue} {self.per_second}"

    @staticmethod
    def decoded(value: bytes | str | None) -> TenantLimits:
        """The limits a limits key holds; the defaults for a missing or unreadable one."""
        text = value.decode("ascii", "replace") if isinstance(value, bytes) else value
        try:
            max_queue, per_second = (int(part) for part in (text or "").split(" "))
            return TenantLimits(max_queue, per_second)
        except ValueError:
            return TenantLimits()
