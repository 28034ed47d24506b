"""kombu's Redis transport with one Redis client per channel instead of one per command.

kombu 5's Redis channel builds a new :class:`redis.Redis` object for every
synchronous command group it sends (``conn_or_acquire``): with ``acks_late``
that is twice per task (recording the message as unacked on delivery, and
removing it on the ack).  The connections come from the channel's pool either
way; what is new each time is the client object, and redis-py's constructor
fills a table of ~170 response callbacks.  On the 2-core dev machine that was
the largest single item in the worker node's profile.

This channel builds that client once and reuses it.  A :class:`redis.Redis`
holds no per-call state (each command or pipeline takes a connection from the
pool), so sharing it is what any redis-py program does.  It is dropped
whenever kombu drops its pools (after a fork, on a failed connect, on close),
so it never outlives the pool it draws from.

Its clients also screen every item popped from a bso queue before kombu
parses it (BRPOP, the consumer's path, and RPOP, ``basic_get``'s), and every
message on the broadcast channels the worker listens to (PUBLISH): kombu
indexes into the item at once, so a ``[]`` or a pickle pushed onto the queue
would otherwise raise inside the consumer and stop the worker.  An item the
screen (:meth:`bso_workers.deadletters.DeadLetters.screen`, given as the
``bso_dead_letters`` transport option) refuses is dead-lettered and the pop
reads as empty, exactly as a BRPOP that timed out, and its queue goes to the end
of the node's rotation, as a served one does; kombu then issues the next one.
The check and the dead-lettering live in :mod:`bso_workers.deadletters`; this
module only routes the raw item there.

Wire behaviour, key names and the unacked / visibility-timeout bookkeeping are
kombu's own, unchanged.  Selected in :func:`bso_workers.celery_app.celery_config` via
``broker_transport`` for ``redis://`` and ``rediss://`` broker URLs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

from kombu.transport import redis as kombu_redis
from kombu.utils.encoding import bytes_to_str

TRANSPORT = "bso_workers.broker:Transport"
"""``broker_transport`` value that selects this transport."""

DEAD_LETTERS_OPTION = "bso_dead_letters"
"""Transport option holding the worker's :class:`~bso_workers.deadletters.DeadLetters`;
without it items are not screened (a process that only publishes or pings)."""


class Screens(Protocol):
    """``(item, queue or channel) -> may kombu decode it``; a refused item is dealt with."""

    def screen(self, item: bytes, queue: str) -> bool: ...

    def screen_fanout(self, item: bytes, channel: str) -> bool: ...


class ScreeningRedis(kombu_redis.PrefixedStrictRedis):
    """kombu's key-prefixing client, whose queue pops pass each item through a screen."""

    def __init__(
        self,
        *args: Any,
        screens: Screens,
        sep: str,
        on_refused: Callable[[str], object] = lambda queue: None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self._screens = screens
        self._screen = screens.screen
        self._sep = sep
        self._on_refused = on_refused

    def pubsub(self, **kwargs: Any) -> ScreeningPubSub:
        return ScreeningPubSub(
            self.connection_pool,
            global_keyprefix=self.global_keyprefix,
            screen=self._screens.screen_fanout,
            **kwargs,
        )

    def parse_response(self, connection: Any, command_name: Any, **options: Any) -> Any:
        response = super().parse_response(connection, command_name, **options)
        if command_name == "BRPOP" and response:
            key, item = response
            queue = self._queue(bytes_to_str(key))
            if not self._screen(_as_bytes(item), queue):
                self._on_refused(queue)
                return None  # what a BRPOP that timed out returns
        return response

    def rpop(self, name: Any, count: int | None = None) -> Any:
        item = super().rpop(name, count)
        if count is not None or not isinstance(item, bytes | str) or not item:
            return item
        return item if self._screen(_as_bytes(item), self._queue(str(name))) else None

    def _queue(self, key: str) -> str:
        """The queue of a list key (kombu appends ``sep`` + priority for priorities > 0)."""
        return key.rsplit(self._sep, 1)[0]


class ScreeningPubSub(kombu_redis.PrefixedRedisPubSub):
    """The broadcast (fanout) connection: each published message passes the screen.

    Workers listen to Celery's remote-control channel (``celery.pidbox``), where
    kombu builds a message from whatever was published, as it does for a queue
    item; a refused message reads as no message.
    """

    def __init__(self, *args: Any, screen: Callable[[bytes, str], bool], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._screen = screen

    def parse_response(self, *args: Any, **kwargs: Any) -> Any:
        response = super().parse_response(*args, **kwargs)
        if not (isinstance(response, list) and len(response) in (3, 4)):
            return response
        kind, channel, data = bytes_to_str(response[0]), response[-2], response[-1]
        if kind not in ("message", "pmessage") or not isinstance(data, bytes | str) or not data:
            return response
        return response if self._screen(_as_bytes(data), bytes_to_str(channel)) else None


def _as_bytes(item: bytes | str) -> bytes:
    """kombu's clients answer bytes; a client made with ``decode_responses`` would not."""
    return item if isinstance(item, bytes) else item.encode("utf-8", "surrogateescape")


class Channel(kombu_redis.Channel):
    from_transport_options = (*kombu_redis.Channel.from_transport_options, DEAD_LETTERS_OPTION)
    bso_dead_letters: Any = None
    _sync_client: Any = None

    def _get_client(self) -> Any:
        client = super()._get_client()  # type: ignore[misc]  # also kombu's check of the redis-py version
        if self.bso_dead_letters is None:
            return client
        return functools.partial(
            ScreeningRedis,
            global_keyprefix=self.global_keyprefix or "",
            screens=self.bso_dead_letters,
            sep=self.sep,
            on_refused=self._took_a_turn,
        )

    def _took_a_turn(self, queue: str) -> None:
        """A refused item was that queue's turn: move it to the end of the rotation, as
        kombu does for a delivered one.  Otherwise a queue full of garbage would stay
        first, and every pop would take its next item while the others wait."""
        self._queue_cycle.rotate(queue)  # type: ignore[attr-defined]

    @contextmanager
    def conn_or_acquire(self, client: Any = None) -> Iterator[Any]:
        if client:
            yield client
            return
        if self._sync_client is None:
            self._sync_client = self._create_client()  # type: ignore[attr-defined]
        yield self._sync_client

    def _disconnect_pools(self) -> None:
        self._sync_client = None
        super()._disconnect_pools()  # type: ignore[misc]


class Transport(kombu_redis.Transport):
    Channel = Channel
