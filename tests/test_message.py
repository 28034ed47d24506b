"""The queue message the client builds without Celery (bso.wire.message).

That real workers take it is checked in tests/test_celery_versions.py.
"""

from __future__ import annotations

import json

from celery import Celery

from bso.wire import keys
from bso.wire.message import celery_message


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
