"""What an item on a bso queue must be before kombu or Celery may decode it.

kombu's Redis transport pops an item and indexes into it at once
(``loads(item)`` then ``payload["properties"]["delivery_tag"]`` ...); Celery
then reads headers, decodes the body with the content type it names and
unpacks it into ``args, kwargs, embed``.  Anything unexpected on that path
(``[]``, a ``{"__type__": ...}`` object that kombu's JSON hook refuses, an
unknown body encoding, a body of two elements) raises inside the consumer and
stops the worker.  :func:`check_item` is the gate in front of it: it accepts
exactly the messages bso's own publishers send (``send_task``, the client's
:func:`bso.wire.message.celery_message`, beat's sweep, and kombu's
redelivered copies of them), so that nothing downstream can raise on an
accepted item, and refuses everything else with a reason and a one-line
explanation.

It decodes with the standard library alone (``json``, ``base64``): never
pickle, never kombu's JSON object hook, so no code in an item ever runs.
Every step is linear in the item's size, and nothing is decoded from an item
over the byte limit.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Annotated, Any, Literal

from celery.utils.time import maybe_iso8601
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    field_validator,
)

from bso.wire import keys

Reason = Literal[
    "too_large",
    "not_utf8",
    "not_json",
    "bad_envelope",
    "content_type",
    "body_encoding",
    "unknown_task",
    "wrong_queue",
    "bad_body",
]
"""Why an item was refused; also the field it is counted under."""

QUEUE_OF_TASK: Mapping[str, str] = {
    **dict.fromkeys(keys.TASK_FOR_KIND.values(), keys.EVENTS_QUEUE),
    keys.TASK_STATUS: keys.EVENTS_QUEUE,
    keys.TASK_LIST_JOBS: keys.EVENTS_QUEUE,
    keys.TASK_SWEEP: keys.MAINTENANCE_QUEUE,
}
"""Every bso task and the queue it is routed to (``bso_workers.celery_app.task_routes``);
an event task also arrives on any tenant's events queue (:func:`queue_allows`)."""


def queue_allows(task: str, queue: str) -> bool:
    """Whether ``task`` may arrive on ``queue``: the sweep on the maintenance queue only,
    every other task on the shared events queue or a tenant's
    (:func:`bso.wire.keys.namespace_of_queue`)."""
    if QUEUE_OF_TASK[task] == keys.EVENTS_QUEUE:
        return keys.namespace_of_queue(queue) is not None
    return queue == QUEUE_OF_TASK[task]


TASKS_WITHOUT_ARGUMENTS = frozenset({keys.TASK_SWEEP})
"""Tasks called with no argument; every other bso task takes one JSON string."""

EMBED_KEYS = frozenset({"callbacks", "errbacks", "chain", "chord"})
"""Celery's ``embed``: what to run after the task.  bso sends none, and an item
that names any would have the worker send further tasks on its behalf."""

_NO_CONTROLS = r"^[^\x00-\x1f\x7f-\x9f]*$"
Text = Annotated[str, StringConstraints(pattern=_NO_CONTROLS)]
"""A header string: no control characters (Celery logs some of them)."""
Id = Annotated[str, StringConstraints(min_length=1, max_length=256, pattern=_NO_CONTROLS)]
Seconds = Annotated[float, Field(gt=0, le=86400, allow_inf_nan=False)]


class _Strict(BaseModel):
    """No coercion, no unknown keys: Celery copies every header into the task's request."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class DeliveryInfo(_Strict):
    exchange: Literal[""]
    routing_key: Id
    redelivered: bool = False


class Properties(_Strict):
    delivery_tag: Id
    delivery_info: DeliveryInfo
    body_encoding: Literal["base64"] | None = None
    correlation_id: Id | None = None
    reply_to: Text | None = None
    delivery_mode: Annotated[int, Field(ge=1, le=2)] | None = None
    priority: Annotated[int, Field(ge=0, le=255)] | None = None
    expiration: Annotated[str, StringConstraints(pattern=r"^[0-9]{1,12}$")] | None = None


class Headers(_Strict):
    """Celery task protocol 2's headers, as Celery 5 sends them."""

    lang: Literal["py"] = "py"
    task: str
    id: Id
    shadow: None = None
    eta: None = None
    """No ETA: a delayed task would sit in the worker's memory until then."""
    expires: Text | None = None
    group: None = None
    group_index: None = None
    retries: Annotated[int, Field(ge=0, le=1000)] = 0
    timelimit: Annotated[list[Seconds | None], Field(min_length=2, max_length=2)] | None = None
    """[hard, soft]: beat sends the app's hard limit on the sweep; prefork enforces them
    per task, so an item on an events queue must carry none (:func:`check_item`)."""
    root_id: Id | None = None
    parent_id: Id | None = None
    argsrepr: Text | None = None
    kwargsrepr: Text | None = None
    origin: Text | None = None
    ignore_result: bool | None = None
    replaced_task_nesting: Annotated[int, Field(ge=0, le=1000)] = 0
    stamped_headers: None = None
    stamps: Annotated[dict[str, None], Field(max_length=0)] = {}
    redelivered: bool = False
    celery_beat_task: bool | None = None
    """Set by beat on what it sends."""
    bso_api_key: Annotated[str, StringConstraints(max_length=256)] | None = None
    """The caller's API key (``bso.wire.keys.API_KEY_HEADER``); checked by the task, which
    answers ``unauthorized`` to a wrong one."""
    bso_sent_at: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = None
    """When the client sent it (``bso.wire.keys.SENT_AT_HEADER``), for the queue-time metric."""
    bso_reply_channel: str | None = None
    """Where the caller hears its reply announced (``bso.wire.keys.REPLY_CHANNEL_HEADER``):
    one of bso's announcement channels, nothing else a worker would publish on."""

    @field_validator("task")
    @classmethod
    def _known_task(cls, task: str) -> str:
        if task not in QUEUE_OF_TASK:
            raise ValueError("not a bso task")
        return task

    @field_validator("bso_reply_channel")
    @classmethod
    def _announcement_channel(cls, channel: str | None) -> str | None:
        if channel is not None and keys.namespace_of_channel(channel) is None:
            raise ValueError("not a bso announcement channel")
        return channel

    @field_validator("expires")
    @classmethod
    def _aware_time(cls, expires: str | None) -> str | None:
        # Parsed here with the very function Celery's Request uses, so it cannot fail there.
        if expires is not None:
            try:
                parsed = maybe_iso8601(expires)
            except Exception as exc:  # dateutil's errors are not all ValueErrors
                raise ValueError("not an ISO 8601 time") from exc
            if not isinstance(parsed, datetime) or parsed.utcoffset() != timedelta(0):
                raise ValueError("not an ISO 8601 time in UTC (+00:00)")
        return expires


class Envelope(_Strict):
    """kombu's message as its Redis transport stores it."""

    content_type: Literal["application/json"] = Field(alias="content-type")
    content_encoding: Literal["utf-8"] = Field(alias="content-encoding")
    properties: Properties
    headers: Headers
    body: Annotated[str, StringConstraints(min_length=1)]


class _Loose(BaseModel):
    """Strict types for what kombu reads; other keys are someone else's business."""

    model_config = ConfigDict(strict=True, extra="allow", frozen=True)


class FanoutProperties(_Loose):
    delivery_tag: Id
    body_encoding: Literal["base64"] | None = None
    delivery_info: dict[str, Any] | None = None


class FanoutEnvelope(_Loose):
    """A broadcast (remote control) message: what kombu indexes into before Celery's
    pidbox handler, which survives any body that decodes into a JSON object."""

    content_type: Literal["application/json"] = Field(alias="content-type")
    content_encoding: Literal["utf-8"] = Field(alias="content-encoding")
    properties: FanoutProperties
    headers: dict[str, Any] = {}
    body: Annotated[str, StringConstraints(min_length=1)]


@dataclass(frozen=True)
class Refused:
    """Why an item may not be decoded, and the event inside it if one could be read."""

    reason: Reason
    why: str
    event: Mapping[str, object] | None = None
    """The JSON object in the body's first argument (a bso event or status query),
    read with plain ``json`` for its reply key only."""
    reply_channel: str | None = None
    """The caller's announcement channel, if the item names a well-formed one."""


def _json_object(item: bytes, max_bytes: int) -> dict[str, Any] | Refused:
    """``item`` parsed, if it is within the size limit and a JSON object (any message)."""
    if len(item) > max_bytes:
        return Refused(
            "too_large",
            f"{len(item)} bytes, over the {max_bytes} byte limit (BSO_MAX_QUEUE_ITEM_BYTES)",
        )
    parsed = _parse_json(item, "the item")
    if isinstance(parsed, Refused):
        return parsed
    if not isinstance(parsed, dict):
        return Refused("bad_envelope", f"a kombu message is a JSON object, not {_kind(parsed)}")
    return parsed


def check_item(item: bytes, queue: str, max_bytes: int) -> Refused | None:
    """None if kombu and Celery may decode ``item``, popped from ``queue``; else why not."""
    parsed = _json_object(item, max_bytes)
    if isinstance(parsed, Refused):
        return parsed
    try:
        envelope = Envelope.model_validate(parsed)
    except ValidationError as exc:
        return Refused(_reason(exc), describe(exc), event_in(parsed), channel_in(parsed, queue))
    task = envelope.headers.task
    routing_key = envelope.properties.delivery_info.routing_key
    allowed = queue_allows(task, queue)
    if not allowed or routing_key != queue:
        why = (
            f"{task} belongs on {QUEUE_OF_TASK[task]}, not on {queue}"
            if not allowed
            else f"its routing key {routing_key!r} names another queue than {queue}, where "
            "it was pushed"
        )
        return Refused("wrong_queue", why, event_in(parsed), channel_in(parsed, queue))
    if keys.namespace_of_queue(queue) is not None and any(envelope.headers.timelimit or ()):
        return Refused(
            "bad_envelope",
            "headers.timelimit: an event carries no time limit of its own (the workers apply "
            "bso's; under prefork Celery would run the sender's, killing the pool process)",
            event_in(parsed),
            channel_in(parsed, queue),
        )
    channel = envelope.headers.bso_reply_channel
    if channel is not None and keys.namespace_of_channel(channel) != _namespace(queue):
        return Refused(
            "wrong_queue",
            f"an item on {queue} asks for its reply to be announced on a channel of "
            "another namespace (a tenant hears its replies on its own channels only)",
            event_in(parsed),
        )
    body = _decode_body(envelope.body, envelope.properties.body_encoding)
    if isinstance(body, Refused):
        return body
    problem = _body_problem(body, task)
    if problem is not None:
        return Refused("bad_body", problem, event_in(parsed), channel_in(parsed, queue))
    return None


_EVENT_CHANNEL = re.compile(r"(?:[^/]*:)?/\d+\.celeryev(?:/[^/]*)?")
"""kombu's Redis channel for Celery's monitoring events (exchange ``celeryev``):
``/<db>.celeryev/<routing key>``, e.g. ``/0.celeryev/task.multi``, after kombu's
global key prefix where the subscriber sees it (``bso:broker:``)."""


def is_event_channel(channel: str) -> bool:
    """Whether ``channel`` carries Celery's monitoring events (what Flower listens to)."""
    return _EVENT_CHANNEL.fullmatch(channel) is not None


def check_fanout_item(item: bytes, max_bytes: int, channel: str = "") -> Refused | None:
    """None if kombu may decode ``item``, published on the broadcast channel ``channel``.

    Remote control (``celery.pidbox``) bodies are one JSON object.  Celery's
    monitoring events (:func:`is_event_channel`) are one object, or a list of
    objects when a worker batches them (``task.multi``): Celery's own event
    receiver, the one Flower runs, walks such a list.  Refusing it would hide
    every task from Flower and fill the dead letters with Celery's own traffic.
    """
    parsed = _json_object(item, max_bytes)
    if isinstance(parsed, Refused):
        return parsed
    try:
        envelope = FanoutEnvelope.model_validate(parsed)
    except ValidationError as exc:
        return Refused(_reason(exc), describe(exc))
    if "compression" in envelope.headers:
        return Refused("bad_envelope", "headers.compression: bso sends no compressed message")
    body = _decode_body(envelope.body, envelope.properties.body_encoding)
    if isinstance(body, Refused):
        return body
    if isinstance(body, dict):
        return None
    if is_event_channel(channel) and isinstance(body, list) and body:
        if all(isinstance(event, dict) for event in body):
            return None
        return Refused("bad_body", "an event batch must be a list of JSON objects")
    return Refused("bad_body", f"the body is {_kind(body)}, not a JSON object")


def event_in(envelope: Mapping[str, Any]) -> Mapping[str, object] | None:
    """The JSON object in the body's first argument, if the body reads that far; for
    the reply key of an item refused for some other reason.  Never raises."""
    properties = envelope.get("properties")
    encoding = properties.get("body_encoding") if isinstance(properties, dict) else None
    body = envelope.get("body")
    if not isinstance(body, str) or encoding not in (None, "base64"):
        return None
    decoded = _decode_body(body, encoding)
    if not isinstance(decoded, list) or not decoded or not isinstance(decoded[0], list):
        return None
    args = decoded[0]
    if not args or not isinstance(args[0], str):
        return None
    event = _parse_json(args[0].encode("utf-8", "surrogatepass"), "the event")
    return event if isinstance(event, dict) else None


def channel_in(envelope: Mapping[str, Any], queue: str) -> str | None:
    """The item's announcement channel header, if it is one of the namespace of the
    queue it was popped from (only such a channel may be published on, whatever else
    is wrong with the item)."""
    headers = envelope.get("headers")
    channel = headers.get(keys.REPLY_CHANNEL_HEADER) if isinstance(headers, dict) else None
    return channel if _namespace(queue).is_announce_channel(channel) else None


def _namespace(queue: str) -> keys.Namespace:
    """The namespace of a queue's callers: the tenant's of its queue; the shared one of
    the shared events queue and the maintenance queue (only workers push there)."""
    return keys.namespace_of_queue(queue) or keys.SHARED


MAX_ERRORS_SHOWN = 5
"""An item with ten thousand unknown keys gets a short explanation all the same."""


def describe(exc: ValidationError, whole: str = "(item)", message_limit: int | None = 100) -> str:
    """Pydantic's first errors in one line: field paths (a made-up field name escaped,
    never with raw control characters) and messages cut at ``message_limit`` (None:
    whole), never
    the input; ``whole`` names an error of the whole thing.  The same line serves a
    refused item and an event that does not validate (its ``invalid_event`` reply
    and the worker's log): with every error named, an event of 720 KB with 20,000
    unknown fields made each a megabyte."""
    errors = exc.errors(include_url=False, include_input=False, include_context=False)
    shown = "; ".join(
        f"{'.'.join(_escape(str(p)) for p in err['loc']) or whole}: {err['msg'][:message_limit]}"
        for err in errors[:MAX_ERRORS_SHOWN]
    )
    more = len(errors) - MAX_ERRORS_SHOWN
    return f"{shown}; and {more} more" if more > 0 else shown


def _reason(exc: ValidationError) -> Reason:
    """The most specific reason among a refused envelope's errors."""
    present = {err["loc"] for err in exc.errors() if err["type"] != "missing"}
    if {("content-type",), ("content-encoding",)} & present:
        return "content_type"
    if ("properties", "body_encoding") in present:
        return "body_encoding"
    if ("headers", "task") in present:
        return "unknown_task"
    return "bad_envelope"


def _parse_json(data: bytes, what: str) -> Any:
    """``data`` as JSON text in UTF-8 whose strings are all valid Unicode, or a Refused."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return Refused("not_utf8", f"{what} is not UTF-8 (byte {exc.start})")
    try:
        value = json.loads(text, object_hook=_no_type_marker)
        # A \ud800 escape decodes to a lone surrogate, which no Redis command can encode.
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return Refused("not_utf8", f"{what} holds a lone surrogate (\\ud800-\\udfff)")
    except _TypeMarker:
        return Refused("bad_envelope", f"{what} holds a kombu type marker ({_MARKER})")
    except RecursionError:
        return Refused("not_json", f"{what} nests too deeply")
    except ValueError as exc:
        return Refused("not_json", f"{what} is not JSON ({type(exc).__name__}: {exc})"[:200])
    return value


_MARKER = '{"__type__": ..., "__value__": ...}'


class _TypeMarker(ValueError):
    """kombu's JSON decoder turns such an object into a datetime, Decimal, UUID or
    bytes, and some of those conversions raise errors nobody catches."""


def _no_type_marker(obj: dict[str, Any]) -> dict[str, Any]:
    if obj.keys() == {"__type__", "__value__"}:
        raise _TypeMarker
    return obj


def _decode_body(body: str, encoding: str | None) -> Any:
    """The body as kombu would decode it (base64 or as is), then as JSON, or a Refused."""
    if encoding == "base64":
        try:
            data = base64.b64decode(body, validate=True)
        except (binascii.Error, ValueError):
            return Refused("bad_body", "the body is not valid base64")
    else:
        data = body.encode("utf-8", "surrogatepass")
    decoded = _parse_json(data, "the body")
    if isinstance(decoded, Refused):
        return Refused("bad_body", decoded.why)
    return decoded


def _body_problem(body: Any, task: str) -> str | None:
    """What is wrong with a decoded body for ``task``, or None."""
    if not isinstance(body, list) or len(body) != 3:
        return f"the body is {_kind(body)}, not Celery protocol 2's [args, kwargs, embed]"
    args, kwargs, embed = body
    if not isinstance(embed, dict) or not embed.keys() <= EMBED_KEYS:
        return "the body's embed is not {callbacks, errbacks, chain, chord}"
    if any(value is not None for value in embed.values()):
        return "the body names callbacks, errbacks, a chain or a chord; bso sends none"
    if kwargs != {}:
        return "the body has keyword arguments; bso tasks take none"
    if task in TASKS_WITHOUT_ARGUMENTS:
        if args != []:
            return f"{task} takes no arguments"
    elif not (isinstance(args, list) and len(args) == 1 and isinstance(args[0], str)):
        return f"{task} takes one argument, the event as a JSON string"
    return None


def _kind(value: object) -> str:
    if isinstance(value, list):
        return f"a list of {len(value)}"
    return "null" if value is None else f"a {type(value).__name__}"


def _escape(text: str, limit: int = 60) -> str:
    """``text`` as is if short and printable, else its truncated ``repr``."""
    return text if len(text) <= limit and text.isprintable() else repr(text)[:limit]
