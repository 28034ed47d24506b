"""How an event reaches the workers' queue: :class:`Publisher` and the client's own
:class:`RedisPublisher` (one ``LPUSH``), used by :class:`~bso_client.transport.ServiceClient`.

Why bso builds the Celery message itself rather than calling ``send_task``:
docs/architecture.md, "Hand-written plumbing".
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import redis
from redis.client import Pipeline

from bso.wire import keys
from bso.wire.admission import DOOR_SHA, door_args, door_keys, refusal
from bso.wire.connection import OUTAGE_ERRORS, broker_error, namespace_of_url, redis_client
from bso.wire.message import celery_message
from bso.wire.replies import RedisReplyBackend, ReplyBackend, ReplyWatch, decoded


class Publisher(ABC):
    """Sends one event payload to the task that handles it."""

    @abstractmethod
    def publish(
        self, task_name: str, payload_json: str, message_id: str, reply_channel: str | None = None
    ) -> None:
        """Enqueue ``payload_json`` for ``task_name``, asking for the reply to be announced
        on ``reply_channel`` (if any); raise ServiceUnavailable if unreachable."""

    @abstractmethod
    def close(self) -> None:
        """Release connections, if any."""

    def publish_and_pop(
        self,
        task_name: str,
        payload_json: str,
        message_id: str,
        *,
        replies: ReplyBackend,
        key: str,
        timeout_s: float,
        watch: ReplyWatch | None = None,
    ) -> str | None:
        """Publish, then wait up to ``timeout_s`` for a reply on ``key`` (on ``watch``,
        entered before this call, where the caller listens for its announcement).

        One call so that a publisher sharing the reply backend's connection can
        send both commands in one round trip (:class:`RedisPublisher`).
        """
        self.publish(task_name, payload_json, message_id, watch.channel if watch else None)
        return replies.pop(key, timeout_s, watch=watch)


class RedisPublisher(Publisher):
    """Enqueues the Celery message with one LPUSH onto the events queue's list.

    The message is the one Celery's ``send_task`` would enqueue
    (:func:`bso.wire.message.celery_message`), pushed the way kombu's Redis
    transport pushes it.  Not through Celery itself, because kombu's publish
    also declares the queue's binding (an ``SADD``), and the client's Redis user
    may run nothing but ``LPUSH`` on the events queue and ``GET``/``GETDEL`` on
    its replies (docs/security.md); so the training-side install needs no
    Celery either.  Given the reply backend's :class:`redis.Redis`
    (``client=``), :meth:`publish_and_pop` sends the LPUSH and the reply's
    first GETDEL in one round trip.  It never retries: an unreachable broker is
    :class:`~bso.wire.connection.BrokerUnreachable` at once, and the caller
    (``ServiceClient``) decides whether to send again.
    """

    def __init__(
        self,
        broker_url: str,
        *,
        connect_timeout_s: float = 5.0,
        client: redis.Redis | None = None,
        queue: str | None = None,
        api_key: str | None = None,
    ) -> None:
        """``queue``: None for the events queue of the URL's user (its tenant's own,
        :func:`bso.wire.connection.namespace_of_url`)."""
        self.broker_url = broker_url
        namespace = namespace_of_url(broker_url)
        self.queue = queue or namespace.queue
        self._api_key = api_key
        self._queue_key = keys.BROKER_KEY_PREFIX + self.queue
        """The Redis list kombu keeps the queue in (priority 0, the only one bso uses)."""
        self._door = namespace if namespace.tenant is not None and queue is None else None
        """A tenant's namespace, whose events go through its door (:mod:`bso.wire.admission`);
        None: plain LPUSH (the shared queue of the ``bso-client`` user, or a test's queue)."""
        self._own_client = client is None
        self.redis: redis.Redis = client or redis_client(
            broker_url, connect_timeout_s=connect_timeout_s
        )

    def publish(
        self, task_name: str, payload_json: str, message_id: str, reply_channel: str | None = None
    ) -> None:
        message = self._message(task_name, payload_json, message_id, reply_channel)
        try:
            with self.redis.pipeline(transaction=False) as pipe:
                self._push(pipe, message)
                (pushed,) = pipe.execute(raise_on_error=False)
        except OUTAGE_ERRORS as exc:
            raise broker_error(self.broker_url, exc) from exc
        self._check_pushed(pushed, message)

    def publish_and_pop(
        self,
        task_name: str,
        payload_json: str,
        message_id: str,
        *,
        replies: ReplyBackend,
        key: str,
        timeout_s: float,
        watch: ReplyWatch | None = None,
    ) -> str | None:
        if not (isinstance(replies, RedisReplyBackend) and replies.redis is self.redis):
            return super().publish_and_pop(
                task_name,
                payload_json,
                message_id,
                replies=replies,
                key=key,
                timeout_s=timeout_s,
                watch=watch,
            )
        message = self._message(
            task_name, payload_json, message_id, watch.channel if watch else None
        )
        try:
            with self.redis.pipeline(transaction=False) as pipe:
                self._push(pipe, message)
                pipe.getdel(key)
                pushed, value = pipe.execute(raise_on_error=False)
        except OUTAGE_ERRORS as exc:
            raise broker_error(self.broker_url, exc) from exc
        self._raise_error(value)
        reply = decoded(value)
        if reply is not None:  # left by an earlier send of the same event
            return reply
        self._check_pushed(pushed, message)
        return replies.pop(key, timeout_s, taken_once=True, watch=watch)

    def _push(self, pipe: Pipeline, message: str) -> None:
        """Queue the push of ``message`` on ``pipe``: through the tenant's door, or LPUSH."""
        if self._door is None:
            pipe.lpush(self._queue_key, message)
        else:
            pipe.evalsha(DOOR_SHA, 4, *door_keys(self._door), *door_args(message))

    def _check_pushed(self, pushed: object, message: str) -> None:
        """Raise what the push's answer means: :class:`~bso.errors.RateLimited` for a
        door that refused the event.  A door that Redis does not know yet (it lost its
        scripts and no worker has loaded them since) lets the event through with a
        plain LPUSH: then no worker runs to be protected, and the workers refuse an
        over-full queue's events themselves (``bso_workers.queue_bounds``)."""
        if isinstance(pushed, redis.exceptions.NoScriptError):
            try:
                self.redis.lpush(self._queue_key, message)
            except OUTAGE_ERRORS as exc:
                raise broker_error(self.broker_url, exc) from exc
            return
        self._raise_error(pushed)
        if self._door is not None and (refused := refusal(pushed, self._door)) is not None:
            raise refused

    def _raise_error(self, answer: object) -> None:
        """Raise a pipeline's error answer as its own command would have raised it."""
        if isinstance(answer, OUTAGE_ERRORS):
            raise broker_error(self.broker_url, answer) from answer
        if isinstance(answer, Exception):
            raise answer

    def _message(
        self, task_name: str, payload_json: str, message_id: str, reply_channel: str | None
    ) -> str:
        return celery_message(
            task_name,
            payload_json,
            message_id,
            self.queue,
            api_key=self._api_key,
            reply_channel=reply_channel,
        )

    def close(self) -> None:
        if self._own_client:
            self.redis.close()
