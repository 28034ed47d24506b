"""One Celery task per event: a thin shell around :meth:`BsoService.handle`.

Each task does what a web view would: decode the payload, validate it into an
event model, let the service apply it (one store transaction, which also
serializes the job across processes and dedupes on the event id), and only
*after* that commit push the reply onto the event's reply key.  A worker that
dies anywhere in between leaves either nothing or a committed event whose
redelivery (``acks_late``) finds the recorded reply and pushes it again.

Nothing a caller sends can crash the worker: a payload that does not parse
gets an ``invalid_event`` error reply when its reply key can be recovered and
is logged and dropped otherwise; an unexpected exception rolls the
transaction back and answers an error reply that says nothing was applied.
The one deliberate death is the hard time limit's (:mod:`bso_workers.limits`);
an event that keeps causing deaths is dropped (:mod:`bso_workers.deaths`).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

import redis
from celery import Celery, Task
from pydantic import ValidationError

from bso.errors import BsoError, InvalidEvent, PoisonEvent, Unauthorized
from bso.service import BsoService
from bso.storage.base import Store
from bso.storage.sql import SqlStore
from bso.wire import keys
from bso.wire.events import (
    EVENT_ADAPTER,
    EndTrial,
    EpochReport,
    ErrorReply,
    Event,
    RegisterJob,
    Reply,
)
from bso.wire.jobs_query import JobList, ListJobs
from bso.wire.keys import SHARED, Namespace
from bso.wire.replies import RedisReplyBackend, ReplyBackend
from bso.wire.status_query import StatusQuery, StatusReply
from bso_workers.deaths import RedisDeathCounter
from bso_workers.envelope import describe
from bso_workers.failures import failure_reply, log_failure
from bso_workers.limits import TimeLimits
from bso_workers.message_headers import api_key_of, namespace_of, reply_channel_of, sent_at_of
from bso_workers.metrics import observe_event
from bso_workers.queue_bounds import QueueBounds
from bso_workers.settings import WorkerSettings
from bso_workers.shared_clock import SharedClock, redis_clock
from bso_workers.task_request import REQUEST_CLASS
from bso_workers.task_results import reply_summary

log = logging.getLogger("bso.tasks")


class WorkerRuntime:
    """The store, service, reply backend, death counter and time limits of one
    worker process.

    Created on first use, that is in the process that runs the tasks (a solo
    node itself, or a prefork pool process after Celery's fork), so no database
    connection or socket is ever shared between processes.  A
    failed creation is not cached: the next task tries again.
    """

    def __init__(
        self,
        settings: WorkerSettings,
        *,
        store_factory: Callable[[], Store] | None = None,
        replies_factory: Callable[[], ReplyBackend] | None = None,
        deaths_factory: Callable[[], RedisDeathCounter] | None = None,
        bounds_factory: Callable[[], QueueBounds] | None = None,
        clock_factory: Callable[[], Callable[[], datetime]] | None = None,
    ) -> None:
        """``clock_factory``: the service's clock; by default the node's own, corrected
        to Redis's where they differ by more than a second (:mod:`bso_workers.shared_clock`),
        so that leases measured between two nodes' readings do not depend on a node's
        clock being minutes off."""
        self.settings = settings
        self._clock_factory = clock_factory or (lambda: redis_clock(settings.broker_url))
        self._store_factory = store_factory or (lambda: SqlStore(settings.database_url))
        self._replies_factory = replies_factory or (lambda: RedisReplyBackend(settings.broker_url))
        self._deaths_factory = deaths_factory or (lambda: RedisDeathCounter(settings.broker_url))
        self._bounds_factory = bounds_factory or (
            lambda: QueueBounds(redis.Redis.from_url(settings.broker_url))
        )
        self._bounds: QueueBounds | None = None
        self._service: BsoService | None = None
        self._replies: ReplyBackend | None = None
        self._deaths: RedisDeathCounter | None = None
        self.limits = TimeLimits(settings.soft_time_limit_s, settings.time_limit_s)

    @property
    def service(self) -> BsoService:
        if self._service is None:
            self._service = BsoService(self._store_factory(), clock=self._clock_factory())
        return self._service

    @property
    def replies(self) -> ReplyBackend:
        if self._replies is None:
            self._replies = self._replies_factory()
        return self._replies

    @property
    def deaths(self) -> RedisDeathCounter:
        if self._deaths is None:
            self._deaths = self._deaths_factory()
        return self._deaths

    @property
    def bounds(self) -> QueueBounds:
        if self._bounds is None:
            self._bounds = self._bounds_factory()
        return self._bounds

    def close(self) -> None:
        if self._bounds is not None:
            self._bounds.redis.close()
            self._bounds = None
        if self._deaths is not None:
            self._deaths.close()
            self._deaths = None
        if self._service is not None:
            self._service.store.close()
            if isinstance(self._service.clock, SharedClock):
                self._service.clock.close()
            self._service = None
        if self._replies is not None:
            self._replies.close()
            self._replies = None

    def push(self, key: str, reply_json: str, announce_to: str | None = None) -> None:
        """Store a reply, announced on the caller's channel when its message named one."""
        self.replies.push(key, reply_json, self.settings.reply_ttl_s, announce_to)


def event_errors(exc: ValidationError) -> str:
    """What the caller of an event that does not validate is told, and the worker logs:
    the envelope's one line of errors (:func:`~bso_workers.envelope.describe`), each
    message whole, for the caller to act on."""
    return describe(exc, "(event)", message_limit=None)


def decode(payload: object) -> dict[str, Any] | None:
    """The payload as a JSON object, or None when it is not one (also when it nests too
    deeply to parse: the worker's screen checks the envelope, not the event inside it,
    and an exception here would fail the task with the whole payload in its log line)."""
    if isinstance(payload, dict):
        return payload
    if not isinstance(payload, str | bytes):
        return None
    try:
        raw = json.loads(payload)
    except (ValueError, RecursionError):  # RecursionError: nested too deeply to be an event
        return None
    return raw if isinstance(raw, dict) else None


def _preview(payload: object) -> str:
    """The start of a payload for a log line; never fails (a huge int has no repr)."""
    try:
        return repr(payload)[:300]
    except ValueError:
        return f"<{type(payload).__name__} that has no printable form>"


def reject(
    runtime: WorkerRuntime,
    task_name: str,
    payload: object,
    why: str,
    reply_channel: str | None = None,
    *,
    namespace: Namespace = SHARED,
) -> None:
    """Answer an event that cannot be applied with ``invalid_event``, or drop it."""
    raw = decode(payload)
    key = namespace.reply_key_for(raw) if raw is not None else None
    fields = {"task": task_name, "why": why, "payload": _preview(payload)}
    if raw is None or key is None:
        log.warning("dropped an event without a reply key", extra=fields)
        return
    event_id = raw["event_id"]
    log.warning("rejected an invalid event", extra={**fields, "event_id": event_id})
    reply = ErrorReply(event_id=event_id, code=InvalidEvent.code, message=why)
    runtime.push(key, reply.model_dump_json(), reply_channel)


def poison_reply(
    runtime: WorkerRuntime, event: Event, fields: dict[str, object], tenant: str | None = None
) -> ErrorReply | None:
    """Count the death that caused this redelivery; past the limit, the reply that drops
    it.  ``fields``: the event's log fields (:func:`trace_fields`)."""
    deaths = runtime.deaths.record(event.event_id, tenant)
    if deaths < runtime.settings.max_worker_deaths:
        log.warning("event delivered again", extra={**fields, "deaths": deaths})
        return None
    log.error("poison event dropped", extra={**fields, "deaths": deaths})
    return ErrorReply(
        event_id=event.event_id,
        code=PoisonEvent.code,
        message=f"the worker running event {event.event_id} died {deaths} times (hard time "
        f"limit of {runtime.settings.time_limit_s:g} s, out of memory or a crash); the event "
        "is dropped, see the worker logs",
    )


def authenticate(runtime: WorkerRuntime, api_key: str | None, namespace: Namespace) -> str:
    """The tenant of ``api_key``; an event from a tenant's queue must carry one of that
    tenant's keys (only its Redis user can push there, so another tenant's key in it
    was stolen or mixed up: refused like a wrong key)."""
    tenant = runtime.service.authenticate(api_key)
    if namespace.tenant is not None and tenant != namespace.tenant:
        raise Unauthorized(
            f"the API key is not one of tenant {namespace.tenant}'s, whose Redis user sent "
            "the event: use the key and the URL from the same team file"
        )
    return tenant


def refused_past_the_bound(runtime: WorkerRuntime, request: Any, payload: object) -> str | None:
    """Answer :class:`~bso.errors.RateLimited` to the message ``request`` runs if it came
    from a tenant's queue filled past its bound around the door
    (:mod:`bso_workers.queue_bounds`), before any database work; its summary, or
    None for an event to handle."""
    namespace = namespace_of(request)
    if namespace.tenant is None:
        return None
    started, started_wall = time.perf_counter(), time.time()
    refused = runtime.bounds.refusal(namespace)
    if refused is None:
        return None
    raw = decode(payload)
    key = namespace.reply_key_for(raw) if raw is not None else None
    if raw is not None and key is not None:
        reply = ErrorReply(event_id=raw["event_id"], code=refused.code, message=refused.message)
        runtime.push(key, reply.model_dump_json(), reply_channel_of(request))
    observe_event("refused", refused.code, started, None, started_wall)
    return f"error code={refused.code}"


def trace_fields(event: Event) -> dict[str, object]:
    """Log fields naming the event: its id, job and trial where it has them."""
    fields: dict[str, object] = {"event_id": event.event_id, "kind": event.kind}
    job_id = event.spec.job_id if isinstance(event, RegisterJob) else event.job_id
    if job_id is not None:
        fields["job_id"] = job_id
    if isinstance(event, EpochReport | EndTrial):
        fields["trial"] = event.trial_number
    return fields


def process_event(
    runtime: WorkerRuntime,
    task_name: str,
    payload: object,
    *,
    api_key: str | None,
    redelivered: bool = False,
    sent_at: float | None = None,
    reply_channel: str | None = None,
    namespace: Namespace = SHARED,
) -> str:
    """Body of every event task; see the module docstring; returns the reply's
    summary (:func:`~bso_workers.task_results.reply_summary`), which Flower shows.  ``api_key``: the
    message's ``bso_api_key`` header (:data:`bso.wire.keys.API_KEY_HEADER`), checked
    before anything is read or written.  ``redelivered``: kombu put this message
    back on the queue after an earlier delivery was not acknowledged.  ``sent_at``:
    when the client sent it (:data:`bso.wire.keys.SENT_AT_HEADER`), for the metrics.
    ``reply_channel``: where the caller hears its reply announced
    (:data:`bso.wire.keys.REPLY_CHANNEL_HEADER`).  ``namespace``: that of the queue the
    message came from, where its reply goes."""
    started, started_wall = time.perf_counter(), time.time()
    raw = decode(payload)
    why: str | None = None
    if raw is None:
        why = "the payload is not a JSON object"
    else:
        try:
            event = EVENT_ADAPTER.validate_python(raw)
        except ValidationError as exc:
            why = f"invalid event: {describe(exc, '(event)', message_limit=None)}"
        else:
            expected = keys.TASK_FOR_KIND[event.kind]
            if expected != task_name:
                why = f"a {event.kind} event belongs to {expected}, not {task_name}"
    if why is not None:
        reject(runtime, task_name, payload, why, reply_channel, namespace=namespace)
        observe_event("invalid", InvalidEvent.code, started, sent_at, started_wall)
        return f"error code={InvalidEvent.code}"
    assert raw is not None
    key = namespace.reply_key_for(raw)
    assert key is not None, "a valid event has an event id"
    fields = trace_fields(event)
    poison = poison_reply(runtime, event, fields, namespace.tenant) if redelivered else None
    if poison is not None:
        runtime.push(key, poison.model_dump_json(), reply_channel)
        observe_event(event.kind, poison.code, started, sent_at, started_wall)
        return reply_summary(poison, fields.get("job_id"))
    reply: Reply
    try:
        tenant = authenticate(runtime, api_key, namespace)
        fields["tenant"] = tenant  # job ids are per tenant: the log names whose job
        reply = runtime.service.handle(event, tenant)
    except BsoError as exc:  # refused key: nothing was read or written
        reply = ErrorReply(event_id=event.event_id, code=exc.code, message=exc.message)
    except Exception as exc:  # the transaction rolled back; tell the caller why
        log_failure(log, "event", exc, fields)
        reply = failure_reply(event.event_id, exc)
    runtime.push(key, reply.model_dump_json(), reply_channel)
    fields.update(reply=reply.kind, ms=round((time.perf_counter() - started) * 1000, 2))
    if isinstance(reply, ErrorReply):
        fields["code"] = reply.code
    log.info("event handled", extra=fields)
    outcome = reply.code if isinstance(reply, ErrorReply) else "ok"
    observe_event(event.kind, outcome, started, sent_at, started_wall)
    return reply_summary(reply, fields.get("job_id"), fields.get("tenant"))


def process_status(
    runtime: WorkerRuntime,
    payload: object,
    *,
    api_key: str | None,
    sent_at: float | None = None,
    reply_channel: str | None = None,
    namespace: Namespace = SHARED,
) -> str:
    """Body of the status task: a read, answered like an event but never recorded;
    only the job's own tenant may read it.  Returns the reply's summary."""
    started, started_wall = time.perf_counter(), time.time()
    raw = decode(payload)
    key = namespace.reply_key_for(raw) if raw is not None else None
    if key is None:  # no usable event id: nowhere to answer (the model would make one up)
        reject(runtime, keys.TASK_STATUS, payload, "a status query needs a valid event_id")
        return f"error code={InvalidEvent.code}"  # (no key, so nothing to announce either)
    try:
        query = StatusQuery.model_validate(raw)
    except ValidationError as exc:
        why = f"invalid status query: {describe(exc, '(event)', message_limit=None)}"
        reject(runtime, keys.TASK_STATUS, payload, why, reply_channel, namespace=namespace)
        return f"error code={InvalidEvent.code}"
    reply: StatusReply | ErrorReply
    tenant: str | None = None  # Flower's line names it once the key was checked
    try:
        tenant = authenticate(runtime, api_key, namespace)
        reply = StatusReply(
            event_id=query.event_id, status=runtime.service.status(query.job_id, tenant)
        )
    except BsoError as exc:
        reply = ErrorReply(event_id=query.event_id, code=exc.code, message=exc.message)
    except Exception as exc:
        log_failure(log, "status read", exc, {"job_id": query.job_id})
        reply = failure_reply(query.event_id, exc)
    runtime.push(key, reply.model_dump_json(), reply_channel)
    outcome = reply.code if isinstance(reply, ErrorReply) else "ok"
    observe_event("status", outcome, started, sent_at, started_wall)
    return reply_summary(reply, query.job_id, tenant)


def process_list_jobs(
    runtime: WorkerRuntime,
    payload: object,
    *,
    api_key: str | None,
    sent_at: float | None = None,
    reply_channel: str | None = None,
    namespace: Namespace = SHARED,
) -> str:
    """Body of the list-jobs task: a read like the status query, never recorded; the
    reply lists the API key's own tenant's jobs and no other."""
    started, started_wall = time.perf_counter(), time.time()
    raw = decode(payload)
    key = namespace.reply_key_for(raw) if raw is not None else None
    if key is None:
        reject(runtime, keys.TASK_LIST_JOBS, payload, "a job list query needs a valid event_id")
        return f"error code={InvalidEvent.code}"
    try:
        query = ListJobs.model_validate(raw)
    except ValidationError as exc:
        why = f"invalid job list query: {describe(exc, '(event)', message_limit=None)}"
        reject(runtime, keys.TASK_LIST_JOBS, payload, why, reply_channel, namespace=namespace)
        return f"error code={InvalidEvent.code}"
    reply: JobList | ErrorReply
    tenant: str | None = None
    try:
        tenant = authenticate(runtime, api_key, namespace)
        reply = JobList(event_id=query.event_id, jobs=runtime.service.list_jobs(tenant))
    except BsoError as exc:
        reply = ErrorReply(event_id=query.event_id, code=exc.code, message=exc.message)
    except Exception as exc:
        log_failure(log, "job list read", exc, {})
        reply = failure_reply(query.event_id, exc)
    runtime.push(key, reply.model_dump_json(), reply_channel)
    outcome = reply.code if isinstance(reply, ErrorReply) else "ok"
    observe_event("list_jobs", outcome, started, sent_at, started_wall)
    return reply_summary(reply, tenant=tenant)


def sweep(runtime: WorkerRuntime, now: datetime | None = None) -> dict[str, int]:
    """Fail trials whose client went silent; forget replies older than the retention."""
    service = runtime.service
    failed = service.interrupt_stale_trials(runtime.settings.heartbeat_timeout)
    cutoff = (now or service.clock()) - runtime.settings.reply_retention
    pruned = service.store.prune_replies(cutoff)
    for job_id, trial in failed:
        log.warning(
            "trial interrupted: its caller went silent past its lease",
            extra={"job_id": job_id, "trial": trial},
        )
    summary = {"interrupted_trials": len(failed), "pruned_replies": pruned}
    log.info("sweep done", extra=summary)
    return summary


def register_tasks(app: Celery, runtime: WorkerRuntime) -> None:
    """Define the event, status and sweep tasks on ``app``, all bound to ``runtime``.

    ``shared=False``: Celery otherwise adds every task to a process-wide registry
    that each new app inherits, so a second app (a test's, the launcher's ping
    app) would silently run the first app's tasks with the first app's runtime.
    Every task body runs under bso's time limits (:mod:`bso_workers.limits`); every
    task a sender can name repeats at most a bounded preview of its arguments
    (:mod:`bso_workers.task_request`).
    """
    for task_name in keys.TASK_FOR_KIND.values():
        _register_event_task(app, runtime, task_name)

    @app.task(name=keys.TASK_STATUS, shared=False, bind=True, Request=REQUEST_CLASS)
    def status(self: Task[Any, str], payload: object) -> str:
        with runtime.limits.enforce(keys.TASK_STATUS):
            return refused_past_the_bound(runtime, self.request, payload) or process_status(
                runtime,
                payload,
                api_key=api_key_of(self.request),
                sent_at=sent_at_of(self.request),
                reply_channel=reply_channel_of(self.request),
                namespace=namespace_of(self.request),
            )

    @app.task(name=keys.TASK_LIST_JOBS, shared=False, bind=True, Request=REQUEST_CLASS)
    def list_jobs(self: Task[Any, str], payload: object) -> str:
        with runtime.limits.enforce(keys.TASK_LIST_JOBS):
            return refused_past_the_bound(runtime, self.request, payload) or process_list_jobs(
                runtime,
                payload,
                api_key=api_key_of(self.request),
                sent_at=sent_at_of(self.request),
                reply_channel=reply_channel_of(self.request),
                namespace=namespace_of(self.request),
            )

    @app.task(name=keys.TASK_SWEEP, shared=False)
    def sweep_task() -> dict[str, int]:
        with runtime.limits.enforce(keys.TASK_SWEEP):
            return sweep(runtime)


def _register_event_task(app: Celery, runtime: WorkerRuntime, task_name: str) -> None:
    @app.task(name=task_name, shared=False, bind=True, Request=REQUEST_CLASS)
    def event_task(self: Task[Any, str], payload: object) -> str:
        redelivered = bool((self.request.delivery_info or {}).get("redelivered"))
        with runtime.limits.enforce(task_name):
            return refused_past_the_bound(runtime, self.request, payload) or process_event(
                runtime,
                task_name,
                payload,
                api_key=api_key_of(self.request),
                redelivered=redelivered,
                sent_at=sent_at_of(self.request),
                reply_channel=reply_channel_of(self.request),
                namespace=namespace_of(self.request),
            )
