"""The queue message the client builds without Celery (bso.wire.message).

That real workers take it is checked in tests/test_celery_versions.py.
"""

from __future__ import annotations

import json

from celery import Celery

from bso.spec import Hardware
from bso.wire import keys
from bso.wire.events import DeliverDetachedRun, DetachedEpoch
from bso.wire.message import MAX_REPR_CHARS, celery_message


def test_the_message_carries_every_header_celerys_own_publisher_sets() -> None:
    """What Celery's ``send_task`` would put in a message for the same task, id and
    argument, ours has too, with the same task, id and argument."""
    app = Celery("probe", set_as_current=False)
    sent = app.amqp.as_task_v2("id-1", keys.TASK_NEXT_TRIAL, args=("{}",), kwargs={})
    ours = json.loads(celery_message(keys.TASK_NEXT_TRIAL, "{}", "id-1"))
    assert set(sent.headers) <= set(ours["headers"])
    assert ours["headers"]["task"] == sent.headers["task"] == keys.TASK_NEXT_TRIAL
    assert ours["headers"]["id"] == sent.headers["id"] == "id-1"
    assert ours["properties"]["correlation_id"] == "id-1"
    assert json.loads(ours["body"])[0] == ["{}"]


def test_the_api_key_travels_in_its_own_header_not_in_the_arguments() -> None:
    message = json.loads(celery_message(keys.TASK_NEXT_TRIAL, "{}", "id-2", api_key="bso_x.y"))
    assert message["headers"][keys.API_KEY_HEADER] == "bso_x.y"
    assert "bso_x.y" not in message["body"]
    assert "bso_x.y" not in message["headers"]["argsrepr"]
    assert message["properties"]["delivery_info"]["routing_key"] == keys.EVENTS_QUEUE


def test_the_reply_channel_travels_in_its_own_header() -> None:
    channel = keys.SHARED.announce_channel("0f" * 16)
    message = json.loads(celery_message(keys.TASK_EPOCH, "{}", "id-3", reply_channel=channel))
    assert message["headers"][keys.REPLY_CHANNEL_HEADER] == channel
    plain = json.loads(celery_message(keys.TASK_EPOCH, "{}", "id-4"))
    assert keys.REPLY_CHANNEL_HEADER not in plain["headers"]


def test_the_payload_travels_once_with_a_bounded_preview_for_flower() -> None:
    """A detached run of 7,000 epochs (the models accept 100,000): with the whole payload
    in ``argsrepr`` too, its message was twice its size, over the workers' 1 MiB item
    limit from 4,200 epochs on, and dead-lettered with no reply (the run's journal was
    sent again at every later run, never delivered)."""
    epochs = [
        DetachedEpoch(epoch=i, time_s=1234.567891 * i, energy_j=987654.321 * i, metric=0.8123)
        for i in range(1, 7001)
    ]
    run = DeliverDetachedRun(job_id="j", hardware=Hardware(), batch_size=64, epochs=epochs)
    payload = run.model_dump_json()
    message = celery_message(keys.TASK_DETACHED_RUN, payload, "id-4", api_key="bso_x.y")
    assert len(message) <= keys.DEFAULT_MAX_QUEUE_ITEM_BYTES
    argsrepr = json.loads(message)["headers"]["argsrepr"]
    assert len(argsrepr) == MAX_REPR_CHARS
    assert argsrepr.startswith(repr((payload,))[:100])
    assert argsrepr.endswith("...")
    assert json.loads(json.loads(message)["body"])[0] == [payload]
