"""How a training run tells bso it is alive, and how it says why it ended.

* :class:`Heartbeater` sends a heartbeat from a daemon thread every
  ``interval_s`` while the trial runs.  The trial was assigned with a lease of
  ``interval_s * misses`` seconds (:class:`TrialLease`): if the process is
  killed (SIGKILL, the kernel's OOM killer, a lost node), the service's sweep
  ends the trial as interrupted once the lease runs out, within about two
  minutes by default, instead of after the service's hours-long timeout for
  callers without heartbeats.
* :func:`end_reason_for` maps the exception a training loop died of to the
  reason the trial ends with; each reason has its own effect on learning
  (:mod:`bso.core.outcomes`): a CUDA out-of-memory error bars the size and
  larger ones on this hardware, a Ctrl-C or SIGTERM is an interruption that is
  not the size's fault, any other exception a crash of the script
  (``abandoned``: :data:`bso.core.outcomes.Outcome.SCRIPT_ERROR`, not held
  against the size).

Nothing here imports torch: an out-of-memory error is recognised by its type
name and message, whatever torch version raised it.
"""

from __future__ import annotations

import logging
import math
import numbers
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from bso.core.vocabulary import StopReason, TrialStatus
from bso.errors import BsoError
from bso.wire.events import MAX_LEASE_S, MIN_LEASE_S, EndReason, HeartbeatAck

log = logging.getLogger(__name__)

DEFAULT_HEARTBEAT_INTERVAL_S = 30.0
DEFAULT_HEARTBEAT_MISSES = 3
"""30 s x 3: a vanished run is ended 90 s after its last heartbeat, plus at most
one sweep interval (15 s by default): within two minutes."""

_OOM_TYPE_NAMES = frozenset({"OutOfMemoryError"})
_OOM_MESSAGES = ("CUDA out of memory", "out of memory", "CUBLAS_STATUS_ALLOC_FAILED")


def is_accelerator_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` says the accelerator ran out of memory.

    ``torch.cuda.OutOfMemoryError`` (and ``torch.OutOfMemoryError``) by type
    name; older torch raised a ``RuntimeError`` whose message says so.  Host
    memory (``MemoryError``) is not the batch size's accelerator limit.

    Narrower than :func:`bso_client.batch_search.is_allocation_failure`, the
    batch search's test: a run that dies of it has its size (and larger ones)
    barred on this hardware, so only the accelerator's own limit counts.
    """
    if any(cls.__name__ in _OOM_TYPE_NAMES for cls in type(exc).__mro__):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _OOM_MESSAGES)


def end_reason_for(exc: BaseException | None) -> EndReason:
    """Why a trial that bso did not stop ends, from what the training loop raised."""
    if exc is None:
        return StopReason.ABANDONED  # the script stopped training on its own
    if isinstance(exc, KeyboardInterrupt):
        return StopReason.INTERRUPTED
    if is_accelerator_out_of_memory(exc):
        return StopReason.OUT_OF_MEMORY
    return StopReason.ABANDONED


class Heartbeater:
    """Calls ``send`` every ``interval_s`` from a daemon thread until :meth:`stop`.

    It stops by itself once the service says the trial is no longer running.
    A failed heartbeat is logged and the next one tried: the lease allows
    ``misses`` of them.  ``send`` must be thread-safe (both shipped transports are).
    """

    def __init__(
        self,
        send: Callable[[], HeartbeatAck],
        interval_s: float,
        label: str,
        quiet: bool = False,
        own_calls: threading.Lock | None = None,
    ) -> None:
        """``quiet``: log failures at DEBUG only (the fail-open optimizer logs the one
        line about a lost service itself, :mod:`bso_client.fail_open`).  ``own_calls``:
        held by the run around each call of its own that may end the trial and the
        handling of its reply (:meth:`TrialLease.own_call`)."""
        self._send = send
        self._own_calls = own_calls or threading.Lock()
        self._failure_level = logging.DEBUG if quiet else logging.WARNING
        self._interval_s = interval_s
        self._label = label
        self._stopped = threading.Event()
        self._end_known = False
        self._thread = threading.Thread(
            target=self._run, name=f"bso-heartbeat {label}", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def stop(self, *, run_knows_the_end: bool = True) -> None:
        """Stop sending; does not wait for a heartbeat in flight (it is harmless).

        ``run_knows_the_end``: the run heard how its trial ends (the service stopped
        it) or ends it itself; False for a run that stops beating without knowing (it
        detached), which is still told if a heartbeat answered meanwhile that the
        trial ended."""
        self._end_known = run_knows_the_end
        self._stopped.set()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        failing = False
        while not self._stopped.wait(self._interval_s):
            try:
                ack = self._send()
            except BsoError as err:
                if not failing:
                    log.log(
                        self._failure_level,
                        "bso heartbeat of %s failed (%s); trying again",
                        self._label,
                        err,
                    )
                failing = True
                continue
            except Exception:  # never let the thread die silently
                log.exception("bso heartbeat of %s failed", self._label)
                failing = True
                continue
            if failing:
                log.info("bso heartbeats of %s get through again", self._label)
            failing = False
            if ack.status is not TrialStatus.RUNNING:
                self._ended(ack)
                return

    def _ended(self, ack: HeartbeatAck) -> None:
        """Say that the trial ended without this run, unless this run ended it.

        A heartbeat sent while the run's own report was on its way (or queued behind
        it, workers being slow) is answered with the verdict of that report: the run
        hears it in the report's reply and says so itself.  So the verdict is judged
        once the run's call in flight is handled: if that call ended the trial, the
        run has stopped the heartbeats by then, knowing it.  A run that detached
        instead (the call went unanswered) is told."""
        reason = ack.reason.value if ack.reason else "no reason"
        with self._own_calls:
            known = self._stopped.is_set() and self._end_known
        if known:
            log.debug(
                "bso heartbeat of %s answered after the run ended it (%s, %s)",
                self._label,
                ack.status.value,
                reason,
            )
            return
        log.warning(
            "bso ended %s meanwhile (%s, %s): its results will not be used",
            self._label,
            ack.status.value,
            reason,
        )


class TrialLease:
    """The lease an optimizer's trial is assigned with, and the heartbeats that keep it.

    ``interval_s`` None sends no heartbeats and asks for no lease, so the
    service's own timeout (hours) applies.  Otherwise the lease is ``interval_s
    * misses`` seconds, and never below the service's minimum
    (:data:`~bso.wire.events.MIN_LEASE_S`); above its maximum
    (:data:`~bso.wire.events.MAX_LEASE_S`, 7 days) the settings are refused.  The
    settings are checked when the optimizer is built, before it registers anything.
    """

    def __init__(self, interval_s: float | None, misses: int, *, quiet: bool = False) -> None:
        if interval_s is not None and not is_number(interval_s):
            raise TypeError(f"heartbeat_interval_s must be a number of seconds, got {interval_s!r}")
        if interval_s is not None and not (math.isfinite(interval_s) and interval_s > 0):
            raise ValueError(f"heartbeat_interval_s must be > 0, got {interval_s}")
        if not is_number(misses) or not float(misses).is_integer():
            raise TypeError(f"heartbeat_misses must be a whole number, got {misses!r}")
        if misses < 1:
            raise ValueError(f"heartbeat_misses must be >= 1, got {misses}")
        if interval_s is not None and interval_s * misses > MAX_LEASE_S:
            raise ValueError(
                f"heartbeat_interval_s * heartbeat_misses is {interval_s * misses:g} s, over "
                f"the longest lease the service grants, {MAX_LEASE_S:g} s (7 days): heartbeats "
                "are sent from their own thread, so epochs of any length need no longer "
                "interval than the default 30 s"
            )
        self._interval_s = interval_s
        self.lease_s = None if interval_s is None else max(MIN_LEASE_S, interval_s * misses)
        """What ``next_trial`` asks for; None without heartbeats."""
        self._heartbeater: Heartbeater | None = None
        self._quiet = quiet
        self._own_calls = threading.Lock()

    @contextmanager
    def own_call(self) -> Iterator[None]:
        """Around a call of the run's own that may end the trial, up to the heartbeats'
        stop if it did: a heartbeat answered meanwhile waits for it
        (:meth:`Heartbeater._ended`), so a trial this run ended is not reported to
        its user as ended by someone else."""
        with self._own_calls:
            yield

    def start_heartbeats(self, send: Callable[[], HeartbeatAck], label: str) -> None:
        """Send ``send()`` every interval from now on; nothing without an interval."""
        if self._interval_s is None:
            return
        self._heartbeater = Heartbeater(
            send, self._interval_s, label, self._quiet, own_calls=self._own_calls
        )
        self._heartbeater.start()

    def stop_heartbeats(self, *, run_knows_the_end: bool = True) -> None:
        """Stop the heartbeats, if any are sent (idempotent); ``run_knows_the_end``:
        see :meth:`Heartbeater.stop`."""
        if self._heartbeater is not None:
            self._heartbeater.stop(run_knows_the_end=run_knows_the_end)
            self._heartbeater = None


def is_number(value: object) -> bool:
    """A real number, not a bool nor a string, for a setting given in code:
    math.isfinite's own TypeError names no setting, so a user who wrote "30" would
    not know which argument it was."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)
