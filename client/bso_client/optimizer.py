"""The object a training script holds: :class:`BatchSizeOptimizer`.

It follows Zeus's ``BatchSizeOptimizer`` so that a script moves over by
changing an import::

    job = JobSpec(job_id="resnet-nightly", batch_sizes=[32, 64, 128, 256],
                  default_batch_size=128, target_metric=0.92, max_epochs=30)
    with BatchSizeOptimizer(job, "redis://bso-host:6379/0") as bso:
        bso.get_batch_size()                 # the global batch, over every rank
        loader = DataLoader(train_set, batch_size=bso.per_device_batch_size)
        bso.on_train_begin()
        for epoch in range(job.max_epochs):
            train_one_epoch(loader)
            bso.on_evaluate(validate())      # may raise TrainFailError: relaunch
            if bso.training_finished:
                break

What it adds to Zeus's:

* **Fail-open** (:mod:`bso_client.fail_open`): with ``on_unavailable="continue"``
  (the default) no failure of the service ends the run or stalls it for long;
  the run goes on *detached*, journals its epochs, and they are delivered later.
* **The trial always ends, and says why.**  ``with`` ends it on normal exit
  and on any exception, a SIGTERM handler ends it before the process dies,
  and ``atexit`` is the last resort (:mod:`bso_client.shutdown`); exactly
  once.  The reason follows what happened (:mod:`bso_client.liveness`: out of
  memory, interrupted, diverged, crashed); the exception is always re-raised.
* **Heartbeats** while a trial runs: a run killed outright (SIGKILL, the OOM
  killer, a lost node) is ended as interrupted within two minutes by default.
* **Only the job's own sizes.**  A batch size outside ``batch_sizes`` from the
  service is refused with :class:`~bso_client.errors.UnexpectedBatchSize`.
* **Typed errors** (:mod:`bso_client.errors`): calls out of order, a stop without
  convergence (relaunch), a job id registered with another configuration.
* **Notebooks**: a cell run again ends the trial its earlier run left open
  (:mod:`bso_client.open_runs`); **checkpoints**: ``resume=bso.state_dict()`` as
  saved goes on with the checkpoint's trial (:mod:`bso_client.resume`).
* **Idempotent events** (:mod:`bso_client.service_calls`): a method called
  again after a failure sends the same event id and the same measurement.
* **Data parallel** (:mod:`bso_client.distributed`): every rank makes the
  same calls and gets the same answers; a batch size is the global batch,
  split over the ranks (:attr:`per_device_batch_size`, and with micro-batches
  :attr:`micro_batch_size` x :attr:`accumulation_steps`).
* **Batch sizes "auto"** (``discovery=``, :mod:`bso_client.job_setup`),
  **online growth** (``growth=``, :mod:`bso_client.running_batch`) and the
  **micro-batch exploration** (:mod:`bso_client.micro_batch_run`).
* **Energy and hardware** from :func:`bso_client.energy.detect.detect_monitor`;
  bso learns separately per hardware.  Time and energy exclude the time spent
  waiting for bso itself (:mod:`bso_client.epoch_meter`).

Nothing here imports torch; the Celery transport is imported only with a broker URL.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from functools import partial
from types import TracebackType
from typing import Any, Self, SupportsFloat, TypeVar, cast

from bso.core.growth import BatchGrowth
from bso.core.vocabulary import StopReason
from bso.errors import InvalidSpec
from bso.spec import JobSpec
from bso.wire.events import EndReason, EpochDecision, TrialAssigned
from bso_client.call_order import CallOrder, Stage
from bso_client.discovery import Discovery
from bso_client.distributed import (
    Collective,
    EnergyScope,
    combine_hardware,
    detect_collective,
    measures_energy,
    on_rank_zero,
)
from bso_client.energy.base import EnergyMonitor
from bso_client.energy.detect import detect_monitor
from bso_client.epoch_meter import EpochMeter
from bso_client.epoch_metric import FirstEpochCheck, metric_value
from bso_client.errors import OperationOrderError, TrainFailError, UnexpectedBatchSize
from bso_client.fail_open import OnUnavailable, check_on_unavailable, unavailable_bound
from bso_client.job_setup import JobSetup
from bso_client.liveness import (
    DEFAULT_HEARTBEAT_INTERVAL_S,
    DEFAULT_HEARTBEAT_MISSES,
    TrialLease,
    end_reason_for,
)
from bso_client.micro_batch_run import MicroBatchSteps
from bso_client.open_runs import claim, release
from bso_client.rank_zero_service import chosen_broker_url, rank_zero_calls
from bso_client.resume import Checkpoint, resume_trial
from bso_client.run_detaching import RunDetaching
from bso_client.run_view import RunView
from bso_client.running_batch import RunningBatch
from bso_client.service_calls import BsoServiceLike, JobCalls
from bso_client.shutdown import CloseAtExit, SigtermHandler
from bso_client.trial_log import lane_of, log_lane, log_recurrence, log_trial, warn_if_ended_short

logger = logging.getLogger(__name__)

T = TypeVar("T")


class BatchSizeOptimizer(RunView, MicroBatchSteps, RunDetaching):
    """One training run of a recurring job, as one bso trial; see the module docstring.

    Args:
        job: the job's :class:`~bso.spec.JobSpec` (or a mapping of its fields).
            Its ``hardware`` is replaced by what the energy monitors report.
        broker_url: the service's Redis URL (what ``bso up`` prints); None, without
            ``service``, reads ``BSO_BROKER_URL`` (from ``environ``), as ``api_key``
            reads ``BSO_API_KEY``.
        api_key: the tenant's API key (what ``bso up`` prints, or ``bso keys
            create``); None reads ``BSO_API_KEY``.  The job belongs to this
            key's tenant: no other tenant's key can report into it, end it or
            delete it.  Only with ``broker_url``.
        service: instead of ``broker_url``, an object that makes the calls
            (:class:`bso.service.BsoService` runs the service in process).
        monitor: the energy monitor of this rank; by default one from
            :func:`~bso_client.energy.detect.detect_monitor` on the measuring ranks,
            closed with the optimizer (a monitor passed in is not closed).  It
            is ignored on ranks that do not measure under ``energy_scope``.
        energy_scope: which ranks measure energy, see :mod:`bso_client.distributed`.
        collective: how the ranks talk; detected from ``torch.distributed``.
        timeout_s, retries, backoff, connect_timeout_s: the transport's wait
            and retry rules (:class:`~bso_client.transport.ServiceClient`);
            only with ``broker_url``.
        outage_window_s: with ``on_unavailable="raise"``: how long each call
            waits out an unreachable broker (a Redis restart), sending the same
            event again, before it raises :class:`~bso.errors.ServiceUnavailable`;
            None reads ``BSO_OUTAGE_WINDOW_S``, default 180 s.  Only with
            ``broker_url``.
        on_unavailable: ``"continue"`` (default): no failure of the service ends
            the run, it goes on *detached* (:mod:`bso_client.fail_open`);
            ``"raise"``: the service's errors are raised, as before.
        unavailable_bound_s: the most one call may wait in ``"continue"`` mode;
            None reads ``BSO_UNAVAILABLE_BOUND_S``, default 5 s.
        environ: the environment to read ``WORLD_SIZE`` and ``LOCAL_RANK`` from.
        heartbeat_interval_s, heartbeat_misses: a heartbeat every
            ``heartbeat_interval_s`` (30 s) while training; the service ends a
            trial as interrupted after ``heartbeat_misses`` (3) are missed.  None
            sends no heartbeats: the service's own timeout (hours) applies.
        reprobe_memory: memory on this hardware changed (a new driver, a smaller
            model): forget the batch sizes that ran out of memory before, and
            probe again when the sizes are discovered.
        discovery: for a job that lists no ``batch_sizes``: the model factory
            to probe, once per hardware and model (:mod:`bso_client.discovery`).
        growth: opt-in online growth (:class:`~bso.core.growth.BatchGrowth`):
            the batch grows at epoch boundaries within the job's sizes; read
            :attr:`current_batch_size` (or :attr:`micro_batch_size`) each epoch.
        explore_micro_batch: split the batch as earlier runs' micro-batch
            explorations settled (:mod:`bso_client.micro_batch_run`); also
            ``Discovery(explore_micro_batch=True)``.
        resume: what :meth:`state_dict` returned, saved in the checkpoint this run
            resumes from: the run goes on with that trial, at its batch size
            (:mod:`bso_client.resume`).

    Raises (at construction): with ``on_unavailable="raise"`` only
    :class:`~bso.errors.InvalidSpec` when ``eta_knob`` is 1 (energy only) but no
    energy can be measured here, :class:`~bso.errors.ConfigMismatch` (the job id is
    registered with another configuration; by default the run trains at its default
    without bso after one ERROR, as for the unmeasured energy) and
    :class:`~bso.errors.ServiceUnavailable` when the service does not answer;
    :class:`~bso_client.errors.DistributedSetupError`.
    """

    def __init__(
        self,
        job: JobSpec | Mapping[str, Any],
        broker_url: str | None = None,
        *,
        api_key: str | None = None,
        service: BsoServiceLike | None = None,
        monitor: EnergyMonitor | None = None,
        energy_scope: EnergyScope = "node",
        collective: Collective | None = None,
        timeout_s: float = 10.0,
        retries: int = 2,
        backoff: float = 2.0,
        connect_timeout_s: float = 5.0,
        outage_window_s: float | None = None,
        environ: Mapping[str, str] | None = None,
        heartbeat_interval_s: float | None = DEFAULT_HEARTBEAT_INTERVAL_S,
        heartbeat_misses: int = DEFAULT_HEARTBEAT_MISSES,
        reprobe_memory: bool = False,
        discovery: Discovery | None = None,
        growth: BatchGrowth | None = None,
        on_unavailable: OnUnavailable = "continue",
        unavailable_bound_s: float | None = None,
        explore_micro_batch: bool = False,
        resume: Mapping[str, Any] | None = None,
    ) -> None:
        broker_url = chosen_broker_url(broker_url, service, environ)
        self.on_unavailable = check_on_unavailable(on_unavailable)
        bound = unavailable_bound(unavailable_bound_s, environ)
        self.unavailable_bound_s = bound
        """The most one call to the service may wait in ``"continue"`` mode."""
        fail_open = self.on_unavailable == "continue"
        self._lease = TrialLease(heartbeat_interval_s, heartbeat_misses, quiet=fail_open)
        setup = JobSetup(job, discovery)
        self._growth = growth
        self._discovery = discovery
        self._explore_micro = explore_micro_batch or bool(
            discovery and discovery.explore_micro_batch
        )
        self._running: RunningBatch | None = None
        self._collective = collective or detect_collective(environ)
        self._client, self._calls, self._fail_open = rank_zero_calls(
            broker_url,
            service,
            rank=self.rank,
            fail_open=fail_open,
            bound_s=bound,
            lease_s=self._lease.lease_s,
            reprobe_memory=reprobe_memory,
            transport={
                "api_key": api_key,
                "timeout_s": timeout_s,
                "retries": retries,
                "backoff": backoff,
                "connect_timeout_s": connect_timeout_s,
                "outage_window_s": outage_window_s,
            },
        )
        """Rank 0's calls to the service; None on the other ranks."""
        self._detached = False  # the run lost the service (every rank knows)
        self._start_size: tuple[int, str] | None = None  # a run detached at its start

        self._order = CallOrder()
        self._first_epoch = FirstEpochCheck()
        self._trial: TrialAssigned | None = None
        self._batch: int | None = None
        self._closed = False
        self._in_block = False
        self._resume = None if resume is None else Checkpoint.read(resume, setup.spec.job_id)
        self._fail_open.resumed = self._resume is not None
        self._sigterm = SigtermHandler(self._on_sigterm)
        self.last_decision: EpochDecision | None = None
        """The service's answer to the latest epoch report."""

        self._monitor: EnergyMonitor | None = None
        self._owns_monitor = False
        unmeasured: InvalidSpec | None = None  # rank 0's decides (see _register)
        try:
            if measures_energy(self._collective, energy_scope, environ):
                self._owns_monitor = monitor is None
                self._monitor = monitor or detect_monitor()
                unmeasured = setup.energy_refusal(self._monitor.measures_energy)
                if unmeasured is not None and not fail_open:
                    raise unmeasured
            self._meter = EpochMeter(self._collective, self._monitor)
            if self._resume is not None:
                self._meter.resume(self._resume.totals)
            parts = self._collective.all_gather(self._monitor.hardware if self._monitor else None)
            self.hardware = combine_hardware(parts)
            """The hardware of the whole job: every measuring rank's GPUs."""
            self.spec = setup.complete(
                world_size=self.world_size,
                hardware=self.hardware,
                reprobe=reprobe_memory,
                on_rank_zero=partial(on_rank_zero, self._collective),
            )
            """What was registered: with this run's hardware, devices, and sizes."""
            # The lane counts the data-parallel devices (Hardware.devices): every later
            # call names that lane, so 1- and 2-process runs never share sizes.
            self.hardware = self.spec.hardware
            registered = self._on_rank_zero(
                lambda calls: self._register(calls, setup.discovers, unmeasured)
            )
            if registered is not None:
                self.spec = setup.adopt(self.spec, registered.plan)
        except BaseException:
            self._release()
            raise
        self.job_id: str | None = registered.job_id if registered else self.spec.job_id
        """The job's id; generated by the service when the spec gave only ``job_id_prefix``
        (None then if the service was unreachable at the start)."""
        self._fail_open.bind(self.spec, self.job_id, self.hardware)
        self._new_job = registered is not None and registered.created
        if registered is None:
            self._detach_at_start()
        elif self.rank == 0:
            if registered.created:  # else the lane's line, once its status is read
                logger.info("bso job %s registered on %s", self.job_id, self.hardware.key)
            self._fail_open.deliver_pending()
        self._close_at_exit = CloseAtExit(self.close, self._lease.stop_heartbeats)
        claim(self, (broker_url or id(service), api_key, self.job_id, self.rank))

    # -- the Zeus call order -----------------------------------------------------------

    def get_batch_size(self) -> int:
        """The batch size of this run, asked of the service on the first call.

        Later calls return the same size (no new trial): one optimizer is one
        run.  Every rank gets the same answer.
        """
        if self._order.stage is Stage.REGISTERED:
            job_id = cast(str, self.job_id)  # only a run detached at its start has none
            trial = (
                None
                if self._detached
                else self._on_rank_zero(
                    lambda calls: (
                        resume_trial(calls, self._fail_open, job_id, self._resume, self.spec)
                        if self._resume
                        else self._next_trial(calls, job_id)
                    )
                )
            )
            self._order.stage = Stage.ASSIGNED
            if trial is None:
                self._batch = self._detach_at_start()
                self._running = RunningBatch(self.spec, self._batch, self._growth, None)
                return self._batch
            self._trial = trial
            self._fail_open.assigned(trial.batch_size, trial.trial_number)
            if trial.batch_size not in self.spec.batch_sizes:
                self._end_trial(StopReason.INTERRUPTED)  # the service's fault, not the size's
                self._order.stage = Stage.ENDED
                raise UnexpectedBatchSize(job_id, trial.trial_number, trial.batch_size)
            self._batch = trial.batch_size
            lane, down = self._on_rank_zero(
                lambda calls: (lane_of(calls, job_id, self.hardware), self._fail_open.down)
            )
            limit = lane.memory_limit if lane else None
            self._running = RunningBatch(self.spec, trial.batch_size, self._growth, limit)
            if self.rank == 0:
                self._fail_open.remember(lane)
                resumed = self._resume.epochs if self._resume else None
                if not self._new_job and resumed is None:  # news only on an old lane
                    log_lane(lane, job_id, self.hardware, trial)
                log_trial(
                    lane, job_id, self.spec, trial, self._running.split, resumed_after=resumed
                )
                self._start_heartbeats()
            self._settle_micro_batch()
            if down:  # the status read found the service gone: nothing waits again
                self._detach_mid_run()
        if self._batch is None:
            raise OperationOrderError(
                "this optimizer was closed before it got a batch size; create a new one"
            )
        return self._batch

    def on_train_begin(self) -> None:
        """Start measuring: call it once, right before the first epoch."""
        self._order.require(Stage.ASSIGNED, "on_train_begin", "after get_batch_size, once")
        self._order.stage = Stage.TRAINING
        self._meter.start_epoch()

    def on_evaluate(self, metric: SupportsFloat) -> EpochDecision:
        """Report the epoch that just ended with its validation ``metric``; get the verdict.

        When the service stops the trial, :attr:`training_finished` turns True;
        if the trial converged the verdict is returned, else
        :class:`~bso_client.errors.TrainFailError` is raised (relaunch the job).
        Every rank must call it (the energy of the epoch is summed over ranks);
        rank 0's ``metric`` is the one reported: a number, or an array or tensor
        of one value; else :class:`~bso_client.errors.MetricTypeError` is raised.
        """
        self._order.require(Stage.TRAINING, "on_evaluate", "after on_train_begin, once per epoch")
        value = metric_value(metric)  # refused before the epoch is measured: a retry is clean
        epoch, time_s, energy_j = self._meter.end_epoch()
        if self.rank == 0:  # a loss with higher_is_better_metric=True converges at epoch 1
            self._first_epoch(self.spec, self.job_id, self.trial_number, epoch, value)
        assert self._running is not None
        running = self._running
        with self._lease.own_call():  # its verdict is this run's to tell, not a heartbeat's
            decision, detached = self._on_rank_zero(
                lambda calls: self._fail_open.report(
                    calls,
                    epoch=epoch,
                    time_s=time_s,
                    energy_j=energy_j,
                    metric=value,
                    grown=running.reported_size,
                    micro_batches=running.unsent_timings,
                )
            )
            self._meter.reported()
            running.unsent_timings = None
            self.last_decision = decision
            if detached != self._detached:  # rank 0 detached, or went back to the service
                self._detach_mid_run() if detached else self._reattach_mid_run()
            if decision.stop:
                self._order.stopped()
                self._lease.stop_heartbeats()
        if not decision.stop:
            running.after_epoch(epoch)
            self._meter.start_epoch()
            return decision
        if self._detached:  # bso could not stop it: finished by its own spec, never failed
            return decision
        self._fail_open.remember(log_recurrence(self._calls, cast(str, self.job_id), self.hardware))
        assert self._trial is not None
        if not decision.converged:
            raise TrainFailError(
                cast(str, self.job_id),
                self._trial.trial_number,
                self._trial.batch_size,
                decision.reason,
                decision.message,
            )
        return decision

    # -- ending ------------------------------------------------------------------------

    def close(self, exc: BaseException | None = None) -> None:
        """End the trial if it is still running, and release the monitor and connections.

        ``exc``: the exception training died of, if any; it decides the reason
        the trial ends with (:func:`bso_client.liveness.end_reason_for`: CUDA
        out of memory, Ctrl-C, a crash).  ``with`` passes it; a script without
        ``with`` may call ``close(exc)`` in its ``except`` and re-raise.

        Idempotent, and safe in error paths: a failure to reach the service is
        logged, not raised (the service ends a silent trial once its lease runs
        out anyway), so it never hides the exception that is unwinding.  Makes
        no collective call, so ranks may close independently.
        """
        warn_if_ended_short(self, exc)
        self._close(end_reason_for(exc))

    def _close(self, reason: EndReason) -> None:
        if self._closed:
            return
        self._closed = True
        self._close_at_exit.cancel()
        self._lease.stop_heartbeats()
        try:
            if self._fail_open.run is not None:
                self._fail_open.finish(reason, self._calls)
            elif self._end_trial(reason):
                self._fail_open.remember(
                    log_recurrence(self._calls, cast(str, self.job_id), self.hardware)
                )
        finally:
            self._order.stage = Stage.ENDED
            self._release()

    def __enter__(self) -> Self:
        """Install the SIGTERM handler (main thread only) for the ``with`` block."""
        self._sigterm.install()
        self._in_block = True
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            self.close(exc)
        finally:
            self._in_block = False
            self._sigterm.restore()

    def _on_sigterm(self) -> None:
        """End the trial; the handler then does what the previous one would have done."""
        logger.warning("SIGTERM: ending bso trial %s before exiting", self.trial_number)
        self._close(StopReason.INTERRUPTED)

    def _end_trial(self, reason: EndReason) -> bool:
        """Send EndTrial once, on rank 0, for a trial the service has not stopped;
        True if the service ended it now."""
        if self._calls is None or self.training_finished:
            return False
        if self._trial is None:  # none, or a Ctrl-C while next_trial waited for it
            return self._fail_open.end_unanswered_trial(self._calls, reason)
        running = self._running.reported_size if self._running else None
        return self._fail_open.end_trial(self._calls, reason, running)

    def _start_heartbeats(self) -> None:
        calls, trial = self._calls, self._trial
        if calls is None or trial is None:
            return
        self._lease.start_heartbeats(
            partial(calls.service.heartbeat, cast(str, self.job_id), trial.trial_number),
            f"trial {trial.trial_number} of job {self.job_id}",
        )

    def _release(self) -> None:
        if self._monitor is not None and self._owns_monitor:
            self._monitor.close()
        if self._client is not None:
            self._client.close()
        release(self)  # a later optimizer of the job in this thread supersedes nothing

    # -- talking to the service (rank 0) -----------------------------------------------

    def _on_rank_zero(self, ask: Callable[[JobCalls], T]) -> T:
        """Run ``ask`` with rank 0's calls, on rank 0; every rank gets its answer or its error."""

        def on_zero() -> T:
            assert self._calls is not None
            return ask(self._calls)

        return on_rank_zero(self._collective, on_zero)
