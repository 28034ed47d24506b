"""How a run goes on without the service: :class:`RunDetaching`, a part of
:class:`~bso_client.optimizer.BatchSizeOptimizer` (see :mod:`bso_client.fail_open`).

A run that lost the service after it got its trial goes on *detached*; one that
lost it before goes on at the size rank 0 knows; a run resumed from a checkpoint
goes on at the checkpoint's size, untracked (:mod:`bso_client.resume`), and one
the service refuses for good (a lane with no size left to give, a job id
registered with another configuration), or that bso cannot follow (energy only,
where none is measured), at the job's default (the checkpoint's size, resumed),
untracked too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

from bso.errors import ConfigMismatch, InvalidSpec, NoFeasibleBatchSize
from bso.spec import Hardware, JobSpec
from bso.wire.events import JobRegistered, TrialAssigned
from bso_client.detachment import Detachment
from bso_client.distributed import Collective, on_rank_zero
from bso_client.liveness import TrialLease
from bso_client.resume import Checkpoint
from bso_client.service_calls import JobCalls


class RunDetaching:
    """The fail-open half of the optimizer; the optimizer sets the state it reads."""

    spec: JobSpec
    job_id: str | None
    hardware: Hardware
    _collective: Collective
    _fail_open: Detachment
    _lease: TrialLease
    _detached: bool
    _start_size: tuple[int, str] | None
    _resume: Checkpoint | None
    _start_heartbeats: Callable[[], None]
    """The optimizer's: rank 0's heartbeats for its trial."""

    @property
    def rank(self) -> int:
        return self._collective.rank

    def _register(
        self, calls: JobCalls, plan_proposed: bool, unmeasured: InvalidSpec | None = None
    ) -> JobRegistered | None:
        """Rank 0: the job's registration, or None when the run trains on without it
        (the service is unavailable, or has the job id with another configuration), or
        without bso at all (``unmeasured``: energy only, and none measured here; the
        service is not asked, since it could learn nothing from the run)."""
        if unmeasured is not None:
            self._without_bso(unmeasured)
            return None
        try:
            return self._fail_open.attempt(
                lambda: calls.register(self.spec, plan_proposed=plan_proposed)
            )
        except ConfigMismatch as err:
            self._without_bso(err)
            return None

    def _without_bso(self, err: ConfigMismatch | InvalidSpec) -> None:
        """Rank 0: train on untracked after ``err``, a refusal of the job's
        configuration (``on_unavailable="continue"``); raise it otherwise."""
        self._fail_open.bind(self.spec, self.spec.job_id, self.hardware)
        if self._resume is not None:  # the model was trained at the checkpoint's size
            size, source = self._resume.batch_size, "the checkpoint's"
        else:
            size, source = self.spec.default_batch_size, "the job's default"
        if not self._fail_open.refused(err, size, source):
            raise err

    def _next_trial(self, calls: JobCalls, job_id: str) -> TrialAssigned | None:
        """Rank 0: the run's trial, or None when it trains on without one (the service
        is unavailable, or the lane has no size left to give)."""
        try:
            return self._fail_open.attempt(lambda: calls.next_trial(job_id, self.hardware))
        except NoFeasibleBatchSize as err:
            size = self.spec.default_batch_size
            if self._fail_open.refused(err, size, "the job's default"):
                return None
            raise

    def _detach_mid_run(self) -> None:
        """Every rank: the run lost the service after it got its trial."""
        self._detached = True
        self._lease.stop_heartbeats(run_knows_the_end=False)
        if self.rank == 0 and self._fail_open.run is None:
            self._fail_open.start("this run's own")

    def _reattach_mid_run(self) -> None:
        """Every rank: the detached run went back to the service
        (:mod:`bso_client.reattachment`); rank 0 sends heartbeats again."""
        self._detached = False
        if self.rank == 0:
            self._start_heartbeats()

    def _detach_at_start(self) -> int:
        """Every rank: the service failed before the run got a trial; train at the size
        rank 0 knows (the lane's last recommendation here, else the default)."""
        if self._start_size is None and self._resume is not None:  # trains on untracked
            self._detached, resumed = True, self._resume
            self._start_size = (resumed.batch_size, "the checkpoint's")
            if self.rank == 0:
                guard = self._fail_open.guard
                failure = (guard.failure if guard else None) or RuntimeError("unknown failure")
                self._fail_open.untracked(resumed.batch_size, resumed.trial_number, failure=failure)
        if self._start_size is None:
            self._detached = True
            self._start_size = on_rank_zero(self._collective, self._size_without_trial)
            self._fail_open.assigned(self._start_size[0], None)
            if self.rank == 0 and self._fail_open.run is None:
                self._fail_open.start(self._start_size[1])
        return self._start_size[0]

    def _size_without_trial(self) -> tuple[int, str]:
        """Rank 0: the size of a run that got no trial.  One that trains on without bso
        (the service refused it: ``Detachment.refused``) has it already; a detached one
        takes what this machine knows."""
        if self._fail_open.run is not None:
            return cast(int, self._fail_open.batch_size), "the job's default"
        return self._fail_open.size_known_here(self.spec, self.job_id, self.hardware)
