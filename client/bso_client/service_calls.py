"""Rank 0's calls to the bso service about one job, each sent as an idempotent event.

:class:`BsoServiceLike` is every call :class:`~bso_client.optimizer.BatchSizeOptimizer`
makes; the Redis transport (:class:`~bso_client.transport.ServiceClient`) and
the in-process service (:class:`bso.service.BsoService`) both fit it, so a test
or a benchmark can hand in either.

:class:`JobCalls` makes them.  Every event carries an id, and the service
applies an id at most once; a call keeps its id until it succeeds, so when a
call fails (service unreachable, say) and the script calls the same optimizer
method again, the same id is sent and the retry cannot count twice.  Only rank 0
has a :class:`JobCalls`: the optimizer broadcasts its answers to the other ranks
(:func:`bso_client.distributed.on_rank_zero`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Protocol, TypeVar

from bso.core.vocabulary import StopReason
from bso.spec import Hardware, JobSpec
from bso.status import JobStatus
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
    TrialStanding,
    new_event_id,
)
from bso.wire.micro_batch_timings import MicroBatchTiming
from bso_client.epoch_metric import diverged_message

if TYPE_CHECKING:
    from bso_client.resume import Checkpoint

T = TypeVar("T")


class BsoServiceLike(Protocol):
    """The calls the optimizer makes; :class:`~bso_client.transport.ServiceClient`
    (over Redis) and :class:`bso.service.BsoService` (in process) both fit."""

    def register(
        self, spec: JobSpec, *, plan_proposed: bool = False, event_id: str
    ) -> JobRegistered: ...

    def next_trial(
        self,
        job_id: str,
        hardware: Hardware | None = None,
        *,
        lease_s: float | None = None,
        reprobe_memory: bool = False,
        event_id: str,
    ) -> TrialAssigned: ...

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
    ) -> EpochDecision: ...

    def end_trial(
        self,
        job_id: str,
        trial_number: int,
        *,
        reason: EndReason,
        batch_size: int | None = None,
        event_id: str,
    ) -> TrialEnded: ...

    def heartbeat(self, job_id: str, trial_number: int) -> HeartbeatAck: ...

    def status(self, job_id: str) -> JobStatus: ...

    def deliver_detached_run(self, run: DeliverDetachedRun) -> DetachedRunDelivered: ...

    def resume_trial(self, event: ResumeTrial) -> TrialAssigned: ...


class JobCalls:
    """Rank 0's calls about one job through ``service``, with their event ids (see the module).

    ``lease_s`` and ``reprobe_memory`` are what every trial is asked for with
    (:class:`~bso_client.liveness.TrialLease`, and the optimizer's argument).
    """

    def __init__(
        self, service: BsoServiceLike, *, lease_s: float | None, reprobe_memory: bool
    ) -> None:
        self.service = service
        self._lease_s = lease_s
        self._reprobe_memory = reprobe_memory
        self._event_ids: dict[tuple[object, ...], str] = {}
        self._last_report: tuple[tuple[object, ...], Callable[..., EpochDecision]] | None = None
        """The last epoch report sent (its key and call), for :meth:`forget_unanswered`."""
        self.end_sent = False
        """Whether this client ended the trial (or tried to): it does so at most once."""

    def register(self, spec: JobSpec, *, plan_proposed: bool = False) -> JobRegistered:
        call = partial(self.service.register, spec, plan_proposed=plan_proposed)
        return self._send(("register",), call)

    def next_trial(self, job_id: str, hardware: Hardware) -> TrialAssigned:
        call = partial(
            self.service.next_trial,
            job_id,
            hardware,
            lease_s=self._lease_s,
            reprobe_memory=self._reprobe_memory,
        )
        return self._send(("next_trial",), call)

    def resume_trial(
        self, job_id: str, checkpoint: Checkpoint, standing: tuple[TrialStanding, ...] = ()
    ) -> TrialAssigned:
        """Reopen the checkpoint's trial (:mod:`bso_client.resume`), with this run's lease;
        ``standing``: where a run that never stopped left it (:mod:`bso_client.reattachment`)."""

        def call(*, event_id: str) -> TrialAssigned:
            event = checkpoint.event(job_id, self._lease_s, event_id, standing)
            return self.service.resume_trial(event)

        return self._send(("resume",), call)

    @property
    def next_trial_unanswered(self) -> bool:
        """Whether a ``next_trial`` was sent and its reply never read (a Ctrl-C while it
        waited): the service may have assigned a trial that nobody runs."""
        return ("next_trial",) in self._event_ids

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
        micro_batches: list[MicroBatchTiming] | None = None,
        trained_to: DetachedEpoch | None = None,
    ) -> EpochDecision:
        """Report epoch ``epoch``, or end the trial as diverged if ``metric`` is NaN or infinite.

        A diverged run is answered like a stop without convergence, under the
        same event id as the report it replaces.  ``batch_size``: what the epoch
        ran at, when online growth changed it; ``micro_batches``: the run's
        micro-batch exploration, not yet sent; ``trained_to``: how far a run back
        from an outage trained on (:mod:`bso_client.reattachment`).
        """
        if math.isfinite(metric):
            call = partial(
                self.service.report_epoch,
                job_id,
                trial_number,
                epoch=epoch,
                time_s=time_s,
                energy_j=energy_j,
                metric=metric,
                batch_size=batch_size,
                micro_batches=micro_batches,
                trained_to=trained_to,
            )
        else:
            call = partial(self._end_as_diverged, job_id, trial_number, epoch, metric)
        key = ("epoch", epoch)
        self._last_report = (key, call)
        return self._send(key, call)

    def end_trial(
        self, job_id: str, trial_number: int, reason: EndReason, batch_size: int | None = None
    ) -> TrialEnded | None:
        """End the trial with ``reason``; None, and nothing sent, if this client ended it
        before.  ``batch_size``: what was running, when online growth changed it."""
        if self.end_sent:
            return None
        self.end_sent = True
        call = partial(
            self.service.end_trial, job_id, trial_number, reason=reason, batch_size=batch_size
        )
        return self._send(("end",), call)

    def _end_as_diverged(
        self, job_id: str, trial_number: int, epoch: int, metric: float, *, event_id: str
    ) -> EpochDecision:
        self.end_sent = True
        ended = self.service.end_trial(
            job_id, trial_number, reason=StopReason.DIVERGED, event_id=event_id
        )
        return EpochDecision(
            event_id=event_id,
            job_id=job_id,
            trial_number=ended.trial_number,
            epoch=epoch,
            stop=True,
            converged=False,
            reason=ended.reason,
            cost=0.0,
            message=diverged_message(epoch, metric),
        )

    def forget_unanswered(self) -> Callable[[], EpochDecision] | None:
        """Send the next epoch reports and resume with new event ids: a detached run
        going back to the service (:mod:`bso_client.reattachment`) rewinds its trial to
        the epochs it knows were taken, so a report whose reply was lost in the outage
        is sent again as a new event, not answered from the first.

        Returns that lost report as the same event (its event id and body), or None
        if the last report was answered: if the service took it and stopped the trial
        there, the trial cannot be rewound, and sent again, the report is answered
        with the stop the run never heard of.
        """
        lost = None
        if self._last_report is not None:
            key, call = self._last_report
            event_id = self._event_ids.get(key)
            if event_id is not None:
                lost = partial(call, event_id=event_id)
        self._last_report = None
        for key in [k for k in self._event_ids if k[0] in ("epoch", "resume")]:
            del self._event_ids[key]
        return lost

    def _send(self, key: tuple[object, ...], call: Callable[..., T]) -> T:
        """Make ``call`` with the event id of ``key``: the same id until the call succeeds."""
        event_id = self._event_ids.setdefault(key, new_event_id())
        result = call(event_id=event_id)
        del self._event_ids[key]
        return result
