"""The broker's host is resolved within the connect timeout (bso.wire.resolve)."""

from __future__ import annotations

import socket
import time
from typing import Any

import pytest
import redis

from bso.wire.connection import redis_client

HUNG = "bso-broker.hung-dns.test"
MAPPED = "bso-broker.mapped.test"


@pytest.fixture(autouse=True)
def _resolver(monkeypatch: pytest.MonkeyPatch) -> None:
    """A resolver that hangs 5 s on ``HUNG`` (a DNS server that does not answer) and
    maps ``MAPPED`` to the loopback address."""
    real = socket.getaddrinfo

    def getaddrinfo(host: str, *args: Any, **kwargs: Any) -> Any:
        if host == HUNG:
            time.sleep(5)
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return real("127.0.0.1" if host == MAPPED else host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)


@pytest.mark.parametrize("scheme", ["redis", "rediss"])
def test_a_hung_resolver_costs_one_connect_timeout_not_its_own(scheme: str) -> None:
    """redis-py's socket timeouts do not cover getaddrinfo: a client behind a DNS
    server that did not answer waited the resolver out at every connection (20 s and
    more with the C library's retries), many times the fail-open bound of a call."""
    client = redis_client(f"{scheme}://{HUNG}:6379/0", connect_timeout_s=0.3)
    started = time.monotonic()
    with pytest.raises(redis.ConnectionError, match=f"resolving {HUNG} took longer than 0.3 s"):
        client.ping()
    assert time.monotonic() - started < 2


def test_a_resolved_name_connects_and_keeps_its_name(redis_url: str) -> None:
    client = redis_client(redis_url.replace("127.0.0.1", MAPPED), connect_timeout_s=2)
    assert client.ping()
    connection = client.connection_pool.get_connection()
    assert connection.host == MAPPED  # messages (and TLS verification) see the name
    client.connection_pool.release(connection)


def test_a_refused_address_still_reads_as_an_outage() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
    client = redis_client(f"redis://{MAPPED}:{port}/0", connect_timeout_s=1)
    with pytest.raises(redis.ConnectionError, match=f"connecting to {MAPPED}:{port}"):
        client.ping()
