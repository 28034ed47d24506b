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
from urllib.parse import unquote_plus, urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from bso.errors import ServiceUnavailable


class BrokerUnreachable(ServiceUnavailable):
    """Redis could not be reached or cannot serve now: the caller may send again.

    Raised for a refused, reset or timed-out connection, for Redis still
    loading its append-only file after a restart, and for a read-only replica
    (a failover in progress).  Not for refused credentials or a command the
    ACL denies, nor for a TLS certificate that fails verification: those do
    not go away by waiting.
    """


def broker_error(url: str, exc: Exception) -> ServiceUnavailable:
    """The error to raise for ``exc``, a Redis or socket error talking to ``url``.

    :class:`BrokerUnreachable` for what an outage looks like, a plain
    :class:`ServiceUnavailable` for what waiting does not cure.  The message
    names the URL with its password masked.
    """
    where = redact_url(url)
    if _caused_by(exc, (redis.AuthenticationError, redis.exceptions.AuthorizationError)):
        return ServiceUnavailable(f"Redis at {where} refused the client's credentials: {exc}")
    if _caused_by(exc, redis.exceptions.NoPermissionError):
        return ServiceUnavailable(f"Redis at {where} denied a command to this user: {exc}")
    if _caused_by(exc, ssl.SSLCertVerificationError):
        return ServiceUnavailable(f"Redis at {where} presented a certificate that failed: {exc}")
    return BrokerUnreachable(
        f"cannot reach the bso broker at {where}: {exc} "
        "(is the service running? `bso up` starts one)"
    )


def _caused_by(
    exc: BaseException, kind: type[BaseException] | tuple[type[BaseException], ...]
) -> bool:
    """Whether ``exc`` or an exception it was raised from or during is a ``kind``
    (redis-py wraps socket and TLS errors in its ``ConnectionError``, kombu
    wraps redis-py's errors in its ``OperationalError``)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, kind):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False


OUTAGE_ERRORS: tuple[type[Exception], ...] = (
    redis.ConnectionError,
    redis.TimeoutError,
    redis.ReadOnlyError,
    redis.exceptions.NoPermissionError,
    OSError,
)
"""What a Redis call may raise when the broker is away (or denies the call);
:func:`broker_error` sorts them.  ``BusyLoadingError`` is a ``ConnectionError``."""


def redact_url(url: str) -> str:
    """``url`` with its secrets replaced, fit for error messages and logs.

    Both places a URL can carry a password are redacted: the user info
    (``redis://user:pw@host``) and the query, which redis-py and libpq also read
    a password from (``redis://host/0?password=pw``); a query parameter whose
    name mentions a password, secret, token or key has its value replaced, the
    rest is kept as written.  A URL that does not even parse is not shown at all.
    """
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:
        return "<a URL that does not parse, not shown>"
    netloc = parts.netloc
    if password is not None:
        netloc = netloc.replace(f":{password}@", ":***@", 1)
    params = parts.query.split("&") if parts.query else []
    for i, param in enumerate(params):
        name, sep, _ = param.partition("=")
        lowered = unquote_plus(name).lower()
        if sep and any(word in lowered for word in ("pass", "pwd", "secret", "token", "key")):
            params[i] = f"{name}=***"
    query = "&".join(params)
    if netloc == parts.netloc and query == parts.query:
        return url
    return urlunsplit(parts._replace(netloc=netloc, query=query))


def redis_client(url: str, *, connect_timeout_s: float = 5.0) -> redis.Redis:
    """A connection to ``url`` for the reply path: decoded replies, no hidden retries.

    redis-py retries a failed command up to 10 times by default; here it does
    not, so that an outage reaches the one retry loop that handles it
    (``ServiceClient``) at once.  (A pooled connection that died with a
    restarted server is still replaced silently: the pool checks it before
    use.)  Every command is short (no blocking pops), so a read timeout of
    ``connect_timeout_s`` as well turns a hung server into an error, not a hang.
    """
    return redis.Redis.from_url(
        url,
        decode_responses=True,
        socket_connect_timeout=connect_timeout_s,
        socket_timeout=connect_timeout_s,
        retry=Retry(NoBackoff(), 0),
    )
