"""Whether any bso worker runs, as the workers announce it in Redis.

Every worker node sets :data:`bso.wire.keys.WORKERS_ALIVE_KEY` every few seconds
with a short TTL (``bso_workers.presence``).  A caller whose event has gone
unanswered for :data:`NO_WORKER_CHECK_S` reads that key
(:class:`~bso_client.transport.ServiceClient`): gone means nothing will consume
the queue, and the call fails at once with a message that says so, instead of
waiting out every retry (over a minute by default) and then only guessing why.
A key that is there means the workers are busy or slow, and the call goes on
waiting as before.
"""

from __future__ import annotations

import logging
from typing import Protocol

import redis

from bso.wire.connection import OUTAGE_ERRORS, broker_error, namespace_of_url, redact_url

log = logging.getLogger(__name__)

NO_WORKER_CHECK_S = 2.5
"""Seconds without a reply after which a call asks whether any worker runs, and
then again every as many seconds while it waits.  A reply usually lands within
milliseconds; by 2.5 s an answer is overdue, yet one GET per 2.5 s of waiting
costs Redis nothing."""


class PresenceCheck(Protocol):
    """What :class:`~bso_client.transport.ServiceClient` asks once a reply is late."""

    def alive(self) -> bool | None:
        """True: a worker runs; False: none does; None: cannot tell."""


class WorkerPresence(PresenceCheck):
    """Reads whether a worker runs (:data:`~bso.wire.keys.WORKERS_ALIVE_KEY`, or a tenant's copy)
    with the caller's Redis connection."""

    def __init__(self, client: redis.Redis, url: str) -> None:
        """``url``: where ``client`` is connected, for error messages (redacted there);
        its user names the key read (a tenant's own copy, :attr:`Namespace.alive_key`)."""
        self.redis = client
        self.url = url
        self.key = namespace_of_url(url).alive_key
        self._readable = True

    def alive(self) -> bool | None:
        """True if a worker node announced itself within the key's TTL, False if none
        did, None if this cannot be told here.

        None, and the caller just waits as it did before the key existed, when this
        Redis user may not read the key (a Redis whose ACL predates it) or the key
        holds something other than a string.  An unreachable broker raises
        :class:`~bso.wire.connection.BrokerUnreachable`, like every call of the
        reply path, and the caller rides it out.
        """
        if not self._readable:
            return None
        try:
            value = self.redis.get(self.key)
        except redis.exceptions.NoPermissionError:
            self._readable = False
            log.info(
                "this Redis user may not read %s at %s: cannot tell whether workers run, "
                "so unanswered events wait out their timeouts",
                self.key,
                redact_url(self.url),
            )
            return None
        except redis.ResponseError:  # WRONGTYPE: not what a worker writes
            return None
        except OUTAGE_ERRORS as exc:
            raise broker_error(self.url, exc) from exc
        return value is not None
