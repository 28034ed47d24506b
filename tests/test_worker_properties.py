"""Property-based tests at the worker boundary (``bso_workers.tasks.process_event``).

Generated events, valid and not (wrong types, integers past 64 bits, infinities
sent as ``1e999``, lone surrogates, control characters, extra and missing
fields, the wrong task), mixed with valid events on a few jobs sent again,
changed under the same id and out of order, are delivered one by one to a
worker whose store is real and whose reply backend records every push.  For
every delivery:

* nothing raises out of ``process_event``;
* an event with a valid event id gets exactly one reply, on the key the caller
  derives (:func:`bso.wire.keys.reply_key_for`), and one without gets none (there is
  nowhere to send it);
* the reply is a valid reply or a typed error (a code of
  :data:`bso.errors.ERROR_TYPES`, never the generic internal ``bso_error``);
  an invalid event gets ``invalid_event``, and the sequence rules hold (a copy
  gets the first reply, a changed copy ``event_id_conflict``, an unknown job
  ``unknown_job``, an unknown trial ``unknown_trial``, an epoch that is not the
  next one or follows the trial's end ``out_of_order``);
* no cost in a reply is non-finite.

At the end of each example the store must be exactly what a serial replay of
the accepted events alone gives (:func:`bso.audit.audit`), and hold no job the
accepted events did not register.  Accepted: valid events the service answered
for themselves, applied or refused for a reason about the event (refusals are
recorded too); not the invalid ones, nor a conflicting copy.  Hypothesis runs
derandomized, so CI sees the same examples every time.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from bso.apikeys import DEFAULT_TENANT
from bso.audit import audit
from bso.errors import ERROR_TYPES
from bso.service import generated_job_id
from bso.storage.base import JobTransaction, Store
from bso.storage.history import RecordedReply, replies_in_commit_order
from bso.storage.memory import MemoryStore
from bso.storage.sql import SqlStore
from bso.storage.sql.engine import upgrade
from bso.wire import keys
from bso.wire.events import (
    EVENT_ADAPTER,
    REPLY_ADAPTER,
    DeleteJob,
    DetachedRunDelivered,
    EndTrial,
    EpochDecision,
    EpochReport,
    ErrorReply,
    Event,
    JobDeleted,
    JobRegistered,
    JobReset,
    LaneSizesSet,
    RegisterJob,
    TrialAssigned,
    TrialEnded,
)
from bso.wire.replies import ReplyBackend
from bso_workers.deaths import RedisDeathCounter
from bso_workers.settings import WorkerSettings
from bso_workers.tasks import WorkerRuntime, process_event
from bso_workers.tenant_keys import create_key

KINDS = tuple(keys.TASK_FOR_KIND)
JOBS = ("j1", "j2", "j3")
EVENTS_PER_KIND = 1000
"""Generated events of each kind the per-kind test delivers, at least."""

NEVER = frozenset({"bso_error", "service_unavailable", "poison_event", "unauthorized"})
"""Codes no event may get here: internal errors, and failures this in-process
world cannot have (no outage, no worker death, a valid API key)."""


UNRECORDED = frozenset({"event_id_conflict", "unauthorized"})
"""Refusals about the caller, which the service does not record; every other reply
to a valid event, refusals about the event included, is recorded and answers
every later copy of it (:meth:`bso.service.BsoService.handle`)."""


# -- the worker under test --------------------------------------------------------------


class RecordingReplies(ReplyBackend):
    """Every push, in order.  Encodes like redis-py would, so a key or reply that
    could not be sent to Redis fails here too."""

    def __init__(self) -> None:
        self.pushed: list[tuple[str, str]] = []

    def push(self, key: str, reply_json: str, ttl_s: int, announce_to: str | None = None) -> None:
        key.encode("utf-8")
        reply_json.encode("utf-8")
        self.pushed.append((key, reply_json))

    def take(self, key: str) -> str | None:
        raise AssertionError("a worker never takes a reply")

    def close(self) -> None:
        """Nothing to release."""


def no_death_counter() -> RedisDeathCounter:
    raise AssertionError("nothing is redelivered in these tests")


@dataclass
class World:
    store: Store
    runtime: WorkerRuntime
    replies: RecordingReplies
    api_key: str


def make_world(store: Store, replies: RecordingReplies | None = None) -> World:
    replies = replies or RecordingReplies()
    runtime = WorkerRuntime(
        WorkerSettings(_env_file=None),
        store_factory=lambda: store,
        replies_factory=lambda: replies,
        deaths_factory=no_death_counter,
    )
    return World(store, runtime, replies, create_key(store, DEFAULT_TENANT))


def deliver(world: World, task_name: str, payload: str) -> None:
    """The one call into the worker: adapt here when ``process_event`` changes."""
    process_event(world.runtime, task_name, payload, api_key=world.api_key)


# -- what the replies must be -----------------------------------------------------------


@dataclass
class Model:
    """What the accepted events so far imply, learnt from their replies."""

    registered: set[str] = field(default_factory=set)
    trials: dict[str, dict[int, list[int]]] = field(default_factory=dict)
    """job -> trial -> [epochs reported, 1 while running else 0]."""
    accepted: dict[tuple[str, str], tuple[str, str]] = field(default_factory=dict)
    """(job, event id) -> (the event's canonical JSON, its recorded reply)."""
    history: dict[str, list[RecordedReply]] = field(default_factory=dict)
    events: dict[str, dict[str, Event]] = field(default_factory=dict)
    jobs_named: set[str] = field(default_factory=set)
    counts: Counter[str] = field(default_factory=Counter)
    """Deliveries per intended kind."""

    def expected_code(self, event: Event, job: str) -> str | None:
        """The error code the service must answer, when the model can tell."""
        if job not in self.registered and not isinstance(event, RegisterJob | DeleteJob):
            return "unknown_job"
        if isinstance(event, EpochReport | EndTrial):
            trial = self.trials.get(job, {}).get(event.trial_number)
            if trial is None:
                return "unknown_trial"
            epochs, running = trial
            if isinstance(event, EpochReport) and (not running or event.epoch != epochs + 1):
                return "out_of_order"
        return None

    def learn(self, event: Event, job: str, body: str, reply_json: str) -> None:
        """Apply an accepted event's reply to the model."""
        reply = REPLY_ADAPTER.validate_json(reply_json)
        self.accepted[(job, event.event_id)] = (body, reply_json)
        self.history.setdefault(job, []).append(RecordedReply(event.event_id, job, reply_json))
        self.events.setdefault(job, {})[event.event_id] = event
        trials = self.trials.setdefault(job, {})
        match reply:
            case JobRegistered():
                self.registered.add(job)
            case TrialAssigned():
                trials[reply.trial_number] = [0, 1]
            case EpochDecision():
                assert math.isfinite(reply.cost), reply_json
                trials[reply.trial_number] = [reply.epoch, 0 if reply.stop else 1]
            case TrialEnded():
                trials[reply.trial_number][1] = 0
            case JobDeleted():
                self.registered.discard(job)
                trials.clear()
            case JobReset():  # finished trials forgotten, running ones kept
                for number in [n for n, (_, running) in trials.items() if not running]:
                    del trials[number]
            case LaneSizesSet():  # a lane's list: no trial changes
                pass
            case DetachedRunDelivered():  # a journaled run: its trial has ended
                trials[reply.trial_number] = [trials.get(reply.trial_number, [0, 0])[0], 0]
            case ErrorReply():
                pass  # a refusal about the event: recorded, nothing else changed
            case _:
                raise AssertionError(f"unexpected reply {reply_json}")


def job_of(event: Event) -> str:
    if isinstance(event, RegisterJob):
        if event.spec.job_id is not None:
            return event.spec.job_id
        assert event.spec.job_id_prefix is not None
        return generated_job_id(event.spec.job_id_prefix, event.event_id)
    return event.job_id


def parse(payload: str) -> dict[str, Any] | None:
    try:
        raw = json.loads(payload)
    except ValueError:
        return None
    return raw if isinstance(raw, dict) else None


def send_and_check(world: World, model: Model, kind: str, task_name: str, payload: str) -> None:
    """Deliver one payload and check its reply against the model; learn from it."""
    model.counts[kind] += 1
    before = len(world.replies.pushed)
    deliver(world, task_name, payload)  # an exception here fails the test
    pushed = world.replies.pushed[before:]
    raw = parse(payload)
    key = keys.reply_key_for(raw) if raw is not None else None
    if key is None:
        assert pushed == [], f"a reply to {payload!r} without a valid event id"
        return
    assert len(pushed) == 1, f"{len(pushed)} replies to {payload!r}"
    pushed_key, reply_json = pushed[0]
    assert pushed_key == key
    reply = REPLY_ADAPTER.validate_json(reply_json)
    assert raw is not None
    assert reply.event_id == raw["event_id"]
    if isinstance(reply, ErrorReply):
        assert reply.code in ERROR_TYPES, reply_json
        assert reply.code not in NEVER, f"{payload!r} -> {reply_json}"
    try:
        event = EVENT_ADAPTER.validate_python(raw)
    except ValidationError:
        event = None
    if event is None or keys.TASK_FOR_KIND[event.kind] != task_name:
        assert isinstance(reply, ErrorReply), f"{payload!r} -> {reply_json}"
        assert reply.code == "invalid_event", f"{payload!r} -> {reply_json}"
        return
    job = job_of(event)
    model.jobs_named.add(job)
    body = event.model_dump_json()
    prior = model.accepted.get((job, event.event_id))
    if prior is not None:
        if prior[0] == body:
            assert reply_json == prior[1], "a copy of an event must get the first reply"
        else:
            assert isinstance(reply, ErrorReply), reply_json
            assert reply.code == "event_id_conflict", reply_json
        return
    code = model.expected_code(event, job)
    if code is not None:
        assert isinstance(reply, ErrorReply), f"expected {code}: {payload!r} -> {reply_json}"
        assert reply.code == code, f"expected {code}: {payload!r} -> {reply_json}"
    if not (isinstance(reply, ErrorReply) and reply.code in UNRECORDED):
        model.learn(event, job, body, reply_json)


def check_final_state(world: World, model: Model, history: dict[str, list[RecordedReply]]) -> None:
    """The store equals a serial replay of the accepted events, and holds no other job."""
    for job, recorded in sorted(history.items()):
        report = audit({job: recorded}, model.events.get(job, {}), world.store)
        assert report.ok, report.differences[:3]
    for job in model.jobs_named:
        with world.store.read(job) as reader:
            assert (reader.get_job() is not None) == (job in model.registered), job


# -- what callers send ------------------------------------------------------------------

ODD = st.sampled_from(
    ["\ud800", "\udfff", "\x00", "\n", "\r\n", "\x1b[31m", "\x7f", "\x85", "\u2028", "\u202e"]
)
ODD_TEXT = st.lists(st.one_of(st.text(max_size=4), ODD), min_size=1, max_size=4).map("".join)
JUNK: st.SearchStrategy[object] = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, -1, 2**31, 2**63, 2**64, -(2**63) - 1, 10**30]),
    st.floats(),
    st.sampled_from([math.inf, -math.inf, math.nan, 1e308, -1e308, 1e16]),
    ODD_TEXT,
    st.text(max_size=6),
    st.lists(st.integers(-5, 5), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
EVENT_IDS = st.one_of(
    st.sampled_from(["e1", "e2", "e3", "e4"]),  # collide: copies and conflicts
    st.uuids().map(lambda u: u.hex),
)
HARDWARE = st.sampled_from(
    [
        {"gpu_model": "A100", "gpu_count": 2, "max_power_w": 400.0},
        {"gpu_model": "V100"},
        {"gpu_model": "NVIDIA H100 80GB HBM3", "gpu_count": 8, "max_power_w": 700.0},
    ]
)


@st.composite
def spec_dict(draw: st.DrawFn) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "batch_sizes": [8, 16, 32, 64],
        "default_batch_size": 16,
        "target_metric": 0.9,
        "max_epochs": 4,
        "mab_seed": 7,
    }
    if draw(st.integers(0, 9)) == 0:
        spec["job_id_prefix"] = "gen"
    else:
        spec["job_id"] = draw(st.sampled_from(JOBS))
    if draw(st.integers(0, 4)) == 0:  # another configuration: config_mismatch on a known job
        spec["policy"] = draw(st.sampled_from(["bso", "zeus"]))
        spec["eta_knob"] = draw(st.sampled_from([0.0, 0.5, 1.0]))
        spec["beta_knob"] = draw(st.sampled_from([None, 1.5, 2.0, 1e6]))
        spec["mab_prior_precision"] = draw(st.sampled_from([0.0, 1e-9, 1e18]))
    if draw(st.booleans()):
        spec["hardware"] = draw(HARDWARE)
    return spec


@st.composite
def valid_event(draw: st.DrawFn, kind: str) -> dict[str, Any]:
    event: dict[str, Any] = {"kind": kind, "event_id": draw(EVENT_IDS)}
    if kind == "register":
        event["spec"] = draw(spec_dict())
        return event
    event["job_id"] = draw(st.sampled_from(JOBS))
    if kind == "next_trial" and draw(st.booleans()):
        event["hardware"] = draw(HARDWARE)
    if kind in ("epoch", "end"):
        event["trial_number"] = draw(st.sampled_from([1, 1, 1, 2, 3, 4]))
    if kind == "detached_run":  # a client's journal after an outage
        event["hardware"] = draw(HARDWARE)
        event["batch_size"] = draw(st.sampled_from([8, 16, 32, 64, 48]))
        event["trial_number"] = draw(st.sampled_from([None, 1, 2]))
        per_epoch = draw(st.floats(10.0, 200.0))
        event["epochs"] = [
            {"epoch": n, "time_s": n * per_epoch, "energy_j": n * per_epoch * 200.0,
             "metric": draw(st.floats(0.0, 1.0))}
            for n in range(1, draw(st.integers(0, 5)) + 1)
        ]  # fmt: skip
        event["end_reason"] = draw(st.sampled_from(["abandoned", "interrupted", "out_of_memory"]))
    if kind == "resume":  # a run resumed from its checkpoint
        event["trial_number"] = draw(st.sampled_from([1, 1, 2, 3]))
        event["hardware_key"] = draw(st.sampled_from(["cpu x1", "Tesla V100 x1"]))
        event["batch_size"] = draw(st.sampled_from([8, 16, 32, 64]))
        event["epochs"] = draw(st.integers(0, 3))
        event["time_s"] = event["epochs"] * draw(st.floats(10.0, 200.0))
        event["energy_j"] = event["time_s"] * draw(st.floats(100.0, 300.0))
    if kind == "set_sizes":  # bso jobs set-sizes
        event["lane"] = draw(st.sampled_from(["cpu x1", "Tesla V100 x1", "no such lane"]))
        event["batch_sizes"] = draw(st.lists(st.sampled_from([8, 16, 32, 64]), min_size=1))
    if kind == "epoch":
        number = draw(st.sampled_from([1, 1, 1, 2, 2, 3, 5]))
        per_epoch = draw(st.floats(10.0, 200.0))
        event["epoch"] = number
        event["time_s"] = number * per_epoch
        event["energy_j"] = number * per_epoch * draw(st.floats(100.0, 300.0))
        event["metric"] = draw(st.floats(0.0, 1.0))
    return event


@st.composite
def mutated(draw: st.DrawFn, event: dict[str, Any]) -> dict[str, Any]:
    """``event`` with one thing broken: a field set to junk, dropped or added."""
    event = copy.deepcopy(event)
    target: dict[str, Any] = event
    if isinstance(event.get("spec"), dict) and draw(st.integers(0, 2)):
        target = event["spec"]  # register events mostly break inside their spec
        if isinstance(target.get("hardware"), dict) and draw(st.booleans()):
            target = target["hardware"]
    elif isinstance(event.get("hardware"), dict) and draw(st.booleans()):
        target = event["hardware"]
    op = draw(st.sampled_from(["set", "set", "drop", "extra", "event_id"]))
    if op == "set" and target:
        target[draw(st.sampled_from(sorted(target)))] = draw(JUNK)
    elif op == "drop" and target:
        del target[draw(st.sampled_from(sorted(target)))]
    elif op == "extra":
        target[draw(st.one_of(st.just("priority"), ODD_TEXT))] = draw(JUNK)
    else:
        event["event_id"] = draw(st.one_of(ODD_TEXT, JUNK, st.just("x" * 129)))
    return event


@st.composite
def payload(draw: st.DrawFn, kind: str) -> tuple[str, str, str]:
    """(intended kind, task name, JSON text): mostly valid, often broken."""
    task = keys.TASK_FOR_KIND[kind]
    if draw(st.integers(0, 39)) == 0:  # not an event object at all
        text = draw(st.sampled_from(["[]", "null", "1e999", '"x"', "{", "not json", "{}"]))
        return kind, task, text
    event = draw(valid_event(kind))
    for _ in range(draw(st.sampled_from([0, 0, 0, 1, 1, 2]))):
        event = draw(mutated(event))
    if draw(st.integers(0, 19)) == 0:
        task = draw(st.sampled_from(sorted(keys.TASK_FOR_KIND.values())))
    text = json.dumps(event)  # inf and nan as Infinity and NaN, which json.loads reads
    if draw(st.booleans()):
        text = text.replace("Infinity", "1e999")
    return kind, task, text


# -- the properties -----------------------------------------------------------------------

PHASES = (Phase.explicit, Phase.generate, Phase.shrink)
"""No ``explain`` phase: it traces every line, and a failure would take minutes."""

EXAMPLES = 60
PER_EXAMPLE = 20
"""60 examples of at least 20 events of the kind under test: 1,200 or more per kind."""

CONTEXT = st.sampled_from(KINDS).flatmap(payload)
"""Events of any kind, around the ones under test, so that those meet real state."""


@st.composite
def focused(draw: st.DrawFn, kind: str) -> list[tuple[str, str, str]]:
    """``PER_EXAMPLE`` events of ``kind`` with a few of any kind, shuffled."""
    mine = draw(st.lists(payload(kind), min_size=PER_EXAMPLE, max_size=PER_EXAMPLE))
    return draw(st.permutations(mine + draw(st.lists(CONTEXT, min_size=4, max_size=8))))


def run(world_factory: Callable[[], World], events: list[tuple[str, str, str]]) -> Model:
    world, model = world_factory(), Model()
    for job in JOBS[:2]:  # two live jobs with a running trial to aim at
        send_and_check(world, model, "context", keys.TASK_REGISTER, _register(job))
        send_and_check(world, model, "context", keys.TASK_NEXT_TRIAL, _next(job))
    for kind, task, text in events:
        send_and_check(world, model, kind, task, text)
    check_final_state(world, model, model.history)
    return model


def _register(job: str) -> str:
    spec = {"job_id": job, "batch_sizes": [8, 16, 32, 64], "default_batch_size": 16}
    spec |= {"target_metric": 0.9, "max_epochs": 4, "mab_seed": 7}
    return json.dumps({"kind": "register", "event_id": f"setup-{job}", "spec": spec})


def _next(job: str) -> str:
    return json.dumps({"kind": "next_trial", "event_id": f"first-{job}", "job_id": job})


@pytest.mark.parametrize("kind", KINDS)
def test_every_event_of_a_kind_gets_one_typed_reply(kind: str) -> None:
    counts: Counter[str] = Counter()

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        phases=PHASES,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(focused(kind))
    def check(events: list[tuple[str, str, str]]) -> None:
        counts.update(run(lambda: make_world(MemoryStore()), events).counts)

    check()
    assert counts[kind] >= EVENTS_PER_KIND, counts


@st.composite
def trial_flow(draw: st.DrawFn, job: str) -> list[tuple[str, str, str]]:
    """What a training script sends for one trial: register, next trial, epochs, end."""
    ids = iter(draw(st.lists(st.uuids().map(lambda u: u.hex), min_size=9, max_size=9)))
    spec = {"job_id": job, "batch_sizes": [8, 16, 32, 64], "default_batch_size": 16}
    spec |= {"target_metric": 0.9, "max_epochs": 4, "mab_seed": 7}
    trial = draw(st.sampled_from([1, 1, 2]))  # usually right, sometimes not yet assigned
    events: list[dict[str, Any]] = [
        {"kind": "register", "spec": spec},
        {"kind": "next_trial", "job_id": job},
    ]
    per_epoch = draw(st.floats(10.0, 200.0))
    for epoch in range(1, draw(st.integers(1, 5)) + 1):
        events.append(
            {
                "kind": "epoch",
                "job_id": job,
                "trial_number": trial,
                "epoch": epoch,
                "time_s": epoch * per_epoch,
                "energy_j": epoch * per_epoch * 250.0,
                "metric": draw(st.floats(0.0, 1.0)),
            }
        )
    events.append({"kind": "end", "job_id": job, "trial_number": trial})
    return [
        (e["kind"], keys.TASK_FOR_KIND[e["kind"]], json.dumps({**e, "event_id": next(ids)}))
        for e in events
    ]


@st.composite
def session(draw: st.DrawFn) -> list[tuple[str, str, str]]:
    """Trials of a few jobs interleaved, with events of any kind among them, some
    sent again and some swapped with the next."""
    flows = [draw(trial_flow(job)) for job in draw(st.lists(st.sampled_from(JOBS), max_size=5))]
    flows.append(draw(st.lists(st.sampled_from(KINDS).flatmap(payload), max_size=15)))
    events: list[tuple[str, str, str]] = []
    while any(flows):
        source = draw(st.sampled_from([f for f in flows if f]))
        events.append(source.pop(0))
    if not events:
        return events
    for _ in range(draw(st.integers(0, 8))):  # copies of earlier events
        i = draw(st.integers(0, len(events) - 1))
        events.insert(draw(st.integers(i, len(events))), events[i])
    for _ in range(draw(st.integers(0, 8)) if len(events) > 1 else 0):  # reorders
        i = draw(st.integers(0, len(events) - 2))
        events[i], events[i + 1] = events[i + 1], events[i]
    return events


def test_sessions_on_sqlite_end_as_a_serial_replay(tmp_path: Path) -> None:
    runs = iter(range(10**6))

    def sqlite_world() -> World:
        url = f"sqlite:///{tmp_path / f'bso-{next(runs)}.db'}"
        upgrade(url)
        world = make_world(SqlStore(url))
        worlds.append((world, url))
        return world

    worlds: list[tuple[World, str]] = []

    @settings(max_examples=40, deadline=None, derandomize=True, database=None, phases=PHASES)
    @given(session())
    def check(events: list[tuple[str, str, str]]) -> None:
        model = run(sqlite_world, events)
        world, url = worlds[-1]
        try:
            # The store's own record of what it applied, in commit order, is exactly
            # the events the replies say were accepted.
            recorded = replies_in_commit_order(url, model.history)
            assert {j: [r.event_id for r in h] for j, h in recorded.items()} == {
                j: [r.event_id for r in h] for j, h in model.history.items()
            }
            check_final_state(world, model, recorded)
        finally:
            world.runtime.close()

    check()
    assert len(worlds) >= 40


class MisdirectedReplies(RecordingReplies):
    def push(self, key: str, reply_json: str, ttl_s: int, announce_to: str | None = None) -> None:
        super().push(key + "x", reply_json, ttl_s, announce_to)


class BrokenStore(MemoryStore):
    @contextmanager
    def transaction(self, job_id: str) -> Iterator[JobTransaction]:
        if job_id:  # always: fail at the first event, as a broken database would
            raise RuntimeError("the disk caught fire")
        yield from ()


def test_the_checks_catch_a_misdirected_reply() -> None:
    world, model = make_world(MemoryStore(), MisdirectedReplies()), Model()
    with pytest.raises(AssertionError, match="bso:reply:j1:-:d-"):
        send_and_check(world, model, "delete", keys.TASK_DELETE, _delete("j1"))


def test_the_checks_catch_an_internal_error() -> None:
    world, model = make_world(BrokenStore()), Model()
    with pytest.raises(AssertionError, match="bso_error"):
        send_and_check(world, model, "delete", keys.TASK_DELETE, _delete("j1"))


def test_the_checks_catch_a_wrong_code_and_a_store_that_differs() -> None:
    world, model = make_world(MemoryStore()), Model()
    # j1 registered behind the model's back: the model expects unknown_job, and says so.
    deliver(world, keys.TASK_REGISTER, _register("j1"))
    with pytest.raises(AssertionError, match="expected unknown_job"):
        send_and_check(world, model, "next_trial", keys.TASK_NEXT_TRIAL, _next("j1"))
    world, model = make_world(MemoryStore()), Model()
    send_and_check(world, model, "register", keys.TASK_REGISTER, _register("j1"))
    send_and_check(world, model, "next_trial", keys.TASK_NEXT_TRIAL, _next("j1"))
    check_final_state(world, model, model.history)
    deliver(world, keys.TASK_NEXT_TRIAL, _next("j1").replace("first-", "extra-"))
    with pytest.raises(AssertionError, match="extra_trial"):
        check_final_state(world, model, model.history)


def _delete(job: str) -> str:
    digest = hashlib.sha256(job.encode()).hexdigest()[:8]
    return json.dumps({"kind": "delete", "event_id": f"d-{digest}", "job_id": job})
