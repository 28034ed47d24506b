"""A caller facing no worker says so within seconds; facing a worker, it waits for it.

Worker nodes announce themselves in Redis (``bso_workers.presence``); the caller
reads the announcement once a reply is late (``bso_client.worker_presence``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from bso.errors import ServiceUnavailable
from bso.wire import keys
from bso.wire.connection import BrokerUnreachable
from bso_client.transport import ServiceClient
from bso_client.worker_presence import NO_WORKER_CHECK_S
from bso_workers.presence import PresenceBeacon
from bso_workers.supervision import free_port
from tests.fixtures.celery_workers import WorkerCluster
from tests.test_transport import SPEC, make_client


def alive_value(url: str) -> tuple[str | None, int]:
    """The key's value and its TTL in seconds (-2: no key)."""
    client = redis.Redis.from_url(url, decode_responses=True)
    try:
        value = client.get(keys.WORKERS_ALIVE_KEY)
        return (None if value is None else str(value)), int(client.ttl(keys.WORKERS_ALIVE_KEY))
    finally:
        client.close()


# -- the workers' side ---------------------------------------------------------------------


def test_a_beacon_refreshes_the_key_and_lets_it_expire_once_stopped(redis_url: str) -> None:
    beacon = PresenceBeacon(redis_url, "n1@host", interval_s=0.2, ttl_s=1)
    beacon.start()
    try:
        value, ttl = alive_value(redis_url)
        assert value is not None
        assert value.startswith("n1@host ")
        assert 0 < ttl <= 1
        time.sleep(1.5)  # longer than the TTL: only the refreshes keep it
        assert alive_value(redis_url)[0] is not None
    finally:
        beacon.stop()
    time.sleep(1.5)
    assert alive_value(redis_url) == (None, -2)


def test_a_beacon_outlives_an_unreachable_redis_and_says_so_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    beacon = PresenceBeacon(f"redis://:pw@127.0.0.1:{free_port()}/0", "n1@host")
    with caplog.at_level(logging.WARNING, "bso_workers.presence"):
        assert beacon.announce() is False
        assert beacon.announce() is False
    beacon.stop()
    (warning,) = caplog.records
    assert "cannot announce worker n1@host" in warning.getMessage()
    assert ":pw@" not in warning.getMessage()


def test_a_beacon_refreshes_more_often_than_its_key_expires() -> None:
    with pytest.raises(ValueError, match="interval_s < ttl_s"):
        PresenceBeacon("redis://127.0.0.1:1/0", "n1@host", interval_s=10, ttl_s=10)
    assert keys.WORKERS_ALIVE_REFRESH_S * 3 <= keys.WORKERS_ALIVE_TTL_S


# -- the caller's side ---------------------------------------------------------------------


def test_with_no_worker_the_client_says_so_within_ten_seconds(redis_url: str) -> None:
    # The default timeout and retries: without the check this call would wait 70 s.
    with ServiceClient.connect(redis_url, api_key="bso_any", outage_window_s=0) as client:
        started = time.monotonic()
        with pytest.raises(ServiceUnavailable) as caught:
            client.register(SPEC)
        elapsed = time.monotonic() - started
    assert NO_WORKER_CHECK_S <= elapsed < 10
    assert not isinstance(caught.value, BrokerUnreachable)
    message = str(caught.value)
    assert message.startswith(f"no bso worker is running at {redis_url}")
    assert "start `bso up`" in message


def test_a_worker_that_announced_itself_is_waited_for(redis_url: str) -> None:
    # Announced but not consuming (busy): the call waits out its timeout as before.
    client_of_redis = redis.Redis.from_url(redis_url)
    client_of_redis.set(keys.WORKERS_ALIVE_KEY, "busy@host", ex=60)
    client_of_redis.close()
    with ServiceClient.connect(redis_url, timeout_s=4, retries=0, outage_window_s=0) as client:
        started = time.monotonic()
        with pytest.raises(ServiceUnavailable, match="no reply after waiting 4 s"):
            client.register(SPEC)
        assert time.monotonic() - started >= 4


def test_with_a_worker_the_client_gets_its_answer(
    worker_cluster_factory: Callable[..., WorkerCluster], tmp_path: Path
) -> None:
    cluster = worker_cluster_factory(f"sqlite:///{tmp_path / 'bso.sqlite3'}")
    value, ttl = alive_value(cluster.settings.broker_url)
    assert value is not None  # the node announced itself when it became ready
    assert 0 < ttl <= keys.WORKERS_ALIVE_TTL_S
    client = cluster.client(timeout_s=10, retries=0)
    assert client.register(SPEC).created
    assert client.next_trial("job").batch_size == SPEC.default_batch_size


def test_the_client_asks_every_slice_and_stops_at_the_first_no() -> None:
    answers = [True, None, False]

    class Scripted:
        asked = 0

        def alive(self) -> bool | None:
            Scripted.asked += 1
            return answers[Scripted.asked - 1]

    client, publisher = make_client(
        deliver=lambda _: 0, timeout_s=5, retries=0, presence=Scripted(), no_worker_check_s=0.05
    )
    with pytest.raises(ServiceUnavailable, match="no bso worker is running at inline"):
        client.register(SPEC)
    assert Scripted.asked == 3  # a yes and a cannot-tell keep it waiting
    assert len(publisher.sent) == 1  # found out within the first attempt
