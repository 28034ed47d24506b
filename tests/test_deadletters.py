"""The gate in front of kombu (bso_workers.envelope) and the dead letters behind it.

* Every message bso's own publishers send passes: the client's LPUSH, Celery's
  ``send_task`` (base64 body), beat's sweep with an expiry, kombu's redelivered
  copies.
* Every kind of garbage is refused with its reason, and thousands of
  generated mutations of a real message never make the check raise; those it
  accepts are decoded by kombu and Celery without an error.
* A refused item is logged once, escaped, counted, kept in a bounded list with
  a TTL, and answered with ``invalid_event`` when it carries an event;
  ``bso deadletters`` shows and purges the list.
"""

from __future__ import annotations

import base64
import json
import logging
import tracemalloc
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery.beat import ScheduleEntry, Scheduler
from celery.worker.request import Request
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from kombu import Connection
from kombu.serialization import loads as kombu_decode
from kombu.utils.json import dumps as kombu_dumps
from kombu.utils.json import loads as kombu_loads

from bso.cli import main
from bso.errors import InvalidEvent
from bso.wire import keys
from bso.wire.events import REPLY_ADAPTER, ErrorReply, NextTrial
from bso.wire.status_query import StatusQuery
from bso_workers.celery_app import SWEEP_ENTRY, create_app, task_routes
from bso_workers.deadletters import LOG_EVERY_S, DeadLetters, LogGate, preview
from bso_workers.envelope import QUEUE_OF_TASK, check_fanout_item, check_item
from bso_workers.settings import WorkerSettings
from bso_workers.tasks import WorkerRuntime
from tests.fixtures.celery_publisher import client_celery_app
from tests.fixtures.garbage import base64_message, garbage, message

CAP = keys.DEFAULT_MAX_QUEUE_ITEM_BYTES
APP = create_app(WorkerSettings(_env_file=None))


def encode(value: Any) -> bytes:
    return json.dumps(value).encode()


def redelivered(raw: dict[str, Any]) -> dict[str, Any]:
    """What kombu's ``_do_restore_message`` puts back on the queue."""
    raw["headers"]["redelivered"] = True
    raw["properties"]["delivery_info"]["redelivered"] = True
    return raw


def decode_like_kombu_and_celery(item: bytes, queue: str) -> None:
    """The consumer's path for ``item``: each step raises if the item is unfit."""
    payload = kombu_loads(item.decode("utf-8"))  # _brpop_read
    with Connection("memory://") as connection:
        channel = connection.channel()
        message = channel.Message(payload, channel=channel)  # basic_consume's callback
        channel._get_message_priority(payload)
        kombu_dumps([message._raw, "", queue]).encode("utf-8")  # QoS.append's unacked entry
        message.accept = {"application/json"}
        task = APP.tasks[message.headers["task"]]  # Celery's strategy lookup
        request = Request(message, app=APP, task=task, hostname="test", body=message.body)
        request.revoked()
        _args, _kwargs, _embed = kombu_decode(  # the pool's trace
            message.body,
            message.content_type,
            message.content_encoding,
            accept={"application/json"},
        )
    assert task.name == message.headers["task"]


# -- what passes ---------------------------------------------------------------------------


def test_the_task_queues_agree_with_the_apps_routes() -> None:
    assert {task: route["queue"] for task, route in task_routes().items()} == QUEUE_OF_TASK


@pytest.mark.parametrize("task", sorted(QUEUE_OF_TASK))
def test_the_clients_messages_pass_and_decode(task: str) -> None:
    raw = message(task)
    queue = QUEUE_OF_TASK[task]
    for item in (encode(raw), encode(redelivered(raw))):
        assert check_item(item, queue, CAP) is None
        decode_like_kombu_and_celery(item, queue)


def test_celerys_own_messages_pass_and_decode(redis_url: str) -> None:
    """send_task's base64 bodies, a status query, and beat's sweep (expiry, time limit)."""
    app = client_celery_app(redis_url)
    event = NextTrial(job_id="j").model_dump_json()
    query = StatusQuery(job_id="j").model_dump_json()
    app.send_task(keys.TASK_NEXT_TRIAL, args=(event,), queue=keys.EVENTS_QUEUE, retry=False)
    app.send_task(keys.TASK_STATUS, args=(query,), task_id="s.1", queue=keys.EVENTS_QUEUE)
    app.close()
    workers = create_app(WorkerSettings(_env_file=None, broker_url=redis_url))
    entry = ScheduleEntry(name=SWEEP_ENTRY, app=workers, **workers.conf.beat_schedule[SWEEP_ENTRY])
    Scheduler(workers, lazy=True).apply_async(entry)  # what beat does on each tick
    workers.close()
    client = redis.Redis.from_url(redis_url)
    items = [
        (item, queue)
        for queue in (keys.EVENTS_QUEUE, keys.MAINTENANCE_QUEUE)
        for item in client.lrange(keys.BROKER_KEY_PREFIX + queue, 0, -1)
    ]
    assert len(items) == 3
    sweep = json.loads(items[-1][0])["headers"]
    assert sweep["celery_beat_task"] is True
    assert sweep["timelimit"][0] > 0
    for item, queue in items:
        assert json.loads(item)["properties"]["body_encoding"] == "base64"
        assert check_item(item, queue, CAP) is None, item
        decode_like_kombu_and_celery(item, queue)


# -- what is refused -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("item", "queue", "reason"),
    [
        (b"x" * (CAP + 1), keys.EVENTS_QUEUE, "too_large"),
        (b'{"body": "\xff"}', keys.EVENTS_QUEUE, "not_utf8"),
        (b"\x80\x04\x95pickle", keys.MAINTENANCE_QUEUE, "not_utf8"),
        (b"not json", keys.EVENTS_QUEUE, "not_json"),
        (b"[" * 5000, keys.EVENTS_QUEUE, "not_json"),
        (b"[]", keys.EVENTS_QUEUE, "bad_envelope"),
        (b"null", keys.MAINTENANCE_QUEUE, "bad_envelope"),
        (b'{"__type__": "datetime", "__value__": "x"}', keys.EVENTS_QUEUE, "bad_envelope"),
    ],
)
def test_junk_is_refused(item: bytes, queue: str, reason: str) -> None:
    refused = check_item(item, queue, CAP)
    assert refused is not None
    assert refused.reason == reason
    assert refused.event is None


def _set(path: str, value: Any) -> dict[str, Any]:
    raw = message()
    *parents, last = path.split(".")
    target = raw
    for part in parents:
        target = target[part]
    target[last] = value
    return raw


@pytest.mark.parametrize(
    ("raw", "reason", "named"),
    [
        (_set("headers", []), "bad_envelope", "headers"),
        (_set("properties.delivery_tag", 7), "bad_envelope", "properties.delivery_tag"),
        (_set("properties.delivery_info", None), "bad_envelope", "properties.delivery_info"),
        (_set("body", 1), "bad_envelope", "body"),
        (_set("headers.compression", "zlib"), "bad_envelope", "headers.compression"),
        (_set("headers.eta", "2099-01-01T00:00:00+00:00"), "bad_envelope", "headers.eta"),
        (_set("headers.id", "a\x1b[2Jb"), "bad_envelope", "headers.id"),
        (_set("headers.expires", "2030-01-01T00:00:00+05:00"), "bad_envelope", "headers.expires"),
        (_set("headers.__type__", "uuid"), "bad_envelope", "headers.__type__"),
        # A worker publishes on the channel a message names: only a bso announcement one.
        (_set("headers.bso_reply_channel", "/0.celery.pidbox"), "bad_envelope", "bso_reply"),
        (_set("headers.bso_reply_channel", "bso:reply:announce:*"), "bad_envelope", "bso_reply"),
        (_set("content-type", "application/x-python-serialize"), "content_type", "content-type"),
        (_set("content-encoding", "binary"), "content_type", "content-encoding"),
        (_set("properties.body_encoding", "rot13"), "body_encoding", "body_encoding"),
        (_set("headers.task", "celery.chord_unlock"), "unknown_task", "headers.task"),
        (_set("headers.origin", "\ud800"), "not_utf8", "surrogate"),
    ],
)
def test_a_wrong_envelope_is_refused_naming_the_field(
    raw: dict[str, Any], reason: str, named: str
) -> None:
    refused = check_item(encode(raw), keys.EVENTS_QUEUE, CAP)
    assert refused is not None
    assert (refused.reason, named in refused.why) == (reason, True), refused.why
    assert refused.why.isprintable()


EVENT = NextTrial(job_id="j").model_dump_json()


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (_set("body", json.dumps([[EVENT], {}])), "bad_body"),
        (_set("body", json.dumps([[EVENT], {}, {"chain": [{"task": "bso.delete"}]}])), "bad_body"),
        (_set("body", json.dumps([[EVENT], {"x": 1}, {}])), "bad_body"),
        (_set("body", json.dumps([[EVENT, EVENT], {}, {}])), "bad_body"),
        (base64_message(b"\x80\x04\x95 a pickle"), "bad_body"),
        (_set("body", "W1tdLCB7fSwge31d="), "bad_body"),  # not JSON once decoded as is
        (base64_message([[EVENT], {}, {}]) | {"body": "%%%"}, "bad_body"),
    ],
)
def test_a_body_that_is_not_args_kwargs_embed_is_refused(raw: dict[str, Any], reason: str) -> None:
    refused = check_item(encode(raw), keys.EVENTS_QUEUE, CAP)
    assert refused is not None
    assert refused.reason == reason, refused.why


def test_an_item_with_many_faults_gets_a_short_explanation() -> None:
    raw = message()
    raw["headers"].update({f"x{i}": i for i in range(10_000)})
    refused = check_item(encode(raw), keys.EVENTS_QUEUE, CAP)
    assert refused is not None
    assert refused.why.endswith("; and 9995 more")
    assert len(refused.why) < 1000


def test_a_bso_task_on_the_wrong_queue_is_refused() -> None:
    sweep = check_item(encode(message(keys.TASK_SWEEP)), keys.EVENTS_QUEUE, CAP)
    event = check_item(encode(message()), keys.MAINTENANCE_QUEUE, CAP)
    assert sweep is not None
    assert event is not None
    assert (sweep.reason, event.reason) == ("wrong_queue", "wrong_queue")
    assert "bso.sweep belongs on bso.maintenance" in sweep.why


def test_a_tenants_queue_takes_its_own_events_and_refuses_a_forged_route_or_channel() -> None:
    team_a, team_b = keys.tenant_namespace("team-a"), keys.tenant_namespace("team-b")
    raw = message()
    raw["properties"]["delivery_info"]["routing_key"] = team_a.queue
    raw["headers"][keys.REPLY_CHANNEL_HEADER] = team_a.announce_channel("5e" * 16)
    assert check_item(encode(raw), team_a.queue, CAP) is None
    forged = check_item(encode(raw), team_b.queue, CAP)  # pushed onto team-b's queue
    assert forged is not None
    assert forged.reason == "wrong_queue"
    assert forged.why == (
        "its routing key 'bso.events.t.team-a' names another queue than bso.events.t.team-b, "
        "where it was pushed"
    )
    raw["headers"][keys.REPLY_CHANNEL_HEADER] = team_b.announce_channel("5e" * 16)
    heard_elsewhere = check_item(encode(raw), team_a.queue, CAP)
    assert heard_elsewhere is not None
    assert "a channel of another namespace" in heard_elsewhere.why


@pytest.mark.parametrize("timelimit", [[0.001, None], [None, 0.001], [86400.0, 86400.0]])
def test_an_event_with_a_time_limit_of_its_own_is_refused(timelimit: list[float | None]) -> None:
    """Under prefork Celery runs a message's own ``timelimit``: a tenant sending [0.001,
    null] had each of its events kill the pool process that ran it (and slowed every
    other tenant's reads to a p50 of 0.7 s).  Only beat's sweep carries one."""
    team_b = keys.tenant_namespace("team-b")
    raw = message()
    del raw["headers"][keys.REPLY_CHANNEL_HEADER]  # (the shared namespace's)
    raw["properties"]["delivery_info"]["routing_key"] = team_b.queue
    assert check_item(encode(raw), team_b.queue, CAP) is None  # [None, None]: the client's
    raw["headers"]["timelimit"] = timelimit
    for queue in (team_b.queue, keys.EVENTS_QUEUE):
        raw["properties"]["delivery_info"]["routing_key"] = queue
        refused = check_item(encode(raw), queue, CAP)
        assert refused is not None
        assert refused.reason == "bad_envelope"
        assert refused.why.startswith("headers.timelimit: an event carries no time limit")
        assert refused.event is not None  # its caller is told why


def test_a_refused_item_with_an_event_names_it_for_the_reply() -> None:
    raw = _set("content-type", "application/x-python-serialize")
    event = json.loads(raw["body"])[0][0]
    refused = check_item(encode(raw), keys.EVENTS_QUEUE, CAP)
    assert refused is not None
    assert refused.event == json.loads(event)
    assert keys.reply_key_for(refused.event) == keys.reply_key_for(json.loads(event))


def test_every_generated_kind_gets_its_reason() -> None:
    items = garbage(2000, seed=1, max_bytes=8192)
    got = Counter((reason, _reason(item, queue)) for item, queue, reason in items)
    assert {pair for pair in got if pair[0] != pair[1]} == set()
    assert len(got) == 9  # every reason, each at least once


def _reason(item: bytes, queue: str) -> str | None:
    refused = check_item(item, queue, 8192)
    return None if refused is None else refused.reason


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=6,
)
_PATHS = [
    "content-type", "content-encoding", "body", "headers", "properties", "x",
    *(f"headers.{k}" for k in message()["headers"]), "headers.compression", "headers.redelivered",
    *(f"properties.{k}" for k in message()["properties"]), "properties.body_encoding",
    "properties.delivery_info.exchange", "properties.delivery_info.routing_key",
    "properties.delivery_info.redelivered", "properties.expiration",
    "body.0", "body.1", "body.2", "body.0.0", "body.1.x", "body.2.callbacks", "body.3",
]  # fmt: skip


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    task=st.sampled_from(sorted(QUEUE_OF_TASK)),
    queue=st.sampled_from([keys.EVENTS_QUEUE, keys.MAINTENANCE_QUEUE]),
    changes=st.lists(st.tuples(st.sampled_from(_PATHS), _JSON | st.just(...)), max_size=3),
    base64_body=st.booleans(),
)
def test_mutated_messages_never_break_the_check_and_what_passes_decodes(
    task: str, queue: str, changes: list[tuple[str, Any]], base64_body: bool
) -> None:
    raw = message(task)
    body = json.loads(raw["body"])
    for path, value in changes:
        mutate({**raw, "body": body} if path.startswith("body.") else raw, path, value)
    if isinstance(raw.get("body"), str):
        text = json.dumps(body)
        raw["body"] = base64.b64encode(text.encode()).decode() if base64_body else text
        if base64_body and isinstance(raw.get("properties"), dict):
            raw["properties"]["body_encoding"] = "base64"
    item = json.dumps(raw).encode("utf-8", "surrogatepass")
    refused = check_item(item, queue, CAP)
    event("accepted" if refused is None else f"refused: {refused.reason}")
    if refused is None:
        decode_like_kombu_and_celery(item, queue)


def mutate(root: Any, path: str, value: Any) -> None:
    """Set (``...``: delete) ``path`` in ``root`` where the path exists."""
    *parents, last = path.split(".")
    target = root
    for part in parents:
        if isinstance(target, dict) and part in target:
            target = target[part]
        elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
            target = target[int(part)]
        else:
            return
    if isinstance(target, dict):
        if value is ...:
            target.pop(last, None)
        else:
            target[last] = value
    elif isinstance(target, list) and last.isdigit() and int(last) < len(target):
        if value is ...:
            del target[int(last)]
        else:
            target[int(last)] = value


# -- broadcast (remote control) messages ---------------------------------------------------


def pidbox_message(redis_url: str) -> bytes:
    """What ``celery inspect`` / Flower / the launcher's ping publish to the workers."""
    client = redis.Redis.from_url(redis_url)
    listener = client.pubsub()
    listener.psubscribe(keys.BROKER_KEY_PREFIX + "*")
    listener.get_message(timeout=1)  # the subscription's confirmation
    app = client_celery_app(redis_url)
    app.control.broadcast("ping", reply=False)
    app.close()
    received = listener.get_message(timeout=5)
    listener.close()
    assert received is not None
    assert b"celery.pidbox" in received["channel"]
    data: bytes = received["data"]
    return data


def test_a_remote_control_message_passes(redis_url: str) -> None:
    item = pidbox_message(redis_url)
    assert check_fanout_item(item, CAP) is None


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"properties": []}, "bad_envelope"),
        ({"headers": {"clock": {"__type__": "decimal", "__value__": "x"}}}, "bad_envelope"),
        ({"headers": {"compression": "application/x-gzip"}}, "bad_envelope"),
        ({"content-type": "application/x-python-serialize"}, "content_type"),
        ({"body": "%%%"}, "bad_body"),
        ({"body": base64.b64encode(b"[1, 2]").decode()}, "bad_body"),
    ],
)
def test_broken_remote_control_messages_are_refused(
    redis_url: str, change: dict[str, Any], reason: str
) -> None:
    raw = json.loads(pidbox_message(redis_url)) | change
    refused = check_fanout_item(encode(raw), CAP)
    assert refused is not None
    assert refused.reason == reason, refused.why
    assert check_fanout_item(b"[]", CAP) is not None


# -- dead letters --------------------------------------------------------------------------


@pytest.fixture
def runtime(redis_url: str) -> WorkerRuntime:
    return WorkerRuntime(WorkerSettings(_env_file=None, broker_url=redis_url))


@pytest.fixture
def dead_letters(redis_url: str, runtime: WorkerRuntime) -> Iterator[DeadLetters]:
    box = DeadLetters(redis_url, max_item_bytes=4096, push_reply=runtime.push)
    yield box
    box.close()
    runtime.close()


def test_a_refused_item_is_logged_once_escaped_counted_and_kept(
    dead_letters: DeadLetters, caplog: pytest.LogCaptureFixture
) -> None:
    item = b'\x1b[31m{"evil": "\n\r\x00"}\xff'
    with caplog.at_level(logging.WARNING, "bso.deadletters"):
        assert not dead_letters.screen(item, keys.EVENTS_QUEUE)
    (record,) = caplog.records
    fields = vars(record)
    assert fields["reason"] == "not_utf8"
    assert fields["preview"] == repr(item)
    assert fields["preview"].isprintable()
    assert fields["preview"].isascii()
    client = dead_letters.redis
    (stored,) = [json.loads(r) for r in client.lrange(keys.DEADLETTERS_KEY, 0, -1)]
    assert stored["preview"] == repr(item)
    assert (stored["queue"], stored["reason"], stored["bytes"]) == (
        keys.EVENTS_QUEUE, "not_utf8", len(item)
    )  # fmt: skip
    assert client.hgetall(keys.DEADLETTER_COUNTS_KEY) == {b"not_utf8": b"1", b"total": b"1"}
    assert 0 < client.ttl(keys.DEADLETTERS_KEY) <= keys.DEADLETTERS_TTL_S


def test_the_caller_of_a_refused_event_gets_invalid_event(
    dead_letters: DeadLetters, runtime: WorkerRuntime
) -> None:
    raw = _set("content-type", "application/x-python-serialize")
    event = json.loads(json.loads(raw["body"])[0][0])
    assert not dead_letters.screen(encode(raw), keys.EVENTS_QUEUE)
    key = keys.reply_key_for(event)
    assert key is not None
    reply = REPLY_ADAPTER.validate_json(runtime.replies.pop(key, 5) or "null")
    assert isinstance(reply, ErrorReply)
    assert (reply.event_id, reply.code) == (event["event_id"], InvalidEvent.code)
    assert "content_type" in reply.message
    assert "content-type" in reply.message
    (stored,) = dead_letters.redis.lrange(keys.DEADLETTERS_KEY, 0, -1)
    assert json.loads(stored)["replied_to"] == event["event_id"]


def test_an_oversized_item_is_refused_unread(dead_letters: DeadLetters) -> None:
    item = encode(message()) + b" " * 5000
    assert not dead_letters.screen(item, keys.EVENTS_QUEUE)
    (stored,) = [json.loads(r) for r in dead_letters.redis.lrange(keys.DEADLETTERS_KEY, 0, -1)]
    assert stored["reason"] == "too_large"
    assert len(stored["preview"]) < keys.DEADLETTER_PREVIEW_CHARS + 40
    assert stored["preview"].endswith(f"... ({len(item)} bytes)")


def test_the_list_is_bounded_and_the_count_is_not(dead_letters: DeadLetters) -> None:
    for i in range(keys.DEADLETTERS_MAX + 5):
        assert not dead_letters.screen(b"[%d]" % i, keys.MAINTENANCE_QUEUE)
    client = dead_letters.redis
    assert client.llen(keys.DEADLETTERS_KEY) == keys.DEADLETTERS_MAX
    newest = json.loads(client.lindex(keys.DEADLETTERS_KEY, 0) or "null")
    assert newest["preview"] == repr(b"[%d]" % (keys.DEADLETTERS_MAX + 4))
    assert client.hget(keys.DEADLETTER_COUNTS_KEY, "total") == b"%d" % (keys.DEADLETTERS_MAX + 5)


def test_good_items_and_other_queues_pass_untouched(dead_letters: DeadLetters) -> None:
    assert dead_letters.screen(encode(message()), keys.EVENTS_QUEUE)
    assert dead_letters.screen(b"[]", "somehost.reply.celery.pidbox")
    assert dead_letters.redis.exists(keys.DEADLETTERS_KEY, keys.DEADLETTER_COUNTS_KEY) == 0


def test_without_redis_an_item_is_still_refused_and_nothing_raises(
    caplog: pytest.LogCaptureFixture,
) -> None:
    box = DeadLetters("redis://127.0.0.1:1/0", push_reply=None)
    with caplog.at_level(logging.WARNING, "bso.deadletters"):
        assert not box.screen(b"[]", keys.EVENTS_QUEUE)
    assert "could not record a dead letter" in caplog.text
    assert repr(box) == f"DeadLetters(max_item_bytes={CAP})"


def test_preview_is_ascii_and_bounded() -> None:
    text = preview(bytes(range(256)) * 100)
    assert text.isascii()
    assert text.isprintable()
    assert text.endswith("... (25600 bytes)")


# -- bso deadletters -----------------------------------------------------------------------


def test_the_command_shows_and_purges_dead_letters(
    dead_letters: DeadLetters, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    for item in (b"[]", b"\x1b[2J\xff", encode(_set("headers.task", "os.system"))):
        dead_letters.screen(item, keys.EVENTS_QUEUE)
    assert main(["deadletters", "--broker-url", redis_url, "--limit", "2"]) == 0
    out = capsys.readouterr().out
    assert (
        out.splitlines()[0] == "3 queue items refused (bad_envelope 1, not_utf8 1, unknown_task 1)"
    )
    assert len(out.splitlines()) == 1 + 2 * 2  # the newest two, two lines each
    assert "\x1b" not in out
    assert main(["deadletters", "--broker-url", redis_url, "--json", "--purge"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["counts"]["total"] == 3
    assert [r["reason"] for r in shown["records"]] == ["unknown_task", "not_utf8", "bad_envelope"]
    assert shown["purged"] == 3
    assert main(["deadletters", "--broker-url", redis_url]) == 0
    assert capsys.readouterr().out == "0 queue items refused\n"


def test_the_command_reports_an_unreachable_redis_without_its_password(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["deadletters", "--broker-url", "redis://:sekret@127.0.0.1:1/0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("bso deadletters: cannot read redis://:***@127.0.0.1:1/0")
    assert "`bso up` starts one" in err
    assert len(err.splitlines()) == 1
    assert "sekret" not in err


@pytest.mark.parametrize(
    "login", ["nobody:nothing@", "bso-worker:wrong@"], ids=["unknown-user", "wrong-password"]
)
def test_a_refused_login_names_the_workers_url_not_a_teams_file(
    login: str, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """An operator whose login Redis refused was told that a team's login comes in its
    team file, which cannot read the dead letters either."""
    url = redis_url.replace("redis://", f"redis://{login}", 1)
    assert main(["deadletters", "--broker-url", url, "--data-dir", "/srv/bso"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1
    assert err.startswith("bso deadletters: Redis refused the login of redis://")
    assert "give --broker-url the BSO_WORKER_BROKER_URL in /srv/bso/credentials.env" in err
    assert "team file" not in err
    assert ":wrong@" not in err  # the password, redacted
    assert ":nothing@" not in err


def test_without_a_service_to_ask_the_command_says_so_and_reads_no_other_redis(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Outside bso up's data dir it used to read the machine's own Redis on 6379 and
    report "0 queue items refused"."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("BSO_BROKER_URL", raising=False)
    assert main(["deadletters", "--data-dir", str(tmp_path / "nothing-here")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("bso deadletters: no service to ask")
    assert len(err.splitlines()) == 1


def test_a_preview_shows_no_announcement_channel(dead_letters: DeadLetters) -> None:
    # Who knows a caller's channel hears which of its replies are ready.
    raw = message()
    channel = raw["headers"][keys.REPLY_CHANNEL_HEADER]
    raw["headers"]["eta"] = "2099-01-01T00:00:00+00:00"  # refused: bad_envelope
    assert not dead_letters.screen(encode(raw), keys.EVENTS_QUEUE)
    (stored,) = [json.loads(r) for r in dead_letters.redis.lrange(keys.DEADLETTERS_KEY, 0, -1)]
    assert channel not in stored["preview"]
    assert keys.ANNOUNCE_PREFIX + "***" in stored["preview"]


@pytest.mark.parametrize("named", ["well formed", "malformed"])
def test_the_refusal_is_announced_only_on_a_well_formed_channel(
    dead_letters: DeadLetters, redis_url: str, named: str
) -> None:
    raw = _set("content-type", "application/x-python-serialize")
    channel = raw["headers"][keys.REPLY_CHANNEL_HEADER]
    if named == "malformed":  # refused for that very header: never published on
        channel = raw["headers"][keys.REPLY_CHANNEL_HEADER] = channel + "0"
    event = json.loads(json.loads(raw["body"])[0][0])
    listener = redis.Redis.from_url(redis_url, decode_responses=True).pubsub()
    try:
        listener.subscribe(channel)
        assert listener.get_message(timeout=5) is not None  # the confirmation
        assert not dead_letters.screen(encode(raw), keys.EVENTS_QUEUE)
        heard = listener.get_message(timeout=1)
    finally:
        listener.close()
    if named == "well formed":
        assert heard is not None
        assert heard["data"] == keys.reply_key_for(event)
    else:
        assert heard is None


def celery_event_batch(redis_url: str) -> tuple[bytes, str]:
    """What a worker publishes for Flower: a batch of task events (``task.multi``),
    with the channel it went out on."""
    client = redis.Redis.from_url(redis_url)
    listener = client.pubsub()
    listener.psubscribe("*celeryev*")
    listener.get_message(timeout=1)  # the subscription's confirmation
    app = client_celery_app(redis_url)
    with app.connection_for_write() as connection:
        dispatcher = app.events.Dispatcher(connection, buffer_group=["task"], buffer_limit=10)
        for state in ("task-received", "task-started", "task-succeeded"):
            dispatcher.send(state, uuid="t-1", result="'trial job=j trial=1 bs=8'")
        dispatcher.flush()
        dispatcher.close()
    app.close()
    received = listener.get_message(timeout=5)
    listener.close()
    assert received is not None
    channel = received["channel"].decode()
    assert channel.endswith("celeryev/task.multi"), channel
    data: bytes = received["data"]
    return data, channel


def test_a_batch_of_celery_events_passes_on_the_event_channel_only(redis_url: str) -> None:
    """Flower's own process screens what it hears: a refused ``task.multi`` hid every
    task from Flower and counted Celery's traffic as dead letters."""
    item, channel = celery_event_batch(redis_url)
    assert check_fanout_item(item, CAP, channel) is None
    refused = check_fanout_item(item, CAP, "/0.celery.pidbox")
    assert refused is not None
    assert refused.reason == "bad_body"


def test_an_event_batch_of_anything_but_objects_is_refused(redis_url: str) -> None:
    item, channel = celery_event_batch(redis_url)
    raw = json.loads(item)
    for body in (b"[1, 2]", b"[]", b'[{"type": "task-sent"}, []]'):
        raw["body"] = base64.b64encode(body).decode()
        refused = check_fanout_item(encode(raw), CAP, channel)
        assert refused is not None, body
        assert refused.reason == "bad_body", body


def test_a_preview_shows_the_decoded_body_not_base64() -> None:
    body = json.dumps([['{"kind": "next_trial", "job_id": "j"}'], {}, {}])
    item = encode(
        {
            "body": base64.b64encode(body.encode()).decode(),
            "headers": {"task": "bso.next_trial"},
            "properties": {"body_encoding": "base64", "delivery_tag": "x"},
        }
    )
    shown = preview(item)
    assert "body (decoded)" in shown
    assert '"job_id": "j"' in shown.replace("\\", "")
    assert base64.b64encode(body.encode()).decode()[:24] not in shown
    assert shown.isascii()
    assert shown.isprintable()


def test_an_item_over_the_limit_is_dead_lettered_without_decoding_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A tenant's item of base64-encoded NULs, refused for its size: its preview used to
    decode it whole and escape every NUL as six characters, 14 times the item in a
    worker's memory (1.2 GB for 80 MB; Redis takes items of 512 MB)."""
    secret = "bso_0123456789ab_" + "s" * 43
    nuls = base64.b64encode(b"\0" * 8_000_000).decode()
    item = encode(
        {
            "headers": {keys.API_KEY_HEADER: secret},
            "properties": {"body_encoding": "base64"},
            "body": nuls,
        }
    )
    box = DeadLetters("redis://127.0.0.1:1/0", push_reply=None)
    tracemalloc.start()
    try:
        with caplog.at_level(logging.WARNING, "bso.deadletters"):
            assert not box.screen(item, keys.tenant_namespace("loud").queue)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2_000_000, peak
    (shown,) = [r.preview for r in caplog.records if hasattr(r, "preview")]
    assert shown.startswith('b\'{"headers"')
    assert shown.endswith(f"... ({len(item)} bytes)")
    assert "s" * 43 not in shown
    assert "bso_0123456789ab_***" in shown
    assert "body (decoded)" in preview(item, max_bytes=len(item))


def test_a_preview_of_deeply_nested_garbage_is_its_bytes() -> None:
    item = b"[" * 100_000
    assert preview(item).startswith("b'[[[")


def test_a_flood_of_junk_logs_a_line_per_queue_and_reason_per_window_and_counts_all(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A tenant pushing 500 junk items around its door: every one is counted and kept
    in the bounded list, but the log gets one line, then one per window saying how
    many were held back; another queue's, or another reason's, line is its own."""
    now = [0.0]
    box = DeadLetters(redis_url, log_gate=LogGate(clock=lambda: now[0]))
    flooded = keys.tenant_namespace("loud").queue_key.removeprefix(keys.BROKER_KEY_PREFIX)
    try:
        with caplog.at_level(logging.WARNING, "bso.deadletters"):
            for i in range(500):
                assert not box.screen(b"[%d]" % i, flooded)
            assert not box.screen(b"\xff", flooded)  # another reason
            assert not box.screen(b"[0]", keys.MAINTENANCE_QUEUE)  # another queue
            now[0] += LOG_EVERY_S
            assert not box.screen(b"[500]", flooded)
        lines = [(r.queue, r.reason, getattr(r, "held_back", 0)) for r in caplog.records]
        reason = lines[0][1]
        assert lines == [
            (flooded, reason, 0),
            (flooded, "not_utf8", 0),
            (keys.MAINTENANCE_QUEUE, reason, 0),
            (flooded, reason, 499),
        ]
        assert box.redis.hget(keys.DEADLETTER_COUNTS_KEY, "total") == b"503"
    finally:
        box.close()
