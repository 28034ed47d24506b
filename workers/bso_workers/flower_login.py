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

Flower also compares the login it is given as text with ``hmac.compare_digest``,
which raises ``TypeError`` for non-ASCII text: a caller without the login who sent
``bso:\u00e9`` got a 500 and a traceback in ``flower.log`` for each request.
:func:`require_login` answers that 401, as any other wrong login.
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
    from flower.views import BaseHandler

    handler: Any = monitor.Metrics
    if not getattr(handler.get, _MARK, False):
        guarded = tornado.web.authenticated(handler.get)
        setattr(guarded, _MARK, True)
        handler.get = guarded
    base: Any = BaseHandler
    if not getattr(base.get_current_user, _MARK, False):
        base.get_current_user = _non_ascii_is_wrong(base.get_current_user)
    return True


def _non_ascii_is_wrong(get_current_user: Any) -> Any:
    """``get_current_user`` with a ``TypeError`` (a non-ASCII login) answered 401."""

    def checked(self: Any) -> Any:
        try:
            return get_current_user(self)
        except TypeError as exc:
            raise tornado.web.HTTPError(401) from exc

    setattr(checked, _MARK, True)
    return checked
