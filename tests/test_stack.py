"""The stack's configuration: what it refuses before it starts anything."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from bso_workers.data_dir_lock import LOCK_FILE, DataDirInUse, lock_data_dir
from bso_workers.redis_server import MIN_BULK_BYTES, max_bulk_bytes
from bso_workers.stack import Stack, StackConfig, check_concurrency, describe_pool, start_redis
from bso_workers.supervision import MAX_WORKER_RESTARTS, ManagedProcess, free_port


def test_a_solo_node_runs_one_process() -> None:
    check_concurrency("solo", 1)
    check_concurrency("prefork", 4)
    with pytest.raises(ValueError, match="--concurrency 2 needs --pool prefork"):
        check_concurrency("solo", 2)
    with pytest.raises(ValueError, match="needs --pool prefork"):
        StackConfig(pool="solo", concurrency=3)


def test_the_pool_is_described_as_the_processes_it_runs() -> None:
    assert describe_pool(StackConfig()) == "solo pool: one process each"
    assert describe_pool(StackConfig(pool="prefork", concurrency=1)) == (
        "prefork pool: 1 process each"
    )
    assert describe_pool(StackConfig(pool="prefork", concurrency=4)) == (
        "prefork pool: 4 processes each"
    )


def test_a_second_stack_on_a_held_data_folder_is_refused_before_it_touches_anything(
    tmp_path: Path,
) -> None:
    data = tmp_path / "data"
    lock = lock_data_dir(data, "bso up")
    try:
        data.chmod(0o755)
        stack = Stack(StackConfig(data_dir=data, owner="bso demo"))
        with pytest.raises(DataDirInUse, match=r"^bso up already runs from "):
            stack.start()
        assert sorted(p.name for p in data.iterdir()) == [LOCK_FILE]  # no credentials, no db
        assert data.stat().st_mode & 0o777 == 0o755
        assert not stack.processes
        stack.stop()  # as the commands do after a failed start: the holder keeps its lock
        assert lock.held
        with pytest.raises(DataDirInUse):
            Stack(StackConfig(data_dir=data)).start()
    finally:
        lock.release()


def test_redis_refuses_a_string_longer_than_the_workers_could_need(tmp_path: Path) -> None:
    """A team's user may LPUSH any string onto its queue, and a worker reads a popped
    item whole before refusing it as too large: Redis's default limit, 512 MB, let a
    team make each worker hold a gigabyte.  bso's Redis refuses the push instead."""
    port = free_port()
    users = ["--user", "default", "on", "nopass", "~*", "&*", "+@all"]
    process = start_redis(tmp_path, "127.0.0.1", port, extra_args=users, max_item_bytes=2**20)
    client = redis.Redis(port=port)
    try:
        limit = max_bulk_bytes(2**20)
        assert limit == MIN_BULK_BYTES
        assert client.config_get("proto-max-bulk-len") == {"proto-max-bulk-len": str(limit)}
        assert client.lpush("bso:broker:bso.events.t.team", b"x" * limit) == 1
        with pytest.raises(redis.RedisError):
            client.lpush("bso:broker:bso.events.t.team", b"x" * (limit + 1))
    finally:
        client.close()
        process.stop()
    assert max_bulk_bytes(8 * 2**20) == 32 * 2**20


class FakeProcess(ManagedProcess):
    """A child that is alive until told to die; nothing to signal."""

    def __init__(self, name: str) -> None:
        super().__init__(name, None, Path("/dev/null"))  # type: ignore[arg-type]
        self.exited = False

    def alive(self) -> bool:
        return not self.exited

    def signal_group(self, signum: int) -> None:
        pass


def test_two_nodes_dying_at_once_are_both_started_again_and_stop_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Seen with bso up on a full disk: both nodes hit Redis's MISCONF and exited 1 a
    few ms apart; worker2 was started again, and worker1, dead by the time the
    supervisor asked what had died, was taken for a child that brings the service
    down: 'worker1 exited (1); stopping the rest'."""
    stack = Stack(StackConfig())
    worker1, worker2, redis = FakeProcess("worker1"), FakeProcess("worker2"), FakeProcess("redis")
    stack.processes = [worker1, worker2, redis]

    def start_worker(name: str) -> FakeProcess:
        worker1.exited = True  # dies while worker2 is being replaced
        return FakeProcess(name)

    monkeypatch.setattr(stack, "_start_worker", start_worker)
    worker2.exited = True
    assert stack.restart_dead_workers() == [worker2]
    assert stack.dead() == []
    assert stack.restart_dead_workers() == [worker1]
    redis.exited = True
    assert stack.dead() == [redis]


def test_a_node_past_its_restarts_brings_the_service_down(monkeypatch: pytest.MonkeyPatch) -> None:
    stack = Stack(StackConfig())
    stack.processes = [FakeProcess("worker1")]
    monkeypatch.setattr(stack, "_start_worker", FakeProcess)
    for _ in range(MAX_WORKER_RESTARTS):
        stack.processes[0].exited = True  # type: ignore[attr-defined]
        assert len(stack.restart_dead_workers()) == 1
    stack.processes[0].exited = True  # type: ignore[attr-defined]
    assert stack.restart_dead_workers() == []
    assert stack.dead() == stack.processes
