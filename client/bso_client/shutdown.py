"""Ending a trial when its process is stopped: on SIGTERM, and at interpreter exit.

A trial left running is only ended once its heartbeat lease runs out, and then
as interrupted whatever happened, so the optimizer ends it itself whenever it
still can:

* :class:`SigtermHandler`: schedulers (Slurm, Kubernetes, ``torchrun``) stop
  a job with SIGTERM and kill it after a grace period.  The handler ends the
  trial first, then does what the handler it replaced would have done, so the
  process still stops (or the framework's own handler still runs).
* :class:`CloseAtExit`: a script that never closes its optimizer (no ``with``,
  no ``close()``) still ends its trial when the interpreter exits, with the
  exception the script died of, if it did (``sys.last_value``, what a ``with``
  would have passed): out of memory stays out of memory, and a crash is not
  taken for a loop that ended on its own.

Both act only in the process that set them up.  A child forked from the
training process (``multiprocessing`` with the ``fork`` start method, the
default on Linux, and DataLoader workers) inherits the handler and the atexit
hook; ``Pool.__exit__`` terminates its workers with SIGTERM, and a scheduler
signals the whole process group.  The child's copy ending the trial ended the
parent's run as ``interrupted`` while it trained on, so that its later reports
were refused and nothing of it was learned; in a child both only hand the
signal on (and the hook does nothing).
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import weakref
from collections.abc import Callable
from functools import partial
from types import FrameType
from typing import Any

SignalHandler = Callable[[int, FrameType | None], Any] | int | None
"""What ``signal.getsignal`` returns: a callable, ``SIG_DFL``/``SIG_IGN``, or None."""


class SigtermHandler:
    """Calls ``on_sigterm`` on SIGTERM, then does what the previous handler would have done.

    Installed by :meth:`install` (from the main thread only: Python runs and
    sets signal handlers there and nowhere else) and put back by
    :meth:`restore`, so that it only covers the ``with`` block it serves.
    """

    def __init__(self, on_sigterm: Callable[[], None]) -> None:
        self._on_sigterm = [on_sigterm]
        self._previous: SignalHandler = None
        self._installed = False
        self._pid = os.getpid()
        """The process whose run this is: a forked child only hands the signal on."""

    def also(self, on_sigterm: Callable[[], None]) -> None:
        """Call ``on_sigterm`` too, after the others, before the signal is handed on:
        what must be written before the process dies of it (a run's status file)."""
        self._on_sigterm.append(on_sigterm)

    def install(self) -> None:
        """Replace the current SIGTERM handler with this one (main thread only)."""
        if threading.current_thread() is threading.main_thread():
            self._pid = os.getpid()
            self._previous = signal.getsignal(signal.SIGTERM)
            signal.signal(signal.SIGTERM, self.handle)
            self._installed = True

    def handle(self, signum: int, frame: FrameType | None) -> None:
        """Run the ``on_sigterm`` callbacks, restore the previous handler, then hand the
        signal on to it.

        A handler whose block is over may still be reached (chained behind a later
        run's, or put back by a framework that restores what it found): it ends
        nothing, its run being closed, and only hands the signal on; so does a forked
        child's copy (a pool worker): the run is its parent's.
        """
        if self._installed and os.getpid() == self._pid:
            for on_sigterm in self._on_sigterm:
                on_sigterm()
        previous = _live(self._previous)
        self.restore()
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:
            # SIG_DFL, or a handler installed outside Python: die of the signal as
            # the process would have.  The default goes back in place first, whoever
            # holds the signal now: sent to a handler of ours, it would come back here.
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def restore(self) -> None:
        """Put the previous handler back, unless someone replaced ours meanwhile.

        A framework that installed its own handler after ours (Lightning does,
        for the length of ``fit``) restores what it found when it is done;
        overwriting that with our stale ``previous`` would undo its cleanup.
        """
        if self._installed:
            self._installed = False
            if signal.getsignal(signal.SIGTERM) == self.handle:
                previous = _live(self._previous)
                signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def _live(handler: SignalHandler) -> SignalHandler:
    """``handler``, past every :class:`SigtermHandler` whose block is over: blocks
    closed out of order (runs entered A then B, closed A then B: two generators or
    asyncio tasks training side by side) leave B's previous handler A's, and putting
    that back would keep each closed run alive behind the signal, one more per pair."""
    owner = getattr(handler, "__self__", None)
    while isinstance(owner, SigtermHandler) and not owner._installed:
        handler = owner._previous
        owner = getattr(handler, "__self__", None)
    return handler


class CloseAtExit:
    """Calls ``close`` at interpreter exit, unless :meth:`cancel` was called first.

    ``close`` is held weakly (it must be a bound method), so that the hook does
    not keep an object alive that the script dropped.  ``collected`` is called
    when the object is garbage-collected unclosed: a long-lived process (a
    notebook kernel) that dropped an optimizer must stop its heartbeats, or its
    trial stays running, for as long as the process lives, with nothing left
    to end it (the lease then ends it as interrupted).
    """

    def __init__(
        self,
        close: Callable[[BaseException | None], object],
        collected: Callable[[], object] | None = None,
    ) -> None:
        self._hook = partial(_call_if_alive, weakref.WeakMethod(close), os.getpid())
        atexit.register(self._hook)
        owner = getattr(close, "__self__", None)
        self._collected = weakref.finalize(owner, collected) if collected and owner else None

    def cancel(self) -> None:
        """The object was closed: nothing is left to do at exit."""
        atexit.unregister(self._hook)
        if self._collected is not None:
            self._collected.detach()


def _call_if_alive(
    method: weakref.WeakMethod[Callable[[BaseException | None], object]], pid: int
) -> None:
    """Close the run at exit, in the process that opened it only (not a forked child
    that exits through ``sys.exit``)."""
    close = method()
    if close is not None and os.getpid() == pid:
        close(getattr(sys, "last_value", None))  # set for an uncaught exception
