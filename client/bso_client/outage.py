"""Waiting out an unreachable broker: the window, its setting, the backoff.

A Redis restart (with its append-only file reloaded), a failover or a host
reboot makes the broker unreachable for seconds to minutes.  A training job
should not crash for that: :class:`bso_client.transport.ServiceClient` sends
the same event again (same event id, so it is applied once) after each
:meth:`Outage.pause`, until the broker answers or the window runs out.
"""

from __future__ import annotations

import math
import os
import random
import time
from collections.abc import Mapping

from bso.errors import ServiceUnavailable
from bso.wire.connection import BrokerUnreachable

DEFAULT_OUTAGE_WINDOW_S = 180.0
"""How long a call waits out an unreachable broker before it raises: long
enough for a Redis restart that reloads a large append-only file, or a host
reboot, to go unnoticed by training jobs (the issue asks for at least 2 minutes)."""

OUTAGE_WINDOW_ENV = "BSO_OUTAGE_WINDOW_S"
"""Environment variable that sets :data:`DEFAULT_OUTAGE_WINDOW_S` for a process."""

OUTAGE_BACKOFF_FIRST_S = 0.1
"""First wait before sending again to an unreachable broker; doubled each time..."""

OUTAGE_BACKOFF_CAP_S = 5.0
"""...up to this.  Each wait is jittered (between half and all of it) so that
the clients of a restarted broker do not all come back in the same instant."""


def outage_window_from_env(environ: Mapping[str, str] | None = None) -> float:
    """``BSO_OUTAGE_WINDOW_S`` from ``environ`` (default: this process's), else the default."""
    env = os.environ if environ is None else environ
    text = env.get(OUTAGE_WINDOW_ENV)
    if text is None or not text.strip():
        return DEFAULT_OUTAGE_WINDOW_S
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{OUTAGE_WINDOW_ENV} must be a number of seconds >= 0, got {text!r}")
    return value


class Outage:
    """One stretch of an unreachable broker within a call: its clock and its backoff."""

    def __init__(self, window_s: float, address: str) -> None:
        """``address``: the broker's URL with its password masked, for the error message."""
        self.window_s = window_s
        self.address = address
        self.started = time.monotonic()
        self.delay = OUTAGE_BACKOFF_FIRST_S

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def pause(self, error: BrokerUnreachable) -> None:
        """Sleep before the next send, or raise once the window is used up.

        The last send comes at the end of the window (the last sleep is cut to fit).
        """
        elapsed = self.elapsed()
        if elapsed >= self.window_s:
            raise ServiceUnavailable(
                f"bso broker at {self.address} unreachable: gave up after waiting {elapsed:.1f} s "
                f"(outage_window_s={self.window_s:g}, set by {OUTAGE_WINDOW_ENV} or "
                f"ServiceClient.connect(outage_window_s=...)); last error: {error}"
            ) from error
        jittered = self.delay * random.uniform(0.5, 1.0)
        time.sleep(min(jittered, self.window_s - elapsed))
        self.delay = min(self.delay * 2, OUTAGE_BACKOFF_CAP_S)
