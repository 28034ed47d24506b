"""The reply path needs no right that would let a client take other clients' events.

On Redis 6.2 (the embedded server; no ACL selectors) a client user gets
LPUSH on the events queue and GET/GETDEL on reply keys, nothing else; a whole
round trip works with that, and the commands that read or take from the
events queue are refused.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from bso.apikeys import DEFAULT_TENANT
from bso.errors import ServiceUnavailable
from bso.storage.memory import MemoryStore
from bso.wire import keys
from bso.wire.connection import BrokerUnreachable
from bso.wire.replies import RedisReplyBackend
from bso_client.transport import ServiceClient
from bso_client.worker_presence import WorkerPresence
from bso_workers.settings import WorkerSettings
from bso_workers.stack import start_redis
from bso_workers.supervision import ManagedProcess, free_port
from bso_workers.tasks import WorkerRuntime
from bso_workers.tenant_keys import create_key
from tests.fixtures.celery_publisher import CeleryPublisher
from tests.test_broker_outage import QUEUE, run_event
from tests.test_transport import SPEC

CLIENT_ACL = [
    "--user", "default", "on", "nopass", "~*", "&*", "+@all",
    "--user", "bso-client", "on", ">client-pw", "resetkeys",
    f"~{keys.REPLY_PREFIX}*", f"~{QUEUE}", "-@all", "+lpush", "+get", "+getdel",
]  # fmt: skip


@pytest.fixture
def acl_redis(tmp_path: Path) -> Iterator[tuple[ManagedProcess, int]]:
    port = free_port()
    process = start_redis(tmp_path, "127.0.0.1", port, extra_args=CLIENT_ACL)
    try:
        yield process, port
    finally:
        process.stop()


def test_a_client_with_only_lpush_and_getdel_completes_a_call(
    acl_redis: tuple[ManagedProcess, int],
) -> None:
    _, port = acl_redis
    admin_url = f"redis://127.0.0.1:{port}/0"
    client_url = f"redis://bso-client:client-pw@127.0.0.1:{port}/0"
    store = MemoryStore()
    runtime = WorkerRuntime(
        WorkerSettings(_env_file=None),
        store_factory=lambda: store,
        replies_factory=lambda: RedisReplyBackend(admin_url),
    )
    admin = redis.Redis.from_url(admin_url)

    def one_worker_step() -> None:
        popped = admin.brpop([QUEUE], timeout=30)
        assert popped is not None
        run_event(runtime, popped[1])

    worker = threading.Thread(target=one_worker_step)
    worker.start()
    try:
        api_key = create_key(store, DEFAULT_TENANT)
        with ServiceClient.connect(
            client_url, api_key=api_key, timeout_s=30, outage_window_s=0
        ) as client:
            assert client.register(SPEC).created
    finally:
        worker.join()
        runtime.close()
        admin.close()
    assert store.job_ids() == ["job"]


@pytest.mark.parametrize(
    "command",
    [("BLPOP", QUEUE, 1), ("LPOP", QUEUE), ("LRANGE", QUEUE, 0, -1), ("KEYS", "*")],
)
def test_the_client_user_cannot_read_or_take_the_events_queue(
    acl_redis: tuple[ManagedProcess, int], command: tuple[object, ...]
) -> None:
    _, port = acl_redis
    client = redis.Redis.from_url(f"redis://bso-client:client-pw@127.0.0.1:{port}/0")
    try:
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.execute_command(*command)
    finally:
        client.close()


def test_a_client_that_may_not_read_whether_workers_run_waits_as_before(
    acl_redis: tuple[ManagedProcess, int],
) -> None:
    # This ACL predates keys.WORKERS_ALIVE_KEY: no "no worker" verdict, the timeout decides.
    _, port = acl_redis
    url = f"redis://bso-client:client-pw@127.0.0.1:{port}/0"
    with ServiceClient.connect(url, timeout_s=3, retries=0, outage_window_s=0) as client:
        assert isinstance(client.presence, WorkerPresence)
        assert client.presence.alive() is None
        with pytest.raises(ServiceUnavailable, match="no reply after waiting 3 s"):
            client.register(SPEC)


def test_a_denied_command_is_not_waited_out(acl_redis: tuple[ManagedProcess, int]) -> None:
    _, port = acl_redis
    # A user without GETDEL: the refusal is final, so it is no outage.
    url = f"redis://bso-client:client-pw@127.0.0.1:{port}/0"
    admin = redis.Redis(port=port)
    admin.execute_command("ACL", "SETUSER", "bso-client", "-getdel")
    admin.close()
    with (
        ServiceClient.connect(url, timeout_s=30, outage_window_s=600) as client,
        pytest.raises(ServiceUnavailable, match="denied a command") as caught,
    ):
        client.register(SPEC)
    assert not isinstance(caught.value, BrokerUnreachable)
    assert "client-pw" not in str(caught.value)


def test_celery_publisher_sorts_an_outage_from_wrong_credentials(
    acl_redis: tuple[ManagedProcess, int],
) -> None:
    _, port = acl_redis
    wrong = CeleryPublisher(f"redis://bso-client:not-it@127.0.0.1:{port}/0", connect_timeout_s=1)
    away = CeleryPublisher(f"redis://127.0.0.1:{free_port()}/0", connect_timeout_s=1)
    try:
        with pytest.raises(ServiceUnavailable, match="credentials") as refused:
            wrong.publish(keys.TASK_NEXT_TRIAL, "{}", "e.1")
        assert not isinstance(refused.value, BrokerUnreachable)
        assert "not-it" not in str(refused.value)
        with pytest.raises(BrokerUnreachable):
            away.publish(keys.TASK_NEXT_TRIAL, "{}", "e.1")
    finally:
        wrong.close()
        away.close()
