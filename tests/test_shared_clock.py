"""Every worker node on one clock (bso_workers/shared_clock.py): leases measured
between two nodes' readings do not depend on a node's clock being minutes off."""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import redis

from bso.core.vocabulary import TrialStatus
from bso.errors import NoFeasibleBatchSize
from bso.service import BsoService
from bso.spec import JobSpec
from bso.storage.base import Store
from bso.storage.memory import MemoryStore
from bso_workers.settings import WorkerSettings
from bso_workers.shared_clock import RESYNC_S, SharedClock, redis_clock
from bso_workers.tasks import WorkerRuntime
from tests.test_storage_contract import sqlite_store

T0 = datetime(2026, 1, 1, tzinfo=UTC)
SPEC = JobSpec(
    job_id="job",
    batch_sizes=[16, 32, 64],
    default_batch_size=32,
    target_metric=0.9,
    max_epochs=10,
    mab_seed=1,
)


class World:
    """Real time passing, a Redis server's clock, and nodes whose own clocks are off.
    A round trip to the server takes no time here."""

    def __init__(self) -> None:
        self.elapsed_s = 0.0
        self.server_offset = timedelta(0)
        self.server_down = False

    def advance(self, **delta: float) -> None:
        self.elapsed_s += timedelta(**delta).total_seconds()

    def server_time(self) -> tuple[int, int]:
        if self.server_down:
            raise redis.ConnectionError("Connection refused")
        now = T0 + self.server_offset + timedelta(seconds=self.elapsed_s)
        seconds = int(now.timestamp())
        return seconds, now.microsecond

    def node_clock(self, local_offset: timedelta = timedelta(0)) -> SharedClock:
        """A node's service clock; its own wall clock is ``local_offset`` off."""
        return SharedClock(
            self.server_time,
            monotonic=lambda: 1000.0 + self.elapsed_s,  # any origin: only differences count
            local_now=lambda: T0 + local_offset + timedelta(seconds=self.elapsed_s),
        )


def test_a_node_within_the_tolerance_keeps_its_own_clock_exactly() -> None:
    """Nodes on one host (or kept by NTP) read their clock as it is: corrected by a
    round trip's error, they would disagree by milliseconds and lose the order of
    their commits."""
    world = World()
    world.server_offset = timedelta(milliseconds=400)
    clock = world.node_clock()
    assert clock() == T0
    assert clock.offset == timedelta(0)


def test_a_node_whose_clock_is_off_reads_redis_time_with_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    world = World()
    with caplog.at_level(logging.WARNING, "bso_workers.shared_clock"):
        clock = world.node_clock(local_offset=-timedelta(minutes=2))
        assert clock() == T0
        world.advance(seconds=30)
        assert clock() == T0 + timedelta(seconds=30)
        world.advance(seconds=RESYNC_S)
        assert clock() == T0 + timedelta(seconds=30 + RESYNC_S)  # measured again: the same
    [warning] = caplog.records
    assert "this node's clock is 120.0 s behind the Redis server's" in warning.getMessage()


def test_a_step_of_the_nodes_clock_is_corrected_at_the_next_measure() -> None:
    world = World()
    steps = {"local": timedelta(0)}
    clock = SharedClock(
        world.server_time,
        monotonic=lambda: world.elapsed_s,
        local_now=lambda: T0 + steps["local"] + timedelta(seconds=world.elapsed_s),
    )
    assert clock() == T0
    steps["local"] = timedelta(hours=2)  # NTP steps it, a VM is restored
    world.advance(seconds=RESYNC_S)
    assert clock() == T0 + timedelta(seconds=RESYNC_S)


def test_an_offset_hovering_at_the_tolerance_does_not_flip_the_correction() -> None:
    """A node 1.05 s behind is corrected; measured again at 0.95 s (drift, a round
    trip), it stays corrected (dropping the correction would step its clock back by a
    second) until its own clock agrees within a tenth of the tolerance."""
    world = World()
    local = {"offset": timedelta(seconds=-1.05)}
    clock = SharedClock(
        world.server_time,
        monotonic=lambda: world.elapsed_s,
        local_now=lambda: T0 + local["offset"] + timedelta(seconds=world.elapsed_s),
    )
    readings = [clock()]
    for offset_s in (-0.95, -1.02, -0.5, -0.05):
        local["offset"] = timedelta(seconds=offset_s)
        world.advance(seconds=RESYNC_S)
        readings.append(clock())
        if offset_s != -0.05:
            assert clock.offset == -local["offset"]  # still corrected: Redis time
    assert clock.offset == timedelta(0)  # within a tenth: its own clock again
    assert readings == [T0 + timedelta(seconds=i * RESYNC_S) for i in range(4)] + [
        T0 + timedelta(seconds=4 * RESYNC_S - 0.05)
    ]


def test_an_unreadable_server_keeps_the_last_offset_with_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    world = World()
    clock = world.node_clock(local_offset=timedelta(days=1))
    assert clock() == T0
    world.server_down = True
    with caplog.at_level(logging.WARNING, "bso_workers.shared_clock"):
        for _ in range(3):
            world.advance(seconds=RESYNC_S)
            clock()
    assert clock() == T0 + timedelta(seconds=3 * RESYNC_S)  # not the node's own, a day off
    [warning] = [r for r in caplog.records if "cannot read" in r.getMessage()]
    assert "cannot read the Redis server's clock (ConnectionError" in warning.getMessage()


def test_a_node_that_never_read_the_server_uses_its_own_clock() -> None:
    world = World()
    world.server_down = True
    clock = world.node_clock(local_offset=timedelta(minutes=5))
    assert clock() == T0 + timedelta(minutes=5)
    world.server_down = False
    world.advance(seconds=RESYNC_S)
    assert clock() == T0 + timedelta(seconds=RESYNC_S)


@pytest.fixture(params=["memory", "sqlite"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    return MemoryStore() if request.param == "memory" else sqlite_store(tmp_path)


def test_a_node_whose_clock_is_behind_does_not_get_live_trials_swept(store: Store) -> None:
    """Node B's own clock is 2 minutes behind node A's (another host, a VM restored from
    a snapshot).  B handles a run's heartbeats (every 30 s, lease 90 s), A runs the
    sweep.  On their own clocks B's heartbeat of a moment ago looks 2 minutes old to
    A, which ended the live trial as ``heartbeat_timeout``; on Redis's they agree."""
    world = World()
    sweeper = BsoService(store, clock=world.node_clock())
    behind = BsoService(store, clock=world.node_clock(-timedelta(minutes=2)))
    behind.register(SPEC)
    trial = behind.next_trial("job", lease_s=90.0)
    for _ in range(6):
        world.advance(seconds=30)
        assert behind.heartbeat("job", trial.trial_number).status is TrialStatus.RUNNING
        assert sweeper.interrupt_stale_trials(timedelta(hours=6)) == []
    world.advance(seconds=91)  # the run dies: its lease runs out on every node alike
    assert sweeper.interrupt_stale_trials(timedelta(hours=6)) == [("job", trial.trial_number)]


def test_a_skewed_node_no_longer_rules_out_every_size() -> None:
    """The same skew over twelve recurrences (each run converging at its first epoch)
    used to end every run's trial while it heartbeated; three interruptions in a row
    count as a failure of the size, and the job ended ``stuck`` with
    ``NoFeasibleBatchSize`` until an operator reset it."""
    world = World()
    store = MemoryStore()
    sweeper = BsoService(store, clock=world.node_clock())
    behind = BsoService(store, clock=world.node_clock(-timedelta(minutes=2)))
    sweeper.register(SPEC)
    for recurrence in range(12):
        try:
            trial = sweeper.next_trial("job", lease_s=90.0)
        except NoFeasibleBatchSize as err:
            pytest.fail(f"recurrence {recurrence}: {err.message}")
        world.advance(seconds=30)
        behind.heartbeat("job", trial.trial_number)
        assert sweeper.interrupt_stale_trials(timedelta(hours=6)) == []
        decision = behind.report_epoch(
            "job", trial.trial_number, epoch=1, time_s=10.0, energy_j=100.0, metric=0.95
        )
        assert decision.converged, decision  # the run's own end, not the sweep's
        world.advance(days=1)


def test_redis_clock_reads_the_servers_time(redis_url: str) -> None:
    clock = redis_clock(redis_url)
    seconds, micros = redis.Redis.from_url(redis_url).time()
    server_now = datetime.fromtimestamp(seconds, UTC) + timedelta(microseconds=micros)
    assert abs(clock() - server_now) < timedelta(seconds=2)


def test_a_worker_runtimes_service_keeps_redis_time(redis_url: str) -> None:
    runtime = WorkerRuntime(
        WorkerSettings(_env_file=None, broker_url=redis_url), store_factory=MemoryStore
    )
    try:
        assert isinstance(runtime.service.clock, SharedClock)
    finally:
        runtime.close()
    local = WorkerRuntime(
        WorkerSettings(_env_file=None, broker_url="memory://"), store_factory=MemoryStore
    )
    assert not isinstance(local.service.clock, SharedClock)  # no Redis: its own clock


def test_closing_a_worker_runtime_frees_its_clocks_connection(redis_url: str) -> None:
    released: list[bool] = []
    world = World()
    runtime = WorkerRuntime(
        WorkerSettings(_env_file=None, broker_url=redis_url),
        store_factory=MemoryStore,
        clock_factory=lambda: SharedClock(world.server_time, release=lambda: released.append(True)),
    )
    runtime.service.clock()
    assert released == []
    runtime.close()
    assert released == [True]
