"""The Celery tasks, run eagerly in-process over fakeredis.

The real worker processes are exercised by test_pipeline_integration.py, the
app's configuration by test_celery_app.py; here every branch of the task shell
is driven directly: valid events, every kind of bad payload, failures inside
the transaction, the order commit -> reply, redelivery, the status read and
the sweep; and the worker settings and log formats.
"""

from __future__ import annotations

import io
import json
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import fakeredis
import pytest
from celery import Celery
from pydantic import ValidationError
from sqlalchemy import create_engine, text
from sqlalchemy.exc import OperationalError

from bso.apikeys import DEFAULT_TENANT, ApiKeyRecord
from bso.core.vocabulary import StopReason, TrialStatus
from bso.errors import PoisonEvent, Unauthorized, UnknownJob
from bso.spec import JobSpec
from bso.storage.base import JobTransaction, Store
from bso.storage.memory import MemoryStore
from bso.storage.sql import SqlStore
from bso.storage.sql.engine import upgrade
from bso.wire import keys
from bso.wire.events import (
    REPLY_ADAPTER,
    DeleteJob,
    EndTrial,
    EpochReport,
    ErrorReply,
    JobDeleted,
    JobRegistered,
    NextTrial,
    RegisterJob,
    TrialAssigned,
)
from bso.wire.message import celery_message
from bso.wire.replies import RedisReplyBackend, StubReplyBackend
from bso.wire.status_query import StatusQuery, StatusReply
from bso_workers.celery_app import create_app
from bso_workers.deaths import RedisDeathCounter
from bso_workers.logs import JsonFormatter, KeyValueFormatter, configure_logging
from bso_workers.message_headers import api_key_of, reply_channel_of
from bso_workers.settings import WorkerSettings
from bso_workers.tasks import WorkerRuntime, process_event, process_status
from bso_workers.tenant_keys import create_key

SPEC = JobSpec(
    job_id="job", batch_sizes=[8, 16, 32], default_batch_size=16, target_metric=0.9, mab_seed=1
)


def settings(**overrides: Any) -> WorkerSettings:
    return WorkerSettings(_env_file=None, **overrides)


class Harness:
    """An eager app over a given store, with its replies in fakeredis."""

    def __init__(self, store: Store, **overrides: Any) -> None:
        self.settings = settings(**overrides)
        self.store = store
        self.redis = fakeredis.FakeRedis(server=fakeredis.FakeServer(), decode_responses=True)
        self.runtime = WorkerRuntime(
            self.settings,
            store_factory=lambda: store,
            replies_factory=lambda: RedisReplyBackend("redis://fake", client=self.redis),
            deaths_factory=lambda: RedisDeathCounter("redis://fake", client=self.redis),
        )
        self.app: Celery = create_app(self.settings, self.runtime)
        self.app.conf.task_always_eager = True
        self.app.conf.task_eager_propagates = True
        self.api_key: str | None = create_key(store, DEFAULT_TENANT)
        """Sent with every task; a test may replace it (or set None for no key)."""

    def send(self, task_name: str, payload: object) -> Any:
        headers = {keys.API_KEY_HEADER: self.api_key} if self.api_key is not None else {}
        return self.app.tasks[task_name].apply_async((payload,), headers=headers).get()

    def event(self, event: Any) -> Any:
        """Send a model event; return its one reply (parsed)."""
        self.send(keys.TASK_FOR_KIND[event.kind], event.model_dump_json())
        key = keys.reply_key_for(event.model_dump(mode="json"))
        assert key is not None
        text = self.redis.getdel(key)
        assert text is not None
        return REPLY_ADAPTER.validate_json(text)

    def reply_keys(self) -> list[str]:
        return sorted(str(k) for k in self.redis.keys(keys.REPLY_PREFIX + "*"))


@pytest.fixture
def harness() -> Harness:
    return Harness(MemoryStore())


# -- settings and logging ------------------------------------------------------------------


def test_settings_come_from_bso_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BSO_REPLY_TTL_S", "42")
    monkeypatch.setenv("BSO_DATABASE_URL", "sqlite:///elsewhere.db")
    monkeypatch.setenv("BSO_TASK_EVENTS", "false")
    loaded = settings()
    assert (loaded.reply_ttl_s, loaded.database_url, loaded.task_events) == (
        42,
        "sqlite:///elsewhere.db",
        False,
    )


def test_settings_round_trip_through_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    original = settings(heartbeat_timeout_s=12.5, task_events=False, log_format="json")
    for name, value in original.to_env().items():
        monkeypatch.setenv(name, value)
    assert settings() == original


def test_settings_reject_inconsistent_limits() -> None:
    with pytest.raises(ValidationError, match="soft_time_limit_s"):
        settings(soft_time_limit_s=10, time_limit_s=10)
    with pytest.raises(ValidationError, match="visibility_timeout_s"):
        settings(time_limit_s=60, visibility_timeout_s=30)


def _record(**extra: Any) -> logging.LogRecord:
    record = logging.LogRecord("bso.tasks", logging.INFO, __file__, 1, "event handled", None, None)
    record.__dict__.update(extra)
    return record


def test_key_value_log_lines_carry_the_extra_fields() -> None:
    line = KeyValueFormatter().format(_record(job_id="j 1", trial=3))
    assert 'msg="event handled"' in line
    assert 'job_id="j 1"' in line
    assert "trial=3" in line
    assert line.startswith("ts=")


def test_json_log_lines_parse() -> None:
    fields = json.loads(JsonFormatter().format(_record(job_id="j", trial=3)))
    assert (fields["msg"], fields["job_id"], fields["trial"], fields["level"]) == (
        "event handled",
        "j",
        3,
        "INFO",
    )


def test_configure_logging_installs_one_structured_handler() -> None:
    stream = io.StringIO()
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        configure_logging("INFO", "json", stream)
        logging.getLogger("bso.test").info("hello", extra={"n": 1})
        assert json.loads(stream.getvalue())["n"] == 1
    finally:
        root.handlers[:], _ = saved
        root.setLevel(saved[1])


# -- events through the tasks ----------------------------------------------------------


def test_events_are_applied_and_answered_on_their_keys(harness: Harness) -> None:
    assert harness.event(RegisterJob(spec=SPEC)).created
    trial = harness.event(NextTrial(job_id="job"))
    assert isinstance(trial, TrialAssigned)
    report = EpochReport(
        job_id="job", trial_number=1, epoch=1, time_s=1, energy_j=10, metric=0.95, event_id="ep"
    )
    harness.send(keys.TASK_EPOCH, report.model_dump_json())
    key = "bso:reply:job:1:ep"
    assert harness.reply_keys() == [key]
    assert 0 < harness.redis.ttl(key) <= harness.settings.reply_ttl_s
    assert harness.event(EndTrial(job_id="job", trial_number=1)).status == TrialStatus.CONVERGED


def test_a_redelivered_event_changes_state_once_and_answers_the_same(harness: Harness) -> None:
    harness.event(RegisterJob(spec=SPEC))
    payload = NextTrial(job_id="job", event_id="twice").model_dump_json()
    harness.send(keys.TASK_NEXT_TRIAL, payload)
    first = harness.redis.getdel("bso:reply:job:-:twice")
    harness.send(keys.TASK_NEXT_TRIAL, payload)
    second = harness.redis.getdel("bso:reply:job:-:twice")
    assert first is not None
    assert first == second
    with harness.store.transaction("job") as tx:
        assert len(tx.trials()) == 1


def test_a_dict_payload_is_accepted(harness: Harness) -> None:
    harness.send(keys.TASK_REGISTER, RegisterJob(spec=SPEC, event_id="d").model_dump(mode="json"))
    assert harness.reply_keys() == ["bso:reply:job:-:d"]


@pytest.mark.parametrize(
    "payload",
    ["not json", "[1, 2]", '{"kind": "epoch"}', '{"event_id": 3}', b"\xff\xfe", 42, None],
)
def test_a_payload_without_reply_key_is_logged_and_dropped(
    harness: Harness, payload: object, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, "bso.tasks"):
        assert harness.send(keys.TASK_EPOCH, payload) == "error code=invalid_event"  # Flower
    assert harness.reply_keys() == []
    assert "dropped an event without a reply key" in caplog.text


@pytest.mark.parametrize(
    ("task_name", "payload", "key", "why"),
    [
        (
            keys.TASK_EPOCH,
            {"event_id": "e1", "kind": "epoch", "job_id": "j", "trial_number": 2},
            "bso:reply:j:2:e1",
            "epoch: Field required",
        ),
        (
            keys.TASK_NEXT_TRIAL,
            {"event_id": "e2", "kind": "next_trial", "job_id": "j", "version": 2},
            "bso:reply:j:-:e2",
            "version",
        ),
        (keys.TASK_DELETE, {"event_id": "e3", "kind": "explode"}, "bso:reply:-:-:e3", "kind"),
        (
            keys.TASK_DELETE,
            {"event_id": "e4", "kind": "delete", "job_id": "j", "extra": 1},
            "bso:reply:j:-:e4",
            "extra: Extra inputs are not permitted",
        ),
        (
            keys.TASK_REGISTER,
            {"event_id": "e5", "kind": "delete", "job_id": "j"},
            "bso:reply:j:-:e5",
            "a delete event belongs to bso.delete, not bso.register",
        ),
        (
            keys.TASK_REGISTER,
            {"event_id": "e6", "kind": "register", "spec": {**SPEC.model_dump(), "eta_knob": 7}},
            "bso:reply:job:-:e6",
            "eta_knob must be within [0, 1]",
        ),
    ],
)
def test_an_invalid_event_gets_an_invalid_event_reply(
    harness: Harness, task_name: str, payload: dict[str, Any], key: str, why: str
) -> None:
    harness.send(task_name, json.dumps(payload))
    text = harness.redis.get(key)
    assert text is not None
    reply = REPLY_ADAPTER.validate_json(text)
    assert isinstance(reply, ErrorReply)
    assert reply.code == "invalid_event"
    assert reply.event_id == payload["event_id"]
    assert why in reply.message
    assert harness.store.job_ids() == []


def test_an_event_with_thousands_of_errors_gets_a_reply_and_a_log_line_of_a_few_of_them(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    """An event of 720 KB with 20,000 unknown fields (within the item limit): its reply
    and the worker's log line named every one, a megabyte each per event."""
    payload: dict[str, Any] = {"kind": "heartbeat", "event_id": "e-many", "job_id": "job"}
    payload["trial_number"] = 1
    payload.update({f"x{i:06d}": 0 for i in range(20_000)})
    with caplog.at_level(logging.WARNING, "bso.tasks"):
        harness.send(keys.TASK_HEARTBEAT, json.dumps(payload))
    text = harness.redis.get("bso:reply:job:1:e-many")
    assert text is not None
    reply = REPLY_ADAPTER.validate_json(text)
    assert isinstance(reply, ErrorReply)
    assert reply.code == "invalid_event"
    assert "heartbeat.x000000: Extra inputs are not permitted" in reply.message
    assert reply.message.endswith("; and 19995 more")
    assert len(reply.message) < 1000
    (record,) = [r for r in caplog.records if r.getMessage() == "rejected an invalid event"]
    assert len(str(record.__dict__)) < 2000


def test_a_spec_with_a_bool_and_a_megabyte_of_text_gets_a_short_reply_and_log_line(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    """JobSpec's bool refusal (before pydantic's checks) echoed the value whole: an event
    of 1 MB within the item limit, ``max_epochs: [true, "\\u007f" x 1e6]``, made a 5 MB
    reply and a 5 MB line of the worker's log."""
    spec = {**SPEC.model_dump(), "max_epochs": [True, "\x7f" * 1_000_000]}
    payload = {"event_id": "e-bool", "kind": "register", "spec": spec}
    with caplog.at_level(logging.WARNING, "bso.tasks"):
        harness.send(keys.TASK_REGISTER, json.dumps(payload, ensure_ascii=False))
    text = harness.redis.get("bso:reply:job:-:e-bool")
    assert text is not None
    reply = REPLY_ADAPTER.validate_json(text)
    assert isinstance(reply, ErrorReply)
    assert "max_epochs" in reply.message
    assert len(reply.message) < 1000
    (record,) = [r for r in caplog.records if r.getMessage() == "rejected an invalid event"]
    assert len(str(record.__dict__)) < 2000


class _Journal(MemoryStore):
    """Notes each commit in a shared journal, to check what happens after it."""

    def __init__(self, journal: list[str]) -> None:
        super().__init__()
        self.journal = journal

    @contextmanager
    def transaction(self, job_id: str) -> Iterator[JobTransaction]:
        with super().transaction(job_id) as tx:
            yield tx
        self.journal.append("commit")


class _JournalReplies(StubReplyBackend):
    def __init__(self, journal: list[str]) -> None:
        super().__init__()
        self.journal = journal

    def push(self, key: str, reply_json: str, ttl_s: int, announce_to: str | None = None) -> None:
        self.journal.append("push")
        super().push(key, reply_json, ttl_s, announce_to)


def test_the_reply_is_pushed_only_after_the_commit() -> None:
    journal: list[str] = []
    replies = _JournalReplies(journal)
    store = _Journal(journal)
    api_key = create_key(store, DEFAULT_TENANT)
    runtime = WorkerRuntime(
        settings(), store_factory=lambda: store, replies_factory=lambda: replies
    )
    app = create_app(settings(), runtime)
    app.conf.task_always_eager = True
    app.tasks[keys.TASK_REGISTER].apply_async(
        (RegisterJob(spec=SPEC).model_dump_json(),), headers={keys.API_KEY_HEADER: api_key}
    )
    assert journal == ["commit", "push"]


@pytest.fixture(params=["memory", "sqlite"])
def any_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    if request.param == "memory":
        yield MemoryStore()
        return
    url = f"sqlite:///{tmp_path / 'bso.sqlite3'}"
    upgrade(url)
    store = SqlStore(url)
    yield store
    store.close()


class _AtLastWrite(Store):
    """Wraps a store; its transactions run ``action`` at the very end, after every write."""

    def __init__(self, inner: Store, action: Callable[[], None]) -> None:
        self.inner = inner
        self.action = action

    @contextmanager
    def transaction(self, job_id: str) -> Iterator[JobTransaction]:
        with self.inner.transaction(job_id) as tx:

            def record_reply(*_: object) -> None:
                self.action()

            tx.record_reply = record_reply  # type: ignore[method-assign,assignment]
            yield tx

    def job_ids(self) -> list[str]:
        return self.inner.job_ids()

    def trial_tallies(self) -> dict[tuple[TrialStatus, StopReason | None], int]:
        return self.inner.trial_tallies()

    def recently_active_jobs(self, limit: int) -> list[str]:
        return self.inner.recently_active_jobs(limit)

    def stale_trials(self, now: Any, default_lease: Any) -> list[tuple[str, int]]:
        return self.inner.stale_trials(now, default_lease)

    def set_tenant_limits(self, tenant: str, limits: Any) -> None:
        self.inner.set_tenant_limits(tenant, limits)

    def tenant_limits(self) -> Any:
        return self.inner.tenant_limits()

    def prune_replies(self, recorded_before: Any) -> int:
        return self.inner.prune_replies(recorded_before)

    def add_api_key(self, record: ApiKeyRecord) -> None:
        self.inner.add_api_key(record)

    def get_api_key(self, key_id: str) -> ApiKeyRecord | None:
        return self.inner.get_api_key(key_id)

    def api_keys(self) -> list[ApiKeyRecord]:
        return self.inner.api_keys()

    def revoke_api_key(self, key_id: str, now: Any) -> bool:
        return self.inner.revoke_api_key(key_id, now)

    def close(self) -> None:
        self.inner.close()


@pytest.mark.parametrize(
    ("error", "code", "text"),
    [
        (
            RuntimeError("boom"),
            "bso_error",
            "internal error in the bso worker (RuntimeError)",
        ),
        (
            OperationalError("COMMIT", {}, Exception("database is locked")),
            "service_unavailable",
            "send the same event again",
        ),
    ],
)
def test_a_failure_inside_the_transaction_leaves_nothing_and_says_why(
    any_store: Store, error: Exception, code: str, text: str
) -> None:
    def fail() -> None:
        raise error

    harness = Harness(_AtLastWrite(any_store, fail))
    reply = harness.event(RegisterJob(spec=SPEC))
    assert isinstance(reply, ErrorReply)
    assert reply.code == code
    assert text in reply.message
    assert "nothing was applied" in reply.message
    assert any_store.job_ids() == []


def test_a_database_outage_tells_the_caller_to_resend_and_the_log_one_line_per_event(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The database stops answering mid-transaction (a real PostgreSQL driver's error,
    nothing listening): the reply names no host, port or SQL (the tenant's run sees
    it), and the operator's log gets the driver's one line per event, not a
    traceback each."""
    gone = create_engine("postgresql+psycopg://bso@127.0.0.1:1/bso")

    def lose_the_database() -> None:
        with gone.connect() as connection:
            connection.execute(text("SELECT 1"))

    harness = Harness(_AtLastWrite(MemoryStore(), lose_the_database))
    with caplog.at_level(logging.DEBUG, "bso.tasks"):
        replies = [harness.event(RegisterJob(spec=SPEC)) for _ in range(3)]
    for reply in replies:
        assert isinstance(reply, ErrorReply)
        assert reply.code == "service_unavailable"
        assert "database is unavailable" in reply.message
        assert "send the same event again" in reply.message
        assert "127.0.0.1" not in reply.message
        assert "SELECT" not in reply.message
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 3
    for record in warnings:
        assert record.levelno == logging.WARNING
        assert record.exc_info is None
        assert "(the caller sends it again): OperationalError: connection" in record.getMessage()
        assert "\n" not in record.getMessage()


def test_a_task_past_its_soft_time_limit_rolls_back_and_asks_for_a_retry(
    any_store: Store,
) -> None:
    harness = Harness(
        _AtLastWrite(any_store, lambda: time.sleep(30)), soft_time_limit_s=0.2, time_limit_s=60
    )
    started = time.monotonic()
    reply = harness.event(RegisterJob(spec=SPEC))
    assert time.monotonic() - started < 10
    assert isinstance(reply, ErrorReply)
    assert reply.code == "service_unavailable"
    assert "SoftTimeLimitExceeded" in reply.message
    assert any_store.job_ids() == []


def test_an_event_whose_worker_keeps_dying_is_dropped_as_poison(harness: Harness) -> None:
    event = NextTrial(job_id="job")
    key = keys.reply_key_for(event.model_dump(mode="json"))
    assert key is not None
    harness.event(RegisterJob(spec=SPEC))

    def deliver(*, redelivered: bool) -> object:
        process_event(
            harness.runtime,
            keys.TASK_NEXT_TRIAL,
            event.model_dump_json(),
            api_key=harness.api_key,
            redelivered=redelivered,
        )
        text = harness.redis.getdel(key)
        assert text is not None
        return REPLY_ADAPTER.validate_json(text)

    assert isinstance(deliver(redelivered=False), TrialAssigned)  # first deliveries: not counted
    assert harness.redis.get(keys.deaths_key(event.event_id)) is None
    assert isinstance(deliver(redelivered=True), TrialAssigned)  # 1 death: runs (a replay)
    poison = deliver(redelivered=True)  # 2 deaths = BSO_MAX_WORKER_DEATHS: dropped
    assert isinstance(poison, ErrorReply)
    assert poison.code == PoisonEvent.code
    assert "died 2 times" in poison.message
    assert harness.redis.ttl(keys.deaths_key(event.event_id)) > 0
    with harness.store.transaction("job") as tx:
        assert len(tx.trials()) == 1  # the dropped delivery applied nothing


def test_a_tenants_forged_redeliveries_count_no_death_against_another_tenants_event(
    harness: Harness,
) -> None:
    """Event ids are the senders' choice and a message may say it was redelivered: a
    tenant sending another's event id marked so, past the death limit, must not make
    that tenant's own (really) redelivered event poison."""
    event = NextTrial(job_id="job")
    key = keys.reply_key_for(event.model_dump(mode="json"))
    assert key is not None
    harness.event(RegisterJob(spec=SPEC))
    team_b = keys.tenant_namespace("team-b")
    for _ in range(3):
        process_event(
            harness.runtime,
            keys.TASK_NEXT_TRIAL,
            event.model_dump_json(),
            api_key=create_key(harness.store, "team-b"),
            redelivered=True,
            namespace=team_b,
        )
    forged = harness.redis.getdel(team_b.reply_key_for(event.model_dump(mode="json")) or "")
    assert forged is not None
    assert json.loads(forged)["code"] == PoisonEvent.code  # team-b's own copy: dropped
    process_event(
        harness.runtime,
        keys.TASK_NEXT_TRIAL,
        event.model_dump_json(),
        api_key=harness.api_key,
        redelivered=True,
    )
    text = harness.redis.getdel(key)
    assert text is not None
    assert isinstance(REPLY_ADAPTER.validate_json(text), TrialAssigned)  # 1 death of its own


# -- status and sweep --------------------------------------------------------------------


def test_status_reads_the_recommendation(harness: Harness) -> None:
    harness.event(RegisterJob(spec=SPEC))
    harness.event(NextTrial(job_id="job"))
    harness.send(keys.TASK_STATUS, json.dumps({"event_id": "s1", "job_id": "job"}))
    text = harness.redis.get("bso:reply:job:-:s1")
    assert text is not None
    status = StatusReply.model_validate_json(text).status
    assert status.lanes[0].running_trials == 1


@pytest.mark.parametrize(
    ("payload", "code"),
    [({"event_id": "s2", "job_id": "nope"}, "unknown_job"), ({"event_id": "s2"}, "invalid_event")],
)
def test_status_errors_are_replies(harness: Harness, payload: dict[str, str], code: str) -> None:
    harness.send(keys.TASK_STATUS, json.dumps(payload))
    (key,) = harness.reply_keys()
    reply = REPLY_ADAPTER.validate_json(harness.redis.get(key) or "null")
    assert isinstance(reply, ErrorReply)
    assert reply.code == code


def test_sweep_interrupts_silent_trials_and_prunes_old_replies() -> None:
    harness = Harness(MemoryStore(), heartbeat_timeout_s=0.05, reply_retention_s=0.05)
    harness.event(RegisterJob(spec=SPEC))
    harness.event(NextTrial(job_id="job"))
    time.sleep(0.1)
    summary = harness.app.tasks[keys.TASK_SWEEP].delay().get()
    # The job exists: its replies are kept, however old (a late retry gets its answer).
    assert summary == {"interrupted_trials": 1, "pruned_replies": 0}
    with harness.store.transaction("job") as tx:
        (trial,) = tx.trials()
    assert (trial.status, trial.stop_reason) == (
        TrialStatus.INTERRUPTED,
        StopReason.HEARTBEAT_TIMEOUT,
    )
    harness.event(DeleteJob(job_id="job"))
    time.sleep(0.1)
    assert harness.app.tasks[keys.TASK_SWEEP].delay().get() == {
        "interrupted_trials": 0,
        "pruned_replies": 3,
    }


# -- tenants ---------------------------------------------------------------------------


def test_an_event_without_a_valid_key_is_refused_and_changes_nothing(harness: Harness) -> None:
    good = harness.api_key
    assert good is not None
    for bad in (None, "", "bso_nonsense", good[:-2] + "xx"):
        harness.api_key = bad
        reply = harness.event(RegisterJob(spec=SPEC))
        assert isinstance(reply, ErrorReply)
        assert reply.code == Unauthorized.code
        assert good[17:] not in reply.message
    assert harness.store.job_ids() == []


def test_a_tenant_cannot_touch_another_tenants_job(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    assert isinstance(harness.event(RegisterJob(spec=SPEC)), JobRegistered)
    owner_key = harness.api_key
    harness.api_key = create_key(harness.store, "team-b")
    with caplog.at_level(logging.INFO, "bso.tasks"):
        reply = harness.event(NextTrial(job_id="job"))
    (handled,) = [r for r in caplog.records if r.getMessage() == "event handled"]
    assert (handled.__dict__["job_id"], handled.__dict__["tenant"]) == ("job", "team-b")
    assert isinstance(reply, ErrorReply)
    assert (reply.code, reply.message) == (UnknownJob.code, "job 'job' is not registered")
    deleted = harness.event(DeleteJob(job_id="job"))
    assert isinstance(deleted, JobDeleted)
    assert not deleted.existed
    query = StatusQuery(job_id="job")
    summary = harness.send(keys.TASK_STATUS, query.model_dump_json())
    assert summary == "error job=job tenant=team-b code=unknown_job"  # Flower's line
    text = harness.redis.getdel(keys.reply_key_for(query.model_dump(mode="json")) or "")
    assert text is not None
    assert json.loads(text)["code"] == UnknownJob.code
    harness.api_key = owner_key
    assert isinstance(harness.event(NextTrial(job_id="job")), TrialAssigned)


def test_the_key_travels_in_a_header_never_in_the_task_arguments() -> None:
    key = "bso_0123456789ab_" + "s" * 43
    message = json.loads(celery_message(keys.TASK_REGISTER, "{}", "m1", api_key=key))
    assert message["headers"][keys.API_KEY_HEADER] == key
    assert key not in message["body"]
    assert key not in message["headers"]["argsrepr"]
    # The worker reads it from a real request (headers as attributes) and an eager one.
    assert api_key_of(SimpleNamespace(headers=None, bso_api_key=key)) == key
    assert api_key_of(SimpleNamespace(headers={keys.API_KEY_HEADER: key})) == key
    assert api_key_of(SimpleNamespace(headers={})) is None


DEEP_EVENT = '{"event_id": "deep", "job_id": "job", "x": ' + "[" * 100_000 + "]" * 100_000 + "}"
"""An event nested too deeply for ``json`` to parse (RecursionError, not ValueError); the
workers' screen checks the envelope around it, not the event."""


@pytest.mark.parametrize("task_name", [keys.TASK_EPOCH, keys.TASK_STATUS, keys.TASK_LIST_JOBS])
def test_an_event_nested_too_deeply_is_dropped_not_raised(
    harness: Harness, task_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, "bso.tasks"):
        assert harness.send(task_name, DEEP_EVENT) == "error code=invalid_event"
    assert harness.reply_keys() == []
    assert "dropped an event without a reply key" in caplog.text
    assert len(caplog.text) < 2000  # the preview, not the 200 kB payload


def test_a_status_query_without_event_id_is_dropped_not_crashed(harness: Harness) -> None:
    process_status(harness.runtime, json.dumps({"job_id": "job"}), api_key=harness.api_key)
    assert harness.reply_keys() == []


def test_an_unknown_field_name_is_escaped_in_the_error(harness: Harness) -> None:
    event = NextTrial(job_id="job").model_dump(mode="json") | {"bad\x1b[31mfield": 1}
    harness.send(keys.TASK_NEXT_TRIAL, json.dumps(event))
    text = harness.redis.getdel(keys.reply_key_for(event) or "")
    assert text is not None
    reply = json.loads(text)
    assert reply["code"] == "invalid_event"
    assert "\x1b" not in reply["message"]
    assert "bad\\x1b[31mfield" in reply["message"]


def test_a_reply_is_announced_only_on_a_well_formed_channel_the_message_names() -> None:
    channel = keys.SHARED.announce_channel("c3" * 16)
    as_headers = SimpleNamespace(headers={keys.REPLY_CHANNEL_HEADER: channel})
    as_attribute = SimpleNamespace(headers=None, **{keys.REPLY_CHANNEL_HEADER: channel})
    assert reply_channel_of(as_headers) == reply_channel_of(as_attribute) == channel
    for wrong in ("/0.celery.pidbox", keys.ANNOUNCE_PREFIX + "*", 7, None):
        assert reply_channel_of(SimpleNamespace(headers={keys.REPLY_CHANNEL_HEADER: wrong})) is None
