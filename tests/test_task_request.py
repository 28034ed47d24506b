"""What a worker repeats of a message's arguments (bso_workers/task_request.py).

A tenant's user may push items of its own making onto its queue; the screen bounds
the whole item (1 MiB), not Celery's ``argsrepr`` header, which the worker copied
into the ``task-received`` event Flower keeps.  Here the message goes through
Celery's own strategy, as on a worker, and the event carries a bounded preview.
"""

from __future__ import annotations

import json
from typing import Any
from unittest import mock

import pytest
from celery.utils.imports import symbol_by_name
from celery.worker.strategy import default
from kombu import Message

from bso.wire import keys
from bso.wire.message import MAX_REPR_CHARS, bounded_repr, celery_message
from bso_workers.celery_app import create_app
from bso_workers.task_request import BoundedRequest
from tests.test_tasks import settings

SENDER_TASKS = [*keys.TASK_FOR_KIND.values(), keys.TASK_STATUS, keys.TASK_LIST_JOBS]
"""Every task a tenant can name on its queue."""


def received_event(task_name: str, argsrepr: str, kwargsrepr: str) -> dict[str, Any]:
    """The ``task-received`` event a worker publishes for a message with these previews."""
    app = create_app(settings())
    raw = json.loads(celery_message(task_name, '{"event_id": "e1"}', "e1.1", "bso.events.t.team-b"))
    raw["headers"].update(argsrepr=argsrepr, kwargsrepr=kwargsrepr)
    message = Message(
        body=raw["body"],
        headers=raw["headers"],
        content_type=raw["content-type"],
        content_encoding=raw["content-encoding"],
        delivery_info=raw["properties"]["delivery_info"],
        properties=raw["properties"],
    )
    consumer = mock.MagicMock(disable_rate_limits=True)
    consumer.controller.state.revoked = set()
    consumer.event_dispatcher.enabled = True
    handler = default(app.tasks[task_name], app, consumer)
    handler(message, None, mock.Mock(), mock.Mock(), [])
    sent = [
        c for c in consumer.event_dispatcher.send.call_args_list if c.args == ("task-received",)
    ]
    assert len(sent) == 1
    return dict(sent[0].kwargs)


@pytest.mark.parametrize("task_name", SENDER_TASKS)
def test_every_task_a_sender_names_repeats_a_bounded_preview(task_name: str) -> None:
    event = received_event(task_name, "A" * 900_000, "K" * 5_000)
    assert len(event["args"]) == len(event["kwargs"]) == MAX_REPR_CHARS
    assert event["args"] == "A" * (MAX_REPR_CHARS - 3) + "..."


def test_a_short_preview_is_repeated_as_sent() -> None:
    event = received_event(keys.TASK_EPOCH, '(\'{"job_id": "nightly"}\',)', "{}")
    assert (event["args"], event["kwargs"]) == ('(\'{"job_id": "nightly"}\',)', "{}")


def test_every_sender_task_uses_the_bounded_request() -> None:
    app = create_app(settings())
    for name in SENDER_TASKS:
        assert symbol_by_name(app.tasks[name].Request) is BoundedRequest, name


def test_bounded_keeps_what_is_not_a_string() -> None:
    assert bounded_repr(None) is None
    assert bounded_repr("x" * MAX_REPR_CHARS) == "x" * MAX_REPR_CHARS
