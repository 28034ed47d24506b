"""Name resolution of the broker's host within the connect timeout.

redis-py bounds a connection with ``socket_connect_timeout``, but it resolves the
host with :func:`socket.getaddrinfo` first, and no socket timeout applies to
that: a machine whose DNS server does not answer (a VPN that dropped, a
resolver behind a firewall) waits out the C library's own retries, 5 s a try,
often 20 s or more, for every connection.  A fail-open run's calls are bounded
to one ``unavailable_bound_s`` each (:mod:`bso_client.fail_open`), and one hung
lookup per connection multiplied that bound several times (a 1-second run took a
minute behind a resolver that hung 20 s).  The connections here resolve in a
helper thread and give up at the connect timeout, raising a
:class:`socket.gaierror` that redis-py reports as a connection error (an outage
the caller rides out).  Concurrent lookups of one host share one thread, so a hung
resolver costs one thread per host at a time, not one per attempt.
"""

from __future__ import annotations

import socket
import threading
from typing import Any

import redis

Address = tuple[Any, ...]
"""One :func:`socket.getaddrinfo` entry."""

_lookups: dict[tuple[str, int], _Lookup] = {}
_lock = threading.Lock()


class _Lookup:
    """One :func:`socket.getaddrinfo` call in flight, in a daemon thread."""

    def __init__(self, host: str, port: int) -> None:
        self.done = threading.Event()
        self.addresses: list[Address] = []
        self.error: OSError | None = None
        self._key = (host, port)
        threading.Thread(target=self._run, name="bso-resolve", daemon=True).start()

    def _run(self) -> None:
        try:
            self.addresses = socket.getaddrinfo(*self._key, 0, socket.SOCK_STREAM)
        except OSError as err:
            self.error = err
        finally:
            self.done.set()
            with _lock:
                if _lookups.get(self._key) is self:
                    del _lookups[self._key]


def resolve_within(host: str, port: int, timeout_s: float | None) -> list[str]:
    """The addresses of ``host``, numeric, or a :class:`socket.gaierror` once
    ``timeout_s`` passed without an answer (None: wait as long as the resolver does)."""
    with _lock:
        lookup = _lookups.get((host, port))
        if lookup is None:
            lookup = _lookups[(host, port)] = _Lookup(host, port)
    if not lookup.done.wait(timeout_s):
        raise socket.gaierror(
            socket.EAI_AGAIN, f"resolving {host} took longer than {timeout_s:g} s (DNS)"
        )
    if lookup.error is not None:
        raise lookup.error
    return list(dict.fromkeys(str(entry[4][0]) for entry in lookup.addresses))


class ResolvingConnection(redis.Connection):
    """A TCP connection whose host lookup counts against ``socket_connect_timeout``.

    The numeric addresses found are tried in turn by redis-py's own connect (its
    socket options, its errors), with the host name put back afterwards, so that
    messages and TLS verification see the name."""

    def _connect(self) -> socket.socket:
        host = self.host
        addresses = resolve_within(host, self.port, self.socket_connect_timeout)
        failure: OSError | None = None
        try:
            for address in addresses:
                self.host = address
                try:
                    sock: socket.socket = super()._connect()  # type: ignore[no-untyped-call]
                except OSError as err:  # the next address, as socket.create_connection
                    failure = err
                    continue
                return sock
        finally:
            self.host = host
        raise failure or socket.gaierror(socket.EAI_NONAME, f"no address for {host}")


class ResolvingSSLConnection(redis.SSLConnection, ResolvingConnection):
    """:class:`ResolvingConnection` under TLS: the socket comes from it, the TLS
    wrapping (with the host name restored) from :class:`redis.SSLConnection`."""


def resolving_class(url: str) -> type[redis.Connection] | None:
    """The connection class for ``url``: None for a Unix socket (no lookup)."""
    scheme = url.split("://", 1)[0].lower()
    return {"redis": ResolvingConnection, "rediss": ResolvingSSLConnection}.get(scheme)
