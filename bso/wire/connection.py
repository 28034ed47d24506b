"""The connection both sides keep to the broker (Redis), and what its errors mean.

A broker that cannot be reached (refused or reset connection, timeout, Redis
still loading its append-only file, a read-only replica) raises
:class:`BrokerUnreachable`, which the caller rides out by sending the same
event again (:mod:`bso_client.transport`); refused credentials, a denied
command or a certificate that fails verification raise a plain
:class:`~bso.errors.ServiceUnavailable` at once.  URLs shown in errors and logs
go through :func:`redact_url`.
"""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from typing import Any, TypeVar
from urllib.parse import unquote, urlsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from bso.apikeys import DEFAULT_TENANT
from bso.errors import ServiceUnavailable
from bso.wire.keys import Namespace, namespace_of_user, tenant_user
from bso.wire.resolve import resolving_class
from bso.wire.urls import redact_url

__all__ = [
    "OUTAGE_ERRORS",
    "BrokerRefused",
    "BrokerUnreachable",
    "InvalidBrokerUrl",
    "broker_error",
    "check_redis_url",
    "namespace_of_url",
    "redact_url",
    "redis_client",
]


class BrokerUnreachable(ServiceUnavailable):
    """Redis could not be reached or cannot serve now: the caller may send again.

    Raised for a refused, reset or timed-out connection, for Redis still
    loading its append-only file after a restart, and for a read-only replica
    (a failover in progress).  Not for refused credentials or a command the
    ACL denies, nor for a TLS certificate that fails verification: those do
    not go away by waiting.
    """


class BrokerRefused(ServiceUnavailable):
    """Redis refused this client: wrong credentials (``WRONGPASS``, ``NOAUTH``), a
    command its ACL denies (``NOPERM``), or a certificate that failed verification.
    Waiting does not cure it; the client's URL, password or certificate must change."""


class InvalidBrokerUrl(ValueError):
    """A broker URL that is no Redis URL (another scheme, a port or database that
    is not a number): no wait or retry can cure it, the URL must change."""


def check_redis_url(url: str) -> None:
    """Raise :class:`InvalidBrokerUrl`, naming the URL redacted and what one looks
    like, unless redis-py can parse ``url``."""
    try:
        redis.ConnectionPool.from_url(url)  # parses only; connects on first use
    except ValueError as exc:
        raise InvalidBrokerUrl(
            f"not a Redis URL: {redact_url(url)} ({exc}); give one like "
            "redis://[user:password@]host:6379/0 (rediss:// for TLS, unix:///path/redis.sock)"
        ) from None


def broker_error(url: str, exc: Exception) -> ServiceUnavailable:
    """The error to raise for ``exc``, a Redis or socket error talking to ``url``.

    :class:`BrokerUnreachable` for what an outage looks like, a plain
    :class:`ServiceUnavailable` for what waiting does not cure.  The message
    names the URL with its password masked.
    """
    where = redact_url(url)
    if _caused_by(exc, (redis.AuthenticationError, redis.exceptions.AuthorizationError)):
        if not _has_credentials(url):
            # Redis's own words here ("HELLO must be called with the client already
            # authenticated ...") name no fix a bso user can act on.
            return BrokerRefused(
                f"Redis at {where} needs a user and password, and the URL gives none: use "
                "BSO_BROKER_URL from bso up's credentials.env "
                f"(redis://{tenant_user(DEFAULT_TENANT)}:...@host:port/0), or a team's from "
                "its team file"
            )
        return BrokerRefused(f"Redis at {where} refused the client's credentials: {exc}")
    if _caused_by(exc, redis.exceptions.NoPermissionError):
        return BrokerRefused(f"Redis at {where} denied a command to this user: {exc}")
    if _caused_by(exc, ssl.SSLCertVerificationError):
        return BrokerRefused(f"Redis at {where} presented a certificate that failed: {exc}")
    if _caused_by(exc, redis.exceptions.InvalidResponse):
        return ServiceUnavailable(
            f"what answers at {where} is not Redis ({exc}); check the URL's host and port "
            "(what `bso up` prints)"
        )
    return BrokerUnreachable(
        f"cannot reach the bso broker at {where}: {exc} "
        "(is the service running? `bso up` starts one)"
    )


def _has_credentials(url: str) -> bool:
    """Whether ``url`` carries a password (with or without a user name)."""
    try:
        return bool(urlsplit(url).password)
    except ValueError:
        return False


_E = TypeVar("_E", bound=BaseException)


def _causes(exc: BaseException) -> Iterator[BaseException]:
    """``exc``, then each exception it was raised from or during (redis-py wraps socket
    and TLS errors in its ``ConnectionError``, kombu wraps redis-py's errors in its
    ``OperationalError``), each once."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        yield current
        seen.add(id(current))
        current = current.__cause__ or current.__context__


def cause_of(exc: BaseException, kind: type[_E]) -> _E | None:
    """``exc`` or the first exception it was raised from or during that is a ``kind``;
    None if none is."""
    return next((c for c in _causes(exc) if isinstance(c, kind)), None)


def _caused_by(
    exc: BaseException, kind: type[BaseException] | tuple[type[BaseException], ...]
) -> bool:
    """Whether ``exc`` or an exception it was raised from or during is a ``kind``."""
    return any(isinstance(c, kind) for c in _causes(exc))


OUTAGE_ERRORS: tuple[type[Exception], ...] = (
    redis.exceptions.InvalidResponse,
    redis.ConnectionError,
    redis.TimeoutError,
    redis.ReadOnlyError,
    redis.exceptions.NoPermissionError,
    OSError,
)
"""What a Redis call may raise when the broker is away (or denies the call, or is no
Redis at all: a typo'd port that reaches another server); :func:`broker_error` sorts
them.  ``BusyLoadingError`` is a ``ConnectionError``."""


def redis_client(url: str, *, connect_timeout_s: float = 5.0) -> redis.Redis:
    """A connection to ``url`` for the reply path: decoded replies, no hidden retries.

    redis-py retries a failed command up to 10 times by default; here it does
    not, so that an outage reaches the one retry loop that handles it
    (``ServiceClient``) at once.  (A pooled connection that died with a
    restarted server is still replaced silently: the pool checks it before
    use.)  The host's name is resolved within ``connect_timeout_s`` too
    (:mod:`bso.wire.resolve`).  Every command is short (no blocking pops), so a read timeout of
    ``connect_timeout_s`` as well turns a hung server into an error, not a hang.
    A URL redis-py cannot parse raises :class:`InvalidBrokerUrl`.
    """
    check_redis_url(url)
    options: dict[str, Any] = {}
    connection_class = resolving_class(url)  # the host lookup within the timeout too
    if connection_class is not None:
        options["connection_class"] = connection_class
    return redis.Redis.from_url(
        url,
        **options,
        decode_responses=True,
        socket_connect_timeout=connect_timeout_s,
        socket_timeout=connect_timeout_s,
        retry=Retry(NoBackoff(), 0),
    )


def namespace_of_url(url: str) -> Namespace:
    """The namespace a client of ``url`` publishes and hears replies in: its tenant's
    when the URL's user is a tenant's (``bso keys create`` hands those out), the
    shared one for the ``bso-client`` user of earlier deployments."""
    try:
        user = urlsplit(url).username
    except ValueError:
        user = None
    return namespace_of_user(unquote(user) if user else None)
