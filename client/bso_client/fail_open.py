"""Fail-open: no failure of the bso service ends a training run, nor stalls it for long.

With ``on_unavailable="continue"`` (the default), every call the optimizer
makes goes through a :class:`GuardedService`:

* a call may take at most ``unavailable_bound_s`` (default
  :data:`DEFAULT_UNAVAILABLE_BOUND_S`, env :data:`UNAVAILABLE_BOUND_ENV`): the
  transport's timeouts, retries and outage window are all cut to
  :data:`DEADLINE_SHARE` of it (:class:`~bso_client.transport.ServiceClient`'s
  ``call_deadline_s``) and each socket operation to the rest;
* the first call that fails because of the service (unreachable, no worker,
  no reply in time, an internal error, or a refusal of this client's key or
  Redis user) marks the service *down*: every later call raises at once,
  without a network round trip, so nothing waits again, until a look at an
  epoch's end finds it back (:mod:`bso_client.reattachment`).
  A heartbeat is not such a call: it blocks nothing, and its lease allows misses;
* the optimizer then runs *detached* (:mod:`bso_client.optimizer`): it keeps
  its batch size, only the target metric or ``max_epochs`` finish it, and
  its epochs go to a local journal (:mod:`bso_client.detached_journal`) that is
  delivered when the service is back, at the end of this run or by the next
  run of the job on this machine.

``on_unavailable="raise"`` keeps the failing behaviour: no guard, the transport's
own timeouts and outage window, typed errors raised to the script.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from typing import Literal, TypeVar

import redis

from bso.errors import BsoError, PoisonEvent, RateLimited, ServiceUnavailable, Unauthorized
from bso.spec import Hardware, JobSpec
from bso.status import JobStatus
from bso.wire.connection import BrokerRefused
from bso.wire.events import (
    DeliverDetachedRun,
    DetachedEpoch,
    DetachedRunDelivered,
    EndReason,
    EpochDecision,
    HeartbeatAck,
    JobRegistered,
    ResumeTrial,
    TrialAssigned,
    TrialEnded,
)
from bso.wire.micro_batch_timings import MicroBatchTiming
from bso_client.liveness import is_number
from bso_client.service_calls import BsoServiceLike

OnUnavailable = Literal["continue", "raise"]
"""What a run does when the service fails it: go on detached, or raise (today's way)."""

DEFAULT_UNAVAILABLE_BOUND_S = 5.0
"""The most one call to the service may wait in ``continue`` mode."""

UNAVAILABLE_BOUND_ENV = "BSO_UNAVAILABLE_BOUND_S"
"""Environment variable that sets the bound for a process."""

SOCKET_SHARE = 0.2
"""Share of the bound one socket operation may take (connect, or one read: 1 s of the
default 5 s).  A Redis command takes milliseconds; this only ends a host that drops
packets or a server that hangs."""

DEADLINE_SHARE = 1.0 - SOCKET_SHARE
"""Share of the bound after which a call starts no new send or wait (4 s of 5 s); the
socket operation in progress then ends within :data:`SOCKET_SHARE`: a call takes at
most one bound."""

PROBE_FRACTION = SOCKET_SHARE
"""A detached run's look at the service before it delivers its journal at exit: a
connection and one GET, each at most this share of the bound."""

T = TypeVar("T")


def unavailable_bound(given: float | None, environ: Mapping[str, str] | None = None) -> float:
    """``given``, else ``BSO_UNAVAILABLE_BOUND_S``, else the default; checked > 0."""
    env = os.environ if environ is None else environ
    if given is None:
        text = env.get(UNAVAILABLE_BOUND_ENV, "").strip()
        try:
            given = float(text) if text else DEFAULT_UNAVAILABLE_BOUND_S
        except ValueError:
            given = math.nan
        source = f"{UNAVAILABLE_BOUND_ENV}={text!r}"
    else:
        source = f"unavailable_bound_s={given!r}"
        if not is_number(given):
            raise TypeError(f"{source}: the bound must be a number of seconds > 0")
    if not (math.isfinite(given) and given > 0):
        raise ValueError(f"{source}: the bound must be a number of seconds > 0")
    return given


def check_on_unavailable(value: str) -> OnUnavailable:
    if value == "continue":
        return "continue"
    if value == "raise":
        return "raise"
    raise ValueError(f'on_unavailable must be "continue" or "raise", got {value!r}')


def is_service_failure(err: BaseException) -> bool:
    """Whether ``err`` is the service failing this run rather than the run's own mistake:
    unreachable or too slow, an internal error, a poison event, or a refusal of this
    client's credentials.  A configuration error (``ConfigMismatch``, ``InvalidSpec``,
    ``Forbidden``, ...) is not: the script raises it before training starts."""
    return isinstance(err, ServiceUnavailable | PoisonEvent | Unauthorized) or (
        type(err) is BsoError
    )


def is_refusal(err: BaseException) -> bool:
    """A refusal of this client (its API key, its Redis user): waiting does not cure it."""
    return isinstance(err, Unauthorized | BrokerRefused)


class GuardedService:
    """``service`` behind the fail-open rule: the first service failure marks it down,
    and from then on every call raises :class:`ServiceUnavailable` at once.

    Thread-safe enough for the heartbeat thread: marking down is one assignment.
    """

    def __init__(self, service: BsoServiceLike, address: str) -> None:
        self.service = service
        self.address = address
        self.failure: BsoError | None = None
        """The failure that marked the service down; None while it is up."""

    @property
    def down(self) -> bool:
        return self.failure is not None

    def reattach(self) -> None:
        """The service looks back (a probe said so): let calls through again."""
        self.failure = None

    def _guard(self, call: Callable[[], T], *, marks_down: bool = True) -> T:
        """``call()``, refused at once while the service is down; its failure marks the
        service down unless ``marks_down`` is False (a heartbeat's)."""
        if self.failure is not None:
            raise ServiceUnavailable(
                f"bso service at {self.address} is down for this run ({self.failure})"
            )
        try:
            return call()
        except BsoError as err:
            if marks_down and is_service_failure(err):
                self.failure = err
            raise
        except (redis.RedisError, OSError) as err:  # whatever the transport did not sort
            failure = ServiceUnavailable(
                f"bso service at {self.address} failed: {type(err).__name__}: {err}"
            )
            if marks_down:
                self.failure = failure
            raise failure from err

    def probe(self, timeout_s: float) -> bool:
        """A short look whether the service is back (a Redis GET, at most ``timeout_s``)."""
        probe = getattr(self.service, "probe", None)
        return True if probe is None else bool(probe(timeout_s))

    def register(
        self, spec: JobSpec, *, plan_proposed: bool = False, event_id: str
    ) -> JobRegistered:
        return self._guard(
            lambda: self.service.register(spec, plan_proposed=plan_proposed, event_id=event_id)
        )

    def next_trial(
        self,
        job_id: str,
        hardware: Hardware | None = None,
        *,
        lease_s: float | None = None,
        reprobe_memory: bool = False,
        event_id: str,
    ) -> TrialAssigned:
        return self._guard(
            lambda: self.service.next_trial(
                job_id, hardware, lease_s=lease_s, reprobe_memory=reprobe_memory, event_id=event_id
            )
        )

    def report_epoch(
        self,
        job_id: str,
        trial_number: int,
        *,
        epoch: int,
        time_s: float,
        energy_j: float,
        metric: float,
        batch_size: int | None = None,
        event_id: str,
        micro_batches: list[MicroBatchTiming] | None = None,
        trained_to: DetachedEpoch | None = None,
    ) -> EpochDecision:
        return self._guard(
            lambda: self.service.report_epoch(
                job_id,
                trial_number,
                epoch=epoch,
                time_s=time_s,
                energy_j=energy_j,
                metric=metric,
                batch_size=batch_size,
                event_id=event_id,
                micro_batches=micro_batches,
                trained_to=trained_to,
            )
        )

    def end_trial(
        self,
        job_id: str,
        trial_number: int,
        *,
        reason: EndReason,
        batch_size: int | None = None,
        event_id: str,
    ) -> TrialEnded:
        return self._guard(
            lambda: self.service.end_trial(
                job_id, trial_number, reason=reason, batch_size=batch_size, event_id=event_id
            )
        )

    def heartbeat(self, job_id: str, trial_number: int) -> HeartbeatAck:
        """A heartbeat that fails does not mark the service down: it is sent from its own
        thread, never blocks training, and the lease allows misses.  One slow answer
        among the thousands a days-long run sends (a worker restarting, a busy
        database) would otherwise detach the run for the rest of its days; whether the
        service is really gone is for the next call on the training path to find out,
        within the bound."""
        return self._guard(lambda: self.service.heartbeat(job_id, trial_number), marks_down=False)

    def status(self, job_id: str) -> JobStatus:
        return self._guard(lambda: self.service.status(job_id))

    def deliver_detached_run(self, run: DeliverDetachedRun) -> DetachedRunDelivered:
        return self._guard(lambda: self.service.deliver_detached_run(run))

    def resume_trial(self, event: ResumeTrial) -> TrialAssigned:
        return self._guard(lambda: self.service.resume_trial(event))


def root_cause(failure: BaseException) -> BaseException:
    """The innermost bso error behind ``failure``: the transport wraps the broker's
    own error ("Connection refused") in one about its outage window."""
    while isinstance(failure.__cause__, BsoError):
        failure = failure.__cause__
    return failure


def failure_line(address: str, failure: BaseException, bound_s: float) -> str:
    """What failed, as the run's one line about it says: a refusal of this client, or
    a service that did not answer within the bound (the setting the user knows, not
    the transport's cut of it)."""
    cause = root_cause(failure)
    if is_refusal(failure):
        return f"bso service at {address} refused this client ({cause})"
    return (
        f"bso service at {address} unavailable within {bound_s:g} s (unavailable_bound_s): {cause}"
    )


def failure_fix(failure: BaseException) -> str:
    """The fix for ``failure``, as the run's one line about it names it."""
    if is_refusal(failure):
        return (
            "fix: check BSO_API_KEY (or api_key=) and the user and password in the URL: a "
            "team's come together in its team file, and a revoked key's stop working (ask "
            "the operator for a new file); the default tenant's are in credentials.env"
        )
    if isinstance(root_cause(failure), RateLimited):
        return "fix: send fewer events, or ask the operator for higher limits (bso keys limits)"
    return "fix: check the URL and port, and that `bso up` (or the workers) runs there"


def detached_message(
    address: str,
    failure: BaseException,
    *,
    bound_s: float,
    batch_size: int,
    size_source: str,
    journal: str | None,
    unjournaled: str = "the job has no job_id yet",
) -> str:
    """The one line a run logs when it goes detached: what failed, what the run does
    now, and the fix."""
    if journal is None:
        kept = f"its epochs are not journaled ({unjournaled})"
    elif is_refusal(failure):
        kept = f"epochs are journaled to {journal} and delivered once the service accepts a key"
    else:
        kept = f"epochs are journaled to {journal} and delivered when the service is back"
    return (
        f"{failure_line(address, failure, bound_s)}; training goes on detached at batch size "
        f"{batch_size} ({size_source}), bso will not stop it early; {kept}; "
        f"{failure_fix(failure)} (on_unavailable='raise' fails instead)"
    )
