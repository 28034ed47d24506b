"""The caller's side of the pipeline: publish an event, wait for its reply.

:class:`ServiceClient` mirrors :class:`bso.service.BsoService` method for
method, but every call crosses Redis: the event goes to a Celery queue by task
*name* (this module needs neither the worker code nor SQLAlchemy), and the
reply comes back on the event's own reply key (:mod:`bso.wire.keys`), which the
caller waits for (:meth:`bso.wire.replies.ReplyBackend.pop`: woken by the reply's
announcement, polling only as a safety net).

The wait / retry / timeout logic lives here once, behind two small interfaces
(:class:`Publisher` and :class:`bso.wire.replies.ReplyBackend`):

* wait ``timeout_s`` for the reply; on timeout publish *the same event* again
  (same event id, so the service applies it at most once and answers every
  copy with the same reply) and wait ``backoff`` times longer, ``retries``
  times; then raise :class:`~bso.errors.ServiceUnavailable` naming the URL,
  the waits and the attempts;
* a reply saying the service itself is unavailable (its database was
  unreachable; nothing was applied) is retried the same way;
* no worker running: after :data:`~bso_client.worker_presence.NO_WORKER_CHECK_S`
  without a reply, and as often again while it waits, the call asks whether any
  worker announced itself lately (:class:`~bso_client.worker_presence.WorkerPresence`);
  if none did, it raises :class:`~bso.errors.ServiceUnavailable` saying so at once,
  instead of after every retry;
* a broker outage (refused or reset connection, timeout, Redis loading its
  append-only file after a restart, a read-only replica:
  :class:`~bso.wire.connection.BrokerUnreachable`) is waited out: the same
  event is sent again after jittered waits that double up to
  :data:`~bso_client.outage.OUTAGE_BACKOFF_CAP_S`, for up to ``outage_window_s`` (default
  :data:`~bso_client.outage.DEFAULT_OUTAGE_WINDOW_S`, env ``BSO_OUTAGE_WINDOW_S``) from the
  first failure; then :class:`~bso.errors.ServiceUnavailable` names the URL,
  the time waited and the setting.  One warning is logged when an outage
  begins, not one per try.  Time spent in an outage does not use up the
  no-reply attempts above;
* refused credentials or a command the ACL denies raise at once
  (:class:`~bso.wire.connection.BrokerRefused`);
* ``call_deadline_s`` (the optimizer's fail-open bound, :mod:`bso_client.fail_open`)
  caps all of the above: a call that has no answer by then raises
  :class:`~bso.errors.ServiceUnavailable`, whatever the timeouts and the outage
  window would allow, and its retries and outages are logged at DEBUG only (the
  optimizer logs the one line that matters);
* an error reply raises the typed error it names (:func:`bso.errors.error_from_code`).

All of it is one loop, :meth:`ServiceClient._round_trip`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from typing import Annotated, TypeVar

import redis
from pydantic import BaseModel, Field, TypeAdapter

from bso.api import EventApi
from bso.errors import InvalidEvent, RateLimited, ServiceUnavailable, error_from_code
from bso.status import JobStatus
from bso.wire import keys
from bso.wire.connection import (
    BrokerUnreachable,
    namespace_of_url,
    redact_url,
    redis_client,
)
from bso.wire.events import (
    DetachedRunDelivered,
    EpochDecision,
    ErrorReply,
    Event,
    HeartbeatAck,
    JobDeleted,
    JobRegistered,
    JobReset,
    LaneSizesSet,
    TrialAssigned,
    TrialEnded,
)
from bso.wire.jobs_query import JobList, JobSummary, ListJobs
from bso.wire.replies import RedisReplyBackend, ReplyBackend, ReplyWatch
from bso.wire.status_query import StatusQuery, StatusReply
from bso_client.outage import Outage, outage_window_from_env
from bso_client.publisher import Publisher, RedisPublisher
from bso_client.worker_presence import NO_WORKER_CHECK_S, PresenceCheck, WorkerPresence

log = logging.getLogger(__name__)

SuccessReply = (
    JobRegistered
    | TrialAssigned
    | EpochDecision
    | TrialEnded
    | HeartbeatAck
    | JobDeleted
    | DetachedRunDelivered
    | JobReset
    | LaneSizesSet
)
"""Every event reply but :class:`~bso.wire.events.ErrorReply` (:class:`ServiceClient` raises it)."""

_WireReply = Annotated[
    SuccessReply | StatusReply | JobList | ErrorReply,
    Field(discriminator="kind"),
]
_WIRE_REPLY: TypeAdapter[_WireReply] = TypeAdapter(_WireReply)
"""Everything a worker may push onto a reply key."""

R = TypeVar("R", bound=BaseModel)

DEFAULT_TIMEOUT_S = 10.0
DEFAULT_RETRIES = 2
DEFAULT_BACKOFF = 2.0
NOTICEABLE_DOOR_WAIT_S = 1.0
"""A call's waits at the tenant's door (its admission rate) this long or longer in all
are logged at INFO, shorter ones at DEBUG: a second is where a run's user could
notice them."""


API_KEY_ENV = "BSO_API_KEY"
"""Where :meth:`ServiceClient.connect` finds the API key when none is passed."""

BROKER_URL_ENV = "BSO_BROKER_URL"
"""Where a :class:`~bso_client.BatchSizeOptimizer` given neither ``broker_url`` nor
``service`` finds the URL: ``bso up``'s ``credentials.env`` and a team's file set it
beside :data:`API_KEY_ENV`."""


class ServiceClient(EventApi):
    """Talk to a running bso service; see the module docstring for the retry rules.

    Thread-safe as long as the publisher and the reply backend are (both
    shipped ones are): each call waits on its own reply key.
    """

    def __init__(
        self,
        publisher: Publisher,
        replies: ReplyBackend,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        retries: int = DEFAULT_RETRIES,
        backoff: float = DEFAULT_BACKOFF,
        address: str = "the bso service",
        outage_window_s: float | None = None,
        presence: PresenceCheck | None = None,
        no_worker_check_s: float = NO_WORKER_CHECK_S,
        call_deadline_s: float | None = None,
        probe_url: str | None = None,
    ) -> None:
        """``outage_window_s``: how long to wait out an unreachable broker; None
        reads ``BSO_OUTAGE_WINDOW_S``, else :data:`DEFAULT_OUTAGE_WINDOW_S`.
        ``presence``: where to ask whether any worker runs once a reply is
        ``no_worker_check_s`` late (None: never ask, wait out the timeouts).
        ``call_deadline_s``: the most one call may take, all its waits and sends
        together (None: as long as the timeouts and the outage window take).
        ``probe_url``: the broker :meth:`probe` asks (None: :meth:`probe` says yes)."""
        if outage_window_s is None:
            outage_window_s = outage_window_from_env()
        if timeout_s <= 0 or retries < 0 or backoff < 1:
            raise ValueError(
                f"need timeout_s > 0, retries >= 0 and backoff >= 1; "
                f"got {timeout_s}, {retries}, {backoff}"
            )
        if not (math.isfinite(outage_window_s) and outage_window_s >= 0):
            raise ValueError(f"need outage_window_s >= 0, got {outage_window_s}")
        if not no_worker_check_s > 0:
            raise ValueError(f"need no_worker_check_s > 0, got {no_worker_check_s}")
        if call_deadline_s is not None and not (
            math.isfinite(call_deadline_s) and call_deadline_s > 0
        ):
            raise ValueError(f"need call_deadline_s > 0, got {call_deadline_s}")
        self.publisher = publisher
        self.replies = replies
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff = backoff
        self.address = address
        self.outage_window_s = outage_window_s
        self.presence = presence
        self.no_worker_check_s = no_worker_check_s
        self.call_deadline_s = call_deadline_s
        self.probe_url = probe_url
        self.calls = 0
        """Round trips started: how a test tells that a detached run stays off the network."""
        self._retry_level = logging.WARNING if call_deadline_s is None else logging.DEBUG

    @classmethod
    def connect(
        cls,
        broker_url: str,
        *,
        api_key: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        retries: int = DEFAULT_RETRIES,
        backoff: float = DEFAULT_BACKOFF,
        connect_timeout_s: float = 5.0,
        outage_window_s: float | None = None,
        call_deadline_s: float | None = None,
    ) -> ServiceClient:
        """A client of the service whose Redis (broker and replies) is at ``broker_url``,
        sending every event with ``api_key`` (None: ``BSO_API_KEY`` from the environment;
        a service refuses events without a valid key with :class:`~bso.errors.Unauthorized`).

        Connects lazily: a broker that is down now is waited for by the first call.
        """
        if api_key is None:
            api_key = os.environ.get(API_KEY_ENV) or None
        replies = RedisReplyBackend(
            broker_url,
            connect_timeout_s=connect_timeout_s,
            namespace=namespace_of_url(broker_url),
        )
        return cls(
            RedisPublisher(broker_url, client=replies.redis, api_key=api_key),
            replies,
            timeout_s=timeout_s,
            retries=retries,
            backoff=backoff,
            address=redact_url(broker_url),
            outage_window_s=outage_window_s,
            presence=WorkerPresence(replies.redis, broker_url),
            call_deadline_s=call_deadline_s,
            probe_url=broker_url,
        )

    def close(self) -> None:
        self.publisher.close()
        self.replies.close()

    def probe(self, timeout_s: float) -> bool:
        """Whether the broker answers and a worker announced itself, asked on a fresh
        connection that waits at most ``timeout_s``: the cheap look a detached run
        takes before it delivers its journal.  Never raises for an outage."""
        if self.probe_url is None:
            return True
        client = redis_client(self.probe_url, connect_timeout_s=timeout_s)
        try:
            return client.get(namespace_of_url(self.probe_url).alive_key) is not None
        except (OSError, redis.RedisError):
            return False
        finally:
            client.close()

    def __enter__(self) -> ServiceClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the generic round trip --------------------------------------------------------

    def request(self, event: Event) -> SuccessReply:
        """Send ``event`` and return its reply; error replies raise their typed error."""
        reply = self._round_trip(keys.TASK_FOR_KIND[event.kind], event)
        if isinstance(reply, StatusReply | JobList):
            raise InvalidEvent(f"got a {reply.kind} reply to event {event.event_id}")
        return reply

    def _round_trip(
        self, task_name: str, message: BaseModel
    ) -> SuccessReply | StatusReply | JobList:
        raw = message.model_dump(mode="json")
        key = self.replies.namespace.reply_key_for(raw)
        assert key is not None, "a validated message always has an event id"
        payload = json.dumps(raw, separators=(",", ":"))
        event_id = raw["event_id"]
        self.calls += 1
        deadline = None if self.call_deadline_s is None else time.monotonic() + self.call_deadline_s
        timeout, waited = self.timeout_s, 0.0
        attempts = self.retries + 1
        attempt, sends, waited_at_door = 1, 0, 0.0
        last_error: ErrorReply | None = None
        outage: Outage | None = None
        broker_down_s = 0.0  # of the call, spent waiting out the broker, not for a reply
        while True:
            sends += 1
            wait = timeout if deadline is None else max(0.0, min(timeout, _left(deadline)))
            try:
                text = self._send_and_wait(
                    task_name, payload, event_id, send=sends, key=key, timeout_s=wait
                )
            except BrokerUnreachable as exc:
                if outage is None:
                    window = self.outage_window_s
                    if deadline is not None:
                        window = max(0.0, min(window, _left(deadline)))
                    outage = Outage(window, self.address)
                    if window > 0:  # else the error that follows says it all
                        log.log(
                            self._retry_level,
                            "%s; sending the same event again until it answers, "
                            "for up to %g s (outage_window_s)",
                            exc,
                            window,
                            extra={
                                "task": task_name,
                                "event_id": event_id,
                                "outage_window_s": self.outage_window_s,
                                "error": str(exc),
                            },
                        )
                outage.pause(exc)
                continue
            except RateLimited as exc:
                waited_at_door = self._wait_for_the_door(exc, waited_at_door, deadline)
                continue
            if outage is not None:
                log.log(
                    logging.INFO if deadline is None else logging.DEBUG,
                    "bso broker at %s reachable again after %.1f s",
                    self.address,
                    outage.elapsed(),
                    extra={"event_id": event_id, "outage_s": round(outage.elapsed(), 3)},
                )
                broker_down_s += outage.elapsed()
                outage = None
            waited += wait
            if text is not None:
                reply = _WIRE_REPLY.validate_json(text)
                if not isinstance(reply, ErrorReply):
                    return reply
                if reply.code != ServiceUnavailable.code:
                    raise error_from_code(reply.code, reply.message)
                last_error = reply
            if attempt == attempts or (deadline is not None and _left(deadline) <= 0):
                break
            log.log(
                self._retry_level,
                "no usable reply, sending the same event again",
                extra={
                    "task": task_name,
                    "event_id": event_id,
                    "attempt": attempt,
                    "timeout_s": timeout,
                    "service_error": last_error.message if last_error else None,
                },
            )
            attempt += 1
            timeout *= self.backoff
        why = (
            f"the service answered: {last_error.message}"
            if last_error is not None
            else f"no reply after waiting {round(waited, 2):g} s in total"
        )
        if last_error is None and broker_down_s > 0:
            why += f", after {round(broker_down_s, 2):g} s unable to reach the broker"
        if deadline is not None and last_error is None:
            why += f" (call_deadline_s={self.call_deadline_s:g})"
        raise ServiceUnavailable(
            f"bso service at {self.address} did not handle {task_name} event {event_id}: "
            f"{why} ({attempt} attempt{'s' if attempt > 1 else ''}, timeout_s={self.timeout_s:g}, "
            f"backoff={self.backoff:g}); "
            "are workers running and connected to this Redis?"
        )

    def _wait_for_the_door(
        self, refused: RateLimited, waited: float, deadline: float | None
    ) -> float:
        """After the tenant's door refused an event: wait as it says, so that the caller
        sends it again, and return the call's waits at the door so far.  Raise the
        refusal instead when the waits would add up to more than one ``timeout_s`` or
        pass the call's deadline: a fail-open run then treats it as an outage, and
        training goes on rather than wait for long."""
        wait = refused.retry_after_s or self.timeout_s
        if waited + wait > self.timeout_s or (deadline is not None and _left(deadline) <= wait):
            raise refused
        # A run that waits seconds at its door says why, at INFO at least; the waits of
        # milliseconds that epochs of milliseconds meet at the rate limit are DEBUG:
        # one INFO line per epoch flooded such a run's log and cost it nothing.  The
        # call's waits so far count: short refusals in a row add up to a stall too.
        if waited + wait >= NOTICEABLE_DOOR_WAIT_S:
            level = max(self._retry_level, logging.INFO)
        else:
            level = logging.DEBUG
        log.log(level, "%s", refused.message, extra={"retry_after_s": wait})
        time.sleep(wait)
        return waited + wait

    def _send_and_wait(
        self, task_name: str, payload: str, event_id: str, *, send: int, key: str, timeout_s: float
    ) -> str | None:
        """Publish once and wait up to ``timeout_s`` for the reply (None: none came).

        With :attr:`presence`, the wait is cut into slices of
        :attr:`no_worker_check_s`; after each slice without a reply it asks whether
        any worker runs, and raises :class:`~bso.errors.ServiceUnavailable` if none
        does (the event stays queued, and a worker started later applies it once).
        """
        with self.replies.watch(key) as watch:  # listening before the event is sent
            return self._send_and_watch(
                task_name, payload, event_id, send=send, key=key, timeout_s=timeout_s, watch=watch
            )

    def _send_and_watch(
        self,
        task_name: str,
        payload: str,
        event_id: str,
        *,
        send: int,
        key: str,
        timeout_s: float,
        watch: ReplyWatch,
    ) -> str | None:
        started = time.monotonic()
        presence = self.presence
        first = timeout_s if presence is None else min(timeout_s, self.no_worker_check_s)
        text = self.publisher.publish_and_pop(
            task_name,
            payload,
            f"{event_id}.{send}",
            replies=self.replies,
            key=key,
            timeout_s=first,
            watch=watch,
        )
        if presence is None:
            return text
        deadline = started + timeout_s
        while text is None:
            if presence.alive() is False:
                raise ServiceUnavailable(
                    f"no bso worker is running at {self.address}: nothing consumed "
                    f"{task_name} event {event_id} in {time.monotonic() - started:.1f} s "
                    f"and no worker announced itself in the last {keys.WORKERS_ALIVE_TTL_S} s; "
                    "start `bso up`, or the workers (celery -A bso_workers.app worker) on "
                    "this Redis"
                )
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            text = self.replies.pop(key, min(remaining, self.no_worker_check_s), watch=watch)
        return text

    def status(self, job_id: str) -> JobStatus:
        """What the job learned so far and its current recommendation (a read; nothing changes)."""
        query = StatusQuery(job_id=job_id)
        reply = self._round_trip(keys.TASK_STATUS, query)
        if not isinstance(reply, StatusReply):
            raise InvalidEvent(f"got a {reply.kind} reply to status query {query.event_id}")
        return reply.status

    def list_jobs(self) -> list[JobSummary]:
        """The API key's tenant's jobs, most recently active first (a read)."""
        query = ListJobs()
        reply = self._round_trip(keys.TASK_LIST_JOBS, query)
        if not isinstance(reply, JobList):
            raise InvalidEvent(f"got a {reply.kind} reply to job list query {query.event_id}")
        return reply.jobs


def _left(deadline: float) -> float:
    """Seconds until ``deadline`` (a :func:`time.monotonic` time); negative once past."""
    return deadline - time.monotonic()
