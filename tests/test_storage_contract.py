"""One contract for every store: memory, SQLite, PostgreSQL and MariaDB behave the same.

The memory store is the reference; the SQL store must round-trip every field
exactly and must never change a decision of the service.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import numpy as np
import pytest

from bso.apikeys import ApiKeyRecord, TenantLimits, job_key
from bso.core.micro_batch import Timings
from bso.core.vocabulary import StopReason, TrialPhase, TrialStatus
from bso.service import BsoService, restore_rng
from bso.spec import BatchPlan, Hardware, JobSpec
from bso.status import JobStatus
from bso.storage import JobRecord, JobTransaction, LaneRecord, MemoryStore, Store, TrialRecord
from bso.storage.base import StoredReply
from bso.storage.sql import SqlStore
from bso.storage.sql.engine import upgrade
from bso.wire.events import (
    DeleteJob,
    EndTrial,
    EpochDecision,
    EpochReport,
    Event,
    NextTrial,
    RegisterJob,
    Reply,
    TrialAssigned,
    TrialEnded,
)

T0 = datetime(2026, 1, 1, 12, 0, 0, 123456, tzinfo=UTC)
PLUS_TWO = timezone(timedelta(hours=2))
CPU = Hardware()
A100 = Hardware(gpu_model="NVIDIA A100-SXM4-80GB", gpu_count=8, max_power_w=400.0)


class RollbackProbeError(Exception):
    """Raised inside a transaction to force a rollback."""


def fail_inside(store: Store, job_id: str, body: Callable[[JobTransaction], object]) -> None:
    """Run ``body`` in a transaction that then raises, and check the error got out."""

    def run() -> None:
        with store.transaction(job_id) as tx:
            body(tx)
            raise RollbackProbeError

    with pytest.raises(RollbackProbeError):
        run()


def make_spec(job_id: str, **changes: object) -> JobSpec:
    fields: dict[str, object] = {
        "job_id": job_id,
        "batch_sizes": [16, 32, 64, 128],
        "default_batch_size": 32,
        "target_metric": 0.9,
        "mab_seed": 11,
    }
    return JobSpec.model_validate(fields | changes)


def sqlite_store(directory: Path) -> SqlStore:
    url = f"sqlite:///{directory / 'bso.db'}"
    upgrade(url)
    return SqlStore(url)


@pytest.fixture(
    params=[
        pytest.param("memory"),
        pytest.param("sqlite"),
        pytest.param("postgres", marks=pytest.mark.postgres),
        pytest.param("mariadb", marks=pytest.mark.mysql),
    ]
)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    built: Store
    if request.param == "memory":
        built = MemoryStore()
    elif request.param == "sqlite":
        built = sqlite_store(tmp_path)
    else:
        built = SqlStore(request.getfixturevalue(f"fresh_{request.param}_url"))
    yield built
    built.close()


def create(store: Store, job_id: str, trials: int = 0, hardware: Hardware = CPU) -> None:
    with store.transaction(job_id) as tx:
        tx.create_job(make_spec(job_id), T0)
        for _ in range(trials):
            tx.add_trial(hardware.key, 32, TrialPhase.EXPLORATION, T0)


# -- jobs -----------------------------------------------------------------------------


def test_create_and_get_job(store: Store) -> None:
    spec = make_spec("job-a", hardware=A100, beta_knob=None, eta_knob=0.3)
    created_at = T0.astimezone(PLUS_TWO)
    with store.transaction("job-a") as tx:
        assert tx.get_job() is None
        record = tx.create_job(spec, created_at)
        assert tx.get_job() == record == JobRecord("job-a", spec, created_at)
    with store.transaction("job-a") as tx:
        job = tx.get_job()
    assert job == JobRecord("job-a", spec, T0)
    assert job.spec.config_fingerprint() == spec.config_fingerprint()


def test_job_ids_are_sorted_by_code_point_and_only_registered(store: Store) -> None:
    for job_id in ("beta", "Gamma", "alpha", "doomed"):
        create(store, job_id)
    with store.transaction("never-registered") as tx:
        assert tx.get_job() is None
    with store.transaction("doomed") as tx:
        assert tx.delete_job()
    assert store.job_ids() == ["Gamma", "alpha", "beta"]


def test_the_longest_job_key_keeps_its_job_lanes_trials_and_replies(store: Store) -> None:
    """A tenant of 64 characters with a job id of 128: a key of 193 (job ids are per
    tenant, bso.apikeys.job_key), where every job_id column held 128 before 0009."""
    key = job_key("t" * 64, "j" * 128)
    assert len(key) == 193
    with store.transaction(key) as tx:
        tx.create_job(make_spec("j" * 128), T0, owner="t" * 64)
        tx.save_lane(LaneRecord(CPU))
        tx.add_trial(CPU.key, 32, TrialPhase.EXPLORATION, T0)
        tx.record_reply("e1", StoredReply("{}", None, "t" * 64), T0)
    with store.transaction(key) as tx:
        job = tx.get_job()
        assert job is not None
        assert job.job_id == key
        assert job.spec.job_id == "j" * 128
        assert tx.public_job_id == "j" * 128
        assert [t.job_id for t in tx.trials()] == [key]
        assert tx.get_lane(CPU.key) == LaneRecord(CPU)
        assert tx.recorded_reply("e1") == StoredReply("{}", None, "t" * 64)
    assert store.job_ids() == [key]
    assert [a.job_id for a in store.jobs_of("t" * 64, 10)] == [key]


# -- trials ---------------------------------------------------------------------------


def test_add_trial_numbers_per_job_and_orders_trials(store: Store) -> None:
    create(store, "a")
    create(store, "b")
    with store.transaction("a") as tx:
        first = tx.add_trial(CPU.key, 16, TrialPhase.EXPLORATION, T0)
        second = tx.add_trial(CPU.key, 32, TrialPhase.CONCURRENT, T0)
    with store.transaction("b") as tx:
        assert tx.add_trial(CPU.key, 64, TrialPhase.EXPLORATION, T0).trial_number == 1
    later = T0 + timedelta(minutes=5)
    with store.transaction("a") as tx:
        third = tx.add_trial(A100.key, 128, TrialPhase.EXPLOITATION, later)
    assert (first.trial_number, second.trial_number, third.trial_number) == (1, 2, 3)
    assert third == TrialRecord("a", 3, A100.key, 128, TrialPhase.EXPLOITATION, later, later)
    assert third.status is TrialStatus.RUNNING
    with store.transaction("a") as tx:
        assert tx.trials() == [first, second, third]
        assert tx.trials(CPU.key) == [first, second]
        assert tx.trials(A100.key) == [third]
        assert tx.trials("TPU x1") == []
        assert tx.get_trial(2) == second
        assert tx.get_trial(4) is None
    with store.transaction("b") as tx:
        assert [t.trial_number for t in tx.trials()] == [1]


def test_save_trial_round_trips_every_field(store: Store) -> None:
    create(store, "a", trials=1)
    with store.transaction("a") as tx:
        original = tx.get_trial(1)
    assert original is not None
    ended = original.replace(
        hardware_key=A100.key,
        batch_size=128,
        phase=TrialPhase.EXPLOITATION,
        created_at=T0 - timedelta(days=400),
        updated_at=(T0 + timedelta(hours=3, microseconds=7)).astimezone(PLUS_TWO),
        status=TrialStatus.FAILED,
        epochs=41,
        time_s=0.1 + 0.2,
        energy_j=1e-300,
        cost=123456.78901234567,
        last_metric=-1 / 3,
        stop_reason=StopReason.COST_BOUND,
        current_batch_size=256,
    )
    with store.transaction("a") as tx:
        tx.save_trial(ended)
    with store.transaction("a") as tx:
        loaded = tx.get_trial(1)
    assert loaded == ended
    assert loaded is not None
    assert loaded.phase is TrialPhase.EXPLOITATION
    assert loaded.status is TrialStatus.FAILED
    assert loaded.stop_reason is StopReason.COST_BOUND

    converged = ended.replace(status=TrialStatus.CONVERGED, stop_reason=None, last_metric=None)
    with store.transaction("a") as tx:
        tx.save_trial(converged)
    with store.transaction("a") as tx:
        assert tx.trials() == [converged]


def test_save_trial_of_unknown_number_raises(store: Store) -> None:
    create(store, "a", trials=1)
    with store.transaction("a") as tx:
        trial = tx.get_trial(1)
        assert trial is not None
        with pytest.raises(KeyError):
            tx.save_trial(trial.replace(trial_number=2))


# -- lanes ----------------------------------------------------------------------------


def test_lanes_round_trip_a_numpy_generator_state(store: Store) -> None:
    generator = np.random.Generator(np.random.PCG64(2**100 + 5))
    generator.random(3)
    state = dict(generator.bit_generator.state)
    assert state["state"]["state"] >= 2**64  # a 128-bit integer: must not become a float
    create(store, "a")
    with store.transaction("a") as tx:
        assert tx.get_lane(A100.key) is None
        tx.save_lane(LaneRecord(A100, state))
        tx.save_lane(LaneRecord(CPU))
    with store.transaction("a") as tx:
        lane = tx.get_lane(A100.key)
        assert tx.get_lane(CPU.key) == LaneRecord(CPU, None)
    assert lane == LaneRecord(A100, state)
    restored = restore_rng(lane.rng_state, seed=None)
    assert restored.random(5).tolist() == generator.random(5).tolist()

    with store.transaction("a") as tx:
        tx.save_lane(LaneRecord(A100, dict(generator.bit_generator.state), 7))
    with store.transaction("a") as tx:
        assert tx.get_lane(A100.key) == LaneRecord(A100, dict(generator.bit_generator.state), 7)


def test_lanes_keep_their_own_batch_plan(store: Store) -> None:
    create(store, "a")
    plan = BatchPlan(batch_sizes=[16, 48, 96], default_batch_size=48, micro_batch_size=8, devices=2)
    with store.transaction("a") as tx:
        tx.save_lane(LaneRecord(A100, None, 0, plan))
    with store.transaction("a") as tx:
        assert tx.get_lane(A100.key) == LaneRecord(A100, None, 0, plan)
        tx.save_lane(LaneRecord(A100, {"seed": 1}, 3, plan))  # a decision keeps it
    with store.read("a") as tx:
        lane = tx.get_lane(A100.key)
    assert lane is not None
    assert lane.plan == plan


# -- replies --------------------------------------------------------------------------


def test_replies_are_recorded_and_looked_up(store: Store) -> None:
    create(store, "a")
    reply = StoredReply('{"kind": "x", "n": 1}', "ab" * 32, "team-a")
    with store.transaction("a") as tx:
        assert tx.recorded_reply("e1") is None
        tx.record_reply("e1", reply, T0)
        assert tx.recorded_reply("e1") == reply
    with store.transaction("a") as tx:
        assert tx.recorded_reply("e1") == reply
        assert tx.recorded_reply("e2") is None


def test_event_ids_are_per_job(store: Store) -> None:
    """The same event id in two jobs is two events, each with its own reply."""
    create(store, "a")
    create(store, "b")
    with store.transaction("a") as tx:
        tx.record_reply("e1", StoredReply("of-a"), T0)
    with store.transaction("b") as tx:
        assert tx.recorded_reply("e1") is None
        tx.record_reply("e1", StoredReply("of-b"), T0)
    with store.transaction("a") as tx:
        assert tx.recorded_reply("e1") == StoredReply("of-a")


def test_prune_replies_forgets_only_older_replies_of_deleted_jobs(store: Store) -> None:
    create(store, "live")
    with store.transaction("live") as tx:
        tx.record_reply("old", StoredReply("{}"), T0)
    with store.transaction("gone") as tx:
        for minute in range(3):
            tx.record_reply(f"e{minute}", StoredReply("{}"), T0 + timedelta(minutes=minute))
    assert store.prune_replies(T0) == 0
    assert store.prune_replies((T0 + timedelta(minutes=1)).astimezone(PLUS_TWO)) == 1
    with store.transaction("gone") as tx:
        assert [tx.recorded_reply(f"e{m}") is None for m in range(3)] == [True, False, False]
    assert store.prune_replies(T0 + timedelta(hours=1)) == 2
    # A job's replies live as long as the job, however old.
    with store.transaction("live") as tx:
        assert tx.recorded_reply("old") == StoredReply("{}")


def test_a_job_keeps_its_owner(store: Store) -> None:
    with store.transaction("a") as tx:
        tx.create_job(make_spec("a"), T0, owner="team-a")
    with store.transaction("a") as tx:
        job = tx.get_job()
        assert job is not None
        assert job.owner == "team-a"
    with store.read("a") as reader:
        job = reader.get_job()
        assert job is not None
        assert job.owner == "team-a"


def test_api_keys_are_added_listed_and_revoked(store: Store) -> None:
    first = ApiKeyRecord("0123456789ab", "team-a", "c" * 64, T0)
    second = ApiKeyRecord("ba9876543210", "team-b", "d" * 64, T0 + timedelta(minutes=1))
    store.add_api_key(second)
    store.add_api_key(first)
    assert store.get_api_key("0123456789ab") == first
    assert store.get_api_key("ffffffffffff") is None
    assert store.api_keys() == [first, second]
    later = (T0 + timedelta(hours=1)).astimezone(PLUS_TWO)
    assert store.revoke_api_key(first.key_id, later) is True
    assert store.revoke_api_key(first.key_id, later) is False
    assert store.revoke_api_key("ffffffffffff", later) is False
    revoked = store.get_api_key(first.key_id)
    assert revoked is not None
    assert revoked.revoked_at == later
    assert store.get_api_key(second.key_id) == second


def test_a_tenant_keeps_the_limits_it_was_given_until_they_are_reset(store: Store) -> None:
    assert store.tenant_limits() == {}
    store.set_tenant_limits("team-b", TenantLimits(max_queue=10, per_second=2))
    store.set_tenant_limits("team-a", TenantLimits(max_queue=50_000, per_second=1))
    store.set_tenant_limits("team-b", TenantLimits(max_queue=20, per_second=3))
    assert store.tenant_limits() == {
        "team-a": TenantLimits(50_000, 1),
        "team-b": TenantLimits(20, 3),
    }
    store.set_tenant_limits("team-a", None)
    store.set_tenant_limits("team-c", None)  # had none: nothing to reset
    assert store.tenant_limits() == {"team-b": TenantLimits(20, 3)}


# -- atomicity ------------------------------------------------------------------------


def test_exception_rolls_back_a_new_job_without_trace(store: Store) -> None:
    def body(tx: JobTransaction) -> None:
        tx.create_job(make_spec("a"), T0)
        tx.add_trial(CPU.key, 32, TrialPhase.EXPLORATION, T0)
        tx.save_lane(LaneRecord(CPU, {"seed": 1}))
        tx.record_reply("e1", StoredReply("{}"), T0)

    fail_inside(store, "a", body)
    with store.transaction("a") as tx:
        assert tx.get_job() is None
        assert tx.trials() == []
        assert tx.get_lane(CPU.key) is None
        assert tx.recorded_reply("e1") is None
    assert store.job_ids() == []
    assert store.stale_trials(T0 + timedelta(days=1), timedelta(0)) == []


def test_exception_rolls_back_changes_to_an_existing_job(store: Store) -> None:
    create(store, "a", trials=1)
    with store.transaction("a") as tx:
        before = tx.trials()

    def body(tx: JobTransaction) -> None:
        assert tx.add_trial(CPU.key, 64, TrialPhase.EXPLORATION, T0).trial_number == 2
        tx.save_trial(before[0].replace(status=TrialStatus.CONVERGED, epochs=3))
        tx.save_lane(LaneRecord(CPU, {"seed": 2}))
        tx.record_reply("e1", StoredReply("{}"), T0)

    fail_inside(store, "a", body)
    fail_inside(store, "a", lambda tx: tx.delete_job())
    with store.transaction("a") as tx:
        assert tx.get_job() is not None
        assert tx.trials() == before
        assert tx.get_lane(CPU.key) is None
        assert tx.recorded_reply("e1") is None
        # The counter was rolled back too: the number is handed out again.
        assert tx.add_trial(CPU.key, 64, TrialPhase.EXPLORATION, T0).trial_number == 2


# -- deletion -------------------------------------------------------------------------


def test_delete_job_removes_trials_and_lanes_but_keeps_replies(store: Store) -> None:
    create(store, "a", trials=2)
    create(store, "b", trials=1)
    with store.transaction("a") as tx:
        tx.save_lane(LaneRecord(CPU, {"seed": 1}))
        tx.record_reply("reply-of-a", StoredReply('{"a": 1}'), T0)
    with store.transaction("a") as tx:
        assert tx.delete_job() is True
        assert tx.get_job() is None
        assert tx.trials() == []
        assert tx.get_lane(CPU.key) is None
    with store.transaction("a") as tx:
        assert tx.get_job() is None
        assert tx.trials() == []
        assert tx.get_lane(CPU.key) is None
        assert tx.recorded_reply("reply-of-a") == StoredReply('{"a": 1}')
        assert tx.delete_job() is False
    assert store.job_ids() == ["b"]
    assert store.stale_trials(T0 + timedelta(days=1), timedelta(0)) == [("b", 1)]
    with store.transaction("b") as tx:
        assert [t.trial_number for t in tx.trials()] == [1]
    # A job registered again under the same id starts over, but numbers its trials on
    # from the deleted job's: a run of the deleted one names no trial of the new one.
    with store.transaction("a") as tx:
        assert tx.first_trial_number() == 3
    with store.transaction("b") as tx:
        assert tx.first_trial_number() == 1
    create(store, "a", trials=1)
    with store.read("a") as reader:
        assert reader.first_trial_number() == 3
    with store.transaction("a") as tx:
        assert [t.trial_number for t in tx.trials()] == [3]
        assert tx.get_trial(1) is None
        assert tx.delete_job() is True
        tx.create_job(make_spec("a"), T0)
        assert tx.add_trial(CPU.key, 16, TrialPhase.EXPLORATION, T0).trial_number == 4
    with store.transaction("a") as tx:
        assert [t.trial_number for t in tx.trials()] == [4]
    # Ids are exact: another case is another job, with a count of its own.
    create(store, "A", trials=1)
    with store.transaction("A") as tx:
        assert [t.trial_number for t in tx.trials()] == [1]
    # Deleted twice: the count still goes on.
    with store.transaction("a") as tx:
        assert tx.delete_job() is True
    create(store, "a", trials=1)
    with store.transaction("a") as tx:
        assert [t.trial_number for t in tx.trials()] == [5]


# -- maintenance scans ----------------------------------------------------------------


def test_stale_trials_lists_running_trials_silent_since_the_cutoff(store: Store) -> None:
    create(store, "a", trials=3)
    create(store, "b", trials=1)
    with store.transaction("a") as tx:
        _, two, three = tx.trials()
        tx.save_trial(two.replace(updated_at=T0 + timedelta(seconds=10)))
        tx.save_trial(three.replace(status=TrialStatus.CONVERGED))
    with store.transaction("b") as tx:
        (only,) = tx.trials()
        tx.save_trial(only.replace(updated_at=T0 + timedelta(seconds=5)))
    lease = timedelta(seconds=30)
    assert store.stale_trials(T0 + lease, lease) == []
    assert store.stale_trials(T0 + lease + timedelta(seconds=6), lease) == [("a", 1), ("b", 1)]
    # The time's timezone does not matter, only the instant.
    now = (T0 + lease + timedelta(seconds=6)).astimezone(PLUS_TWO)
    assert store.stale_trials(now, lease) == [("a", 1), ("b", 1)]
    later = T0 + timedelta(hours=1)
    assert store.stale_trials(later, lease) == [("a", 1), ("a", 2), ("b", 1)]


def test_a_trial_with_its_own_lease_is_stale_by_that_lease(store: Store) -> None:
    create(store, "a", trials=2)
    with store.transaction("a") as tx:
        short, long = tx.trials()
        tx.save_trial(short.replace(lease_s=60.0))
        tx.save_trial(long.replace(lease_s=7200.0))
    with store.transaction("a") as tx:
        assert [t.lease_s for t in tx.trials()] == [60.0, 7200.0]
    hours = timedelta(hours=6)
    assert store.stale_trials(T0 + timedelta(seconds=60), hours) == []
    assert store.stale_trials(T0 + timedelta(seconds=61), hours) == [("a", 1)]
    # A lease longer than the default still counts: the caller promised it.
    assert store.stale_trials(T0 + timedelta(hours=1, seconds=1), timedelta(minutes=1)) == [
        ("a", 1)
    ]
    assert store.stale_trials(T0 + timedelta(hours=2, seconds=1), hours) == [("a", 1), ("a", 2)]


# -- lock-free reads ------------------------------------------------------------------


def test_read_shows_what_a_transaction_shows(store: Store) -> None:
    create(store, "a", trials=2)
    with store.transaction("a") as tx:
        tx.add_trial(A100.key, 64, TrialPhase.EXPLORATION, T0)
        tx.save_lane(LaneRecord(A100, {"seed": 3}))
    with store.transaction("a") as tx:
        job, everything, of_a100 = tx.get_job(), tx.trials(), tx.trials(A100.key)
        second, lane = tx.get_trial(2), tx.get_lane(A100.key)
    with store.read("a") as view:
        assert view.job_id == "a"
        assert view.get_job() == job
        assert view.trials() == everything
        assert view.trials(A100.key) == of_a100
        assert view.get_trial(2) == second
        assert view.get_trial(9) is None
        assert view.get_lane(A100.key) == lane
        assert view.get_lane(CPU.key) is None
    with store.read("never-registered") as view:
        assert view.get_job() is None
        assert view.trials() == []
    assert store.job_ids() == ["a"]


def test_read_neither_waits_for_a_transaction_nor_sees_its_work(store: Store) -> None:
    create(store, "a", trials=1)
    with store.read("a") as view:
        before = view.trials()
    # Same thread: a read that took the job's lock would deadlock (or time out).
    with store.transaction("a") as tx:
        tx.add_trial(CPU.key, 64, TrialPhase.EXPLORATION, T0)
        with store.read("a") as view:
            assert view.trials() == before
    with store.read("a") as view:
        assert len(view.trials()) == 2


def test_read_is_one_snapshot_that_lets_transactions_commit(store: Store) -> None:
    create(store, "a", trials=1)
    with store.read("a") as view:
        before = view.trials()
        with store.transaction("a") as tx:
            tx.add_trial(CPU.key, 64, TrialPhase.EXPLORATION, T0)
            tx.save_lane(LaneRecord(CPU, {"seed": 4}))
        # Committed meanwhile, but the view stays on the state it opened on.
        assert view.trials() == before
        assert view.get_trial(2) is None
        assert view.get_lane(CPU.key) is None
    with store.read("a") as view:
        assert [t.trial_number for t in view.trials()] == [1, 2]
        assert view.get_lane(CPU.key) == LaneRecord(CPU, {"seed": 4})


# -- concurrency within one process ---------------------------------------------------


def test_threads_register_once_and_number_trials_contiguously(store: Store) -> None:
    threads, per_thread = 6, 5
    barrier = threading.Barrier(threads)
    created: list[bool] = []
    numbers: list[int] = []
    errors: list[BaseException] = []

    def work() -> None:
        try:
            barrier.wait()
            with store.transaction("shared") as tx:
                is_new = tx.get_job() is None
                if is_new:
                    tx.create_job(make_spec("shared"), T0)
            created.append(is_new)
            for _ in range(per_thread):
                with store.transaction("shared") as tx:
                    numbers.append(
                        tx.add_trial(CPU.key, 32, TrialPhase.EXPLORATION, T0).trial_number
                    )
        except BaseException as error:
            errors.append(error)

    pool = [threading.Thread(target=work) for _ in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    assert errors == []
    assert sorted(created) == [False] * (threads - 1) + [True]
    assert sorted(numbers) == list(range(1, threads * per_thread + 1))


# -- the service on top of each store -------------------------------------------------


def tick_clock() -> Callable[[], datetime]:
    """A clock advancing one second per reading, identical for every store."""
    ticks = iter(range(10**9))
    return lambda: T0 + timedelta(seconds=next(ticks))


def run_recurrences(store: Store) -> tuple[list[Reply], JobStatus]:
    """A scripted life of one job: every reply in order, and the status at the end."""
    service = BsoService(store, clock=tick_clock())
    events: list[Event] = []
    replies: list[Reply] = []

    def send(event: Event) -> Reply:
        reply = service.handle(event)
        assert reply.kind != "error", reply
        events.append(event)
        replies.append(reply)
        return reply

    spec = make_spec("recurring", beta_knob=3.0, mab_num_explorations=1)
    send(RegisterJob(spec=spec, event_id="register"))
    for recurrence in range(8):
        hardware = A100 if recurrence % 3 == 2 else None
        trial = send(
            NextTrial(job_id="recurring", hardware=hardware, event_id=f"next-{recurrence}")
        )
        assert isinstance(trial, TrialAssigned)
        size = trial.batch_size
        for epoch in range(1, 30):
            decision = send(
                EpochReport(
                    job_id="recurring",
                    trial_number=trial.trial_number,
                    epoch=epoch,
                    time_s=epoch * (5.0 + abs(size - 48) / 8),
                    energy_j=epoch * (900.0 + size),
                    metric=min(1.0, epoch * (0.05 + 0.3 / (1 + abs(size - 48) / 16))),
                    event_id=f"epoch-{recurrence}-{epoch}",
                )
            )
            assert isinstance(decision, EpochDecision)
            # Recurrence 5 crashes after two epochs: its size counts as failed.
            if decision.stop or (recurrence == 5 and epoch == 2):
                break
        send(
            EndTrial(
                job_id="recurring", trial_number=trial.trial_number, event_id=f"end-{recurrence}"
            )
        )
    status = service.status("recurring")
    # Redelivered events get their recorded replies back and change nothing.
    for event, reply in list(zip(events, replies, strict=True))[::5]:
        assert service.handle(event) == reply
    assert service.status("recurring") == status
    deleted = send(DeleteJob(job_id="recurring", event_id="delete"))
    assert service.handle(events[-1]) == deleted
    return replies, status


def test_service_decides_the_same_on_every_store(store: Store) -> None:
    replies, status = run_recurrences(store)
    reference_replies, reference_status = run_recurrences(MemoryStore())
    assert replies == reference_replies
    assert status == reference_status
    # The script exercises what it should: both lanes, a crash, convergence, exploitation.
    assert {lane.hardware for lane in status.lanes} == {CPU, A100}
    assert any(isinstance(r, EpochDecision) and r.converged for r in replies)
    assert any(isinstance(r, TrialEnded) and r.reason is StopReason.ABANDONED for r in replies)
    assert any(isinstance(r, TrialAssigned) and r.phase is TrialPhase.EXPLOITATION for r in replies)


# -- what the metrics read -------------------------------------------------------------


def test_trial_tallies_count_every_job_by_status_and_reason(store: Store) -> None:
    create(store, "a", trials=3)
    create(store, "b", trials=1)
    with store.transaction("a") as tx:
        first, second, _ = tx.trials()
        tx.save_trial(
            first.replace(status=TrialStatus.CONVERGED, stop_reason=StopReason.TARGET_REACHED)
        )
        tx.save_trial(second.replace(status=TrialStatus.FAILED, stop_reason=StopReason.COST_BOUND))
    with store.transaction("b") as tx:
        (only,) = tx.trials()
        tx.save_trial(only.replace(epochs=2))
    assert store.trial_tallies() == {
        (TrialStatus.CONVERGED, StopReason.TARGET_REACHED): 1,
        (TrialStatus.FAILED, StopReason.COST_BOUND): 1,
        (TrialStatus.RUNNING, None): 2,
    }


def test_recently_active_jobs_newest_first_and_capped(store: Store) -> None:
    for job_id in ("old", "new", "middle"):
        create(store, job_id, trials=1)
    create(store, "idle")  # no trial yet: nothing to show
    for job_id, hours in (("old", 1), ("middle", 2), ("new", 3)):
        with store.transaction(job_id) as tx:
            (trial,) = tx.trials()
            tx.save_trial(trial.replace(updated_at=T0 + timedelta(hours=hours)))
    assert store.recently_active_jobs(10) == ["new", "middle", "old"]
    assert store.recently_active_jobs(2) == ["new", "middle"]


# -- bso jobs: reset and the tenant's job list ------------------------------------------


def test_forget_finished_trials_keeps_running_ones_and_the_numbering(store: Store) -> None:
    create(store, "a", trials=3)
    with store.transaction("a") as tx:
        first, second, third = tx.trials()
        tx.save_trial(first.replace(status=TrialStatus.FAILED, stop_reason=StopReason.MAX_EPOCHS))
        tx.save_trial(
            second.replace(status=TrialStatus.INTERRUPTED, stop_reason=StopReason.INTERRUPTED)
        )
        tx.save_lane(
            LaneRecord(CPU, {"state": 1}, 2, BatchPlan(batch_sizes=[8], default_batch_size=8))
        )
    with store.transaction("a") as tx:
        assert tx.forget_finished_trials() == 2
        assert tx.trials() == [third]
    fail_inside(store, "a", lambda tx: tx.forget_finished_trials())
    with store.transaction("a") as tx:
        assert tx.trials() == [third]
        assert tx.forget_finished_trials() == 0
        assert tx.add_trial(CPU.key, 16, TrialPhase.EXPLORATION, T0).trial_number == 4
        lane = tx.get_lane(CPU.key)
        job = tx.get_job()
    assert lane is not None
    assert lane.plan == BatchPlan(batch_sizes=[8], default_batch_size=8)
    assert lane.rng_state == {"state": 1}
    assert job is not None
    assert job.spec == make_spec("a")


def test_jobs_of_lists_one_tenants_jobs_most_recent_first(store: Store) -> None:
    with store.transaction("mine-old") as tx:
        tx.create_job(make_spec("mine-old"), T0, owner="team-a")
        trial = tx.add_trial(A100.key, 32, TrialPhase.EXPLORATION, T0)
        tx.save_trial(
            trial.replace(status=TrialStatus.CONVERGED, updated_at=T0 + timedelta(hours=1))
        )
        tx.add_trial(CPU.key, 16, TrialPhase.EXPLORATION, T0 + timedelta(minutes=5))
    with store.transaction("mine-new") as tx:
        tx.create_job(make_spec("mine-new"), T0 + timedelta(hours=2), owner="team-a")
    with store.transaction("theirs") as tx:
        tx.create_job(make_spec("theirs"), T0 + timedelta(hours=3), owner="team-b")
    mine = store.jobs_of("team-a", 10)
    assert [j.job_id for j in mine] == ["mine-new", "mine-old"]
    new, old = mine
    assert (new.trials, new.running_trials, new.lanes) == (0, 0, (CPU.key,))
    assert new.last_activity == T0 + timedelta(hours=2)
    assert (old.trials, old.running_trials) == (2, 1)
    assert old.lanes == tuple(sorted((A100.key, CPU.key)))
    assert old.last_activity == T0 + timedelta(hours=1)
    assert store.jobs_of("team-a", 1) == [new]
    assert [j.job_id for j in store.jobs_of("team-b", 10)] == ["theirs"]
    assert store.jobs_of("nobody", 10) == []


def test_a_detached_trial_round_trips_and_new_trials_are_not_detached(store: Store) -> None:
    # Revision 0005: a run delivered from a client's journal after an outage.
    create(store, "a", trials=2)
    with store.transaction("a") as tx:
        first = tx.get_trial(1)
        assert first is not None
        assert not first.detached
        tx.save_trial(first.replace(detached=True, status=TrialStatus.CONVERGED, epochs=3))
    with store.read("a") as tx:
        assert [t.detached for t in tx.trials()] == [True, False]


def test_a_trials_micro_batch_timings_round_trip(store: Store) -> None:
    # Revision 0007: the micro-batch exploration a run made (bso.core.micro_batch).
    create(store, "a", trials=2)
    explored = ((8, Timings(4, -2.25, 0.0125)), (16, Timings(3, -2.5, 0.0)))
    with store.transaction("a") as tx:
        first = tx.get_trial(1)
        assert first is not None
        assert first.micro_batches == ()
        tx.save_trial(first.replace(micro_batches=explored))
    with store.read("a") as tx:
        assert [t.micro_batches for t in tx.trials()] == [explored, ()]
