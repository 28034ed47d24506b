"""Flower's own ``/metrics`` behind the same login as the rest of Flower.

Flower 2 serves its Prometheus metrics (``flower_events_total`` and friends: every
task's name, worker, state and timing) from a handler that, unlike its pages and
its API, is not marked ``@tornado.web.authenticated``: with ``FLOWER_BASIC_AUTH``
set, ``/`` and ``/api/tasks`` answer 401 to a caller without the login while
``/metrics`` answers anyone who reaches the port.  bso's own metrics
(``bso metrics``) ask for the login; so must Flower's.  :func:`require_login`
marks the handler's ``get`` authenticated, as Flower marks its other handlers:
without the login it answers 401, as they do.  Only ``/healthcheck`` stays
open (docs/security.md, "Flower").
"""

from __future__ import annotations

from typing import Any

import tornado.web

_MARK = "_bso_requires_login"


def require_login() -> bool:
    """Make Flower's metrics handler ask for the login; False when Flower is not
    installed (a worker-only install).  Idempotent."""
    try:
        from flower.views import monitor
    except ImportError:
        return False
    handler: Any = monitor.Metrics
    if not getattr(handler.get, _MARK, False):
        guarded = tornado.web.authenticated(handler.get)
        setattr(guarded, _MARK, True)
        handler.get = guarded
    return True
