"""Outcomes and their effect on learning: failed, diverged, out of memory, interrupted."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import numpy as np
import pytest

from bso.core.bso_policy import BsoPolicy
from bso.core.outcomes import (
    MAX_INTERRUPTIONS,
    Outcome,
    learning_view,
    memory_limit,
    outcome_of,
    ruled_out,
    script_errors_in_a_row,
    unproven_divergence,
)
from bso.core.state import JobSnapshot, TrialSnapshot
from bso.core.vocabulary import StopReason, TrialPhase, TrialStatus
from bso.core.zeus_policy import ZeusPolicy
from bso.errors import NoFeasibleBatchSize
from bso.service import BsoService
from bso.spec import Hardware, JobSpec
from bso.storage.memory import MemoryStore

T0 = datetime(2026, 3, 1, 8, 0, tzinfo=UTC)
GPU = Hardware(gpu_model="Tesla V100", gpu_count=1, max_power_w=250.0)
EXPLORE = TrialPhase.EXPLORATION


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> datetime:
        return self.now


def spec(policy: str = "bso", **changes: Any) -> JobSpec:
    fields: dict[str, Any] = {
        "job_id": "job",
        "batch_sizes": [16, 32, 64, 128, 256],
        "default_batch_size": 64,
        "target_metric": 0.9,
        "max_epochs": 6,
        "policy": policy,
        "mab_seed": 3,
        "hardware": GPU,
    }
    fields.update(changes)
    return JobSpec.model_validate(fields)


def trial(
    number: int, size: int, status: TrialStatus, reason: StopReason | None = None
) -> TrialSnapshot:
    return TrialSnapshot(number, size, EXPLORE, status, epochs=2, cost=10.0, stop_reason=reason)


def snapshot(*trials: TrialSnapshot, reprobed_through: int = 0) -> JobSnapshot:
    return JobSnapshot(spec(), GPU, trials, memory_reprobed_through=reprobed_through)


# -- the core: outcome_of and learning_view ------------------------------------------------


@pytest.mark.parametrize(
    ("status", "reason", "outcome"),
    [
        (TrialStatus.RUNNING, None, Outcome.RUNNING),
        (TrialStatus.CONVERGED, StopReason.TARGET_REACHED, Outcome.CONVERGED),
        (TrialStatus.FAILED, StopReason.COST_BOUND, Outcome.STOPPED),
        (TrialStatus.FAILED, StopReason.PROJECTED_COST, Outcome.STOPPED),
        (TrialStatus.FAILED, StopReason.MAX_EPOCHS, Outcome.FAILED),
        (TrialStatus.FAILED, StopReason.ABANDONED, Outcome.SCRIPT_ERROR),
        (TrialStatus.FAILED, StopReason.DIVERGED, Outcome.FAILED),
        (TrialStatus.FAILED, StopReason.OUT_OF_MEMORY, Outcome.OUT_OF_MEMORY),
        (TrialStatus.INTERRUPTED, StopReason.INTERRUPTED, Outcome.INTERRUPTED),
        (TrialStatus.INTERRUPTED, StopReason.HEARTBEAT_TIMEOUT, Outcome.INTERRUPTED),
    ],
)
def test_outcome_of(status: TrialStatus, reason: StopReason | None, outcome: Outcome) -> None:
    assert outcome_of(trial(1, 64, status, reason)) is outcome


def test_out_of_memory_removes_the_size_and_every_larger_one() -> None:
    view = learning_view(
        snapshot(
            trial(1, 64, TrialStatus.CONVERGED, StopReason.TARGET_REACHED),
            trial(2, 256, TrialStatus.CONVERGED, StopReason.TARGET_REACHED),
            trial(3, 128, TrialStatus.FAILED, StopReason.OUT_OF_MEMORY),
        )
    )
    assert view.memory_limit == 128
    assert view.candidate_sizes == [16, 32, 64]
    # 256 converged once, on memory that is gone: it is no longer a candidate.
    assert [t.batch_size for t in view.trials] == [64]
    assert view.best_batch_size() == 64


def test_a_memory_reprobe_forgets_earlier_out_of_memory_trials() -> None:
    oom = trial(3, 128, TrialStatus.FAILED, StopReason.OUT_OF_MEMORY)
    assert memory_limit((oom,), reprobed_through=2) == 128
    assert memory_limit((oom,), reprobed_through=3) is None
    view = learning_view(snapshot(oom, reprobed_through=3))
    assert view.candidate_sizes == [16, 32, 64, 128, 256]
    assert view.trials == ()


def test_interruptions_are_ignored_until_they_repeat() -> None:
    interrupted = [
        trial(n, 64, TrialStatus.INTERRUPTED, StopReason.INTERRUPTED)
        for n in range(1, MAX_INTERRUPTIONS + 1)
    ]
    assert learning_view(snapshot(*interrupted[:-1])).trials == ()
    (counted,) = learning_view(snapshot(*interrupted)).trials
    assert (counted.trial_number, counted.failed) == (MAX_INTERRUPTIONS, True)
    # A finished run in between resets the count.
    mixed = [
        *interrupted[:-1],
        trial(10, 64, TrialStatus.CONVERGED, StopReason.TARGET_REACHED),
        trial(11, 64, TrialStatus.INTERRUPTED, StopReason.HEARTBEAT_TIMEOUT),
    ]
    assert [t.trial_number for t in learning_view(snapshot(*mixed)).trials] == [10]


def test_the_default_out_of_memory_moves_exploration_below_it() -> None:
    for policy in (BsoPolicy(), ZeusPolicy()):
        lane = JobSnapshot(
            spec(policy.name), GPU, (trial(1, 64, TrialStatus.FAILED, StopReason.OUT_OF_MEMORY),)
        )
        assignment = policy.assign(lane, np.random.default_rng(0))
        assert (assignment.batch_size, assignment.phase) == (32, EXPLORE), policy.name


def test_nothing_fits_is_a_typed_error() -> None:
    lane = JobSnapshot(spec(), GPU, (trial(1, 16, TrialStatus.FAILED, StopReason.OUT_OF_MEMORY),))
    with pytest.raises(NoFeasibleBatchSize, match="ran out of memory"):
        BsoPolicy().assign(lane, np.random.default_rng(0))


def test_no_feasible_size_suggests_what_fits_the_outcomes_that_ruled_sizes_out() -> None:
    """32 ran out of memory and 16 diverged: the message names 64 and up as too large
    to fit and suggests a learning rate and smaller sizes, not max_epochs or the
    target, which played no part.  A lane whose runs reached max_epochs is told
    about those."""
    lane = JobSnapshot(
        spec(), GPU,
        (
            trial(1, 32, TrialStatus.FAILED, StopReason.OUT_OF_MEMORY),
            trial(2, 16, TrialStatus.FAILED, StopReason.DIVERGED),
        ),
    )  # fmt: skip
    with pytest.raises(NoFeasibleBatchSize) as raised:
        BsoPolicy().assign(lane, np.random.default_rng(0))
    message = raised.value.message
    assert "16: failed (diverged); 32: out_of_memory; 64, 128, 256: do not fit" in message
    assert "learning rate" in message
    assert "list smaller sizes" in message
    assert "max_epochs" not in message
    one_size = spec(batch_sizes=[16], default_batch_size=16)
    timed_out = JobSnapshot(
        one_size, GPU, (trial(1, 16, TrialStatus.FAILED, StopReason.MAX_EPOCHS),)
    )
    with pytest.raises(NoFeasibleBatchSize, match="What to change: raise max_epochs"):
        BsoPolicy().assign(timed_out, np.random.default_rng(0))


# -- through the service ------------------------------------------------------------------


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def service(clock: Clock) -> BsoService:
    service = BsoService(MemoryStore(), clock=clock)
    service.register(spec())
    return service


def converge(service: BsoService, number: int, epochs: int = 3) -> None:
    for epoch in range(1, epochs + 1):
        service.report_epoch(
            "job",
            number,
            epoch=epoch,
            time_s=10.0 * epoch,
            energy_j=1000.0 * epoch,
            metric=1.0 if epoch == epochs else 0.0,
        )


def test_an_interrupted_trial_gives_its_size_the_next_trial(service: BsoService) -> None:
    first = service.next_trial("job")
    service.report_epoch("job", first.trial_number, epoch=1, time_s=5, energy_j=5, metric=0.0)
    ended = service.end_trial("job", first.trial_number, reason=StopReason.INTERRUPTED)
    assert (ended.status, ended.reason) == (TrialStatus.INTERRUPTED, StopReason.INTERRUPTED)
    again = service.next_trial("job")
    assert (again.batch_size, again.phase) == (first.batch_size, first.phase)
    size = {s.batch_size: s for s in service.status("job").lanes[0].sizes}[first.batch_size]
    assert size.outcomes == {"interrupted": 1, "running": 1}
    assert (size.converged, size.failed, size.not_converged) == (0, 0, 1)


def test_an_interrupted_exploitation_run_is_repeated(service: BsoService) -> None:
    # Converge every exploration until the policy exploits, then interrupt one run.
    for _ in range(20):
        assigned = service.next_trial("job")
        if assigned.phase is TrialPhase.EXPLOITATION:
            break
        converge(service, assigned.trial_number)
    assert assigned.phase is TrialPhase.EXPLOITATION
    service.end_trial("job", assigned.trial_number, reason=StopReason.INTERRUPTED)
    again = service.next_trial("job")
    assert (again.batch_size, again.phase) == (assigned.batch_size, TrialPhase.EXPLOITATION)


def test_out_of_memory_until_reprobe(service: BsoService) -> None:
    first = service.next_trial("job")
    assert first.batch_size == 64
    ended = service.end_trial("job", first.trial_number, reason=StopReason.OUT_OF_MEMORY)
    assert (ended.status, ended.reason) == (TrialStatus.FAILED, StopReason.OUT_OF_MEMORY)
    handed_out = set()
    for _ in range(8):
        assigned = service.next_trial("job")
        handed_out.add(assigned.batch_size)
        converge(service, assigned.trial_number)
    assert handed_out <= {16, 32}
    lane = service.status("job").lanes[0]
    assert lane.memory_limit == 64
    assert lane.recommended_batch_size in (16, 32)
    # After a re-probe the larger sizes are candidates again.
    reprobed = service.next_trial("job", reprobe_memory=True)
    assert service.status("job").lanes[0].memory_limit is None
    assert reprobed.batch_size in (16, 32, 64, 128, 256)


def test_diverged_is_the_size_fault_once_the_lane_reported_a_number(service: BsoService) -> None:
    first = service.next_trial("job")
    converge(service, first.trial_number)
    second = service.next_trial("job")
    service.report_epoch("job", second.trial_number, epoch=1, time_s=5, energy_j=5, metric=0.0)
    ended = service.end_trial("job", second.trial_number, reason=StopReason.DIVERGED)
    assert (ended.status, ended.reason) == (TrialStatus.FAILED, StopReason.DIVERGED)
    assert service.next_trial("job").batch_size != second.batch_size


def test_a_nan_first_epoch_before_any_number_counts_only_when_it_repeats(
    service: BsoService,
) -> None:
    """An empty validation set makes every size's first epoch NaN: three runs of such a
    script used to rule out three sizes and lock the job (NoFeasibleBatchSize)."""
    sizes = []
    for _ in range(MAX_INTERRUPTIONS):
        assigned = service.next_trial("job")
        sizes.append(assigned.batch_size)
        service.end_trial("job", assigned.trial_number, reason=StopReason.DIVERGED)
    assert sizes == [64] * MAX_INTERRUPTIONS  # the size gets the next run again, twice
    fixed = service.next_trial("job")  # the third in a row counted: one failure of 64
    assert fixed.batch_size != 64
    converge(service, fixed.trial_number)
    lane = service.status("job").lanes[0]
    assert lane.stuck is None
    assert {s.batch_size: s.failed for s in lane.sizes}[64] == MAX_INTERRUPTIONS


def test_unproven_divergence_is_a_first_report_nan_before_the_lane_measured_anything() -> None:
    def nan_at_first_report(number: int, size: int) -> TrialSnapshot:
        return TrialSnapshot(
            number,
            size,
            EXPLORE,
            TrialStatus.FAILED,
            epochs=0,
            cost=0.0,
            stop_reason=StopReason.DIVERGED,
        )

    first, second = nan_at_first_report(1, 64), nan_at_first_report(2, 64)
    assert unproven_divergence(first, lane_reported_a_number=False)
    assert not unproven_divergence(first, lane_reported_a_number=True)
    later = trial(2, 64, TrialStatus.FAILED, StopReason.DIVERGED)  # two epochs, then NaN
    assert not unproven_divergence(later, lane_reported_a_number=False)
    assert learning_view(snapshot(first, second)).trials == ()
    # Once any run reported a number, a NaN at the first report is the size's again.
    measured = trial(1, 32, TrialStatus.CONVERGED, StopReason.TARGET_REACHED)
    after = nan_at_first_report(2, 64)
    assert [t.trial_number for t in learning_view(snapshot(measured, after)).trials] == [1, 2]


def test_lease_and_heartbeats(service: BsoService, clock: Clock) -> None:
    leased = service.next_trial("job", lease_s=60.0)
    clock.now += timedelta(seconds=50)
    ack = service.heartbeat("job", leased.trial_number)
    assert ack.status is TrialStatus.RUNNING
    clock.now += timedelta(seconds=50)  # 100 s after the start, 50 s after the heartbeat
    assert service.interrupt_stale_trials(timedelta(hours=6)) == []
    clock.now += timedelta(seconds=11)
    assert service.interrupt_stale_trials(timedelta(hours=6)) == [("job", leased.trial_number)]
    late = service.heartbeat("job", leased.trial_number)
    assert (late.status, late.reason) == (TrialStatus.INTERRUPTED, StopReason.HEARTBEAT_TIMEOUT)


def test_heartbeats_are_not_recorded(service: BsoService) -> None:
    assigned = service.next_trial("job", lease_s=60.0)
    first = service.heartbeat("job", assigned.trial_number, event_id="hb-1")
    again = service.heartbeat("job", assigned.trial_number, event_id="hb-1")
    assert first == again
    with service.store.transaction("job") as tx:
        assert tx.recorded_reply("hb-1") is None


# -- zero and equal costs: never a size outside the candidates -----------------------


def test_thompson_pick_never_leaves_its_arms() -> None:
    from bso.core.bandit import pooled_thompson_pick

    default = spec().default_batch_size
    arms = (16, 32, 64, 128)

    def pick(cost: float, seed: int) -> int:
        observations = {b: [cost, cost] for b in arms}
        return pooled_thompson_pick(
            observations, np.random.default_rng(seed), lambda b: abs(b - default)
        )

    # Zero costs: no noise to sample, every draw ties, the tie goes to the default.
    assert {pick(0.0, seed) for seed in range(20)} == {default}
    # Equal costs: sampling still explores among them, never outside them.
    assert {pick(5.0, seed) for seed in range(20)} <= set(arms)


@pytest.mark.parametrize("policy", ["bso", "zeus"])
def test_energy_only_with_zero_energy_stays_within_the_candidates(policy: str) -> None:
    service = BsoService(MemoryStore())
    service.register(spec(policy, eta_knob=1.0))
    for _ in range(25):
        assigned = service.next_trial("job")
        assert assigned.batch_size in spec().batch_sizes
        for epoch in range(1, 4):
            decision = service.report_epoch(
                "job",
                assigned.trial_number,
                epoch=epoch,
                time_s=10.0 * epoch,
                energy_j=0.0,
                metric=1.0 if epoch == 3 else 0.0,
            )
            assert decision.cost == 0.0
            if decision.stop:
                break
    lane = service.status("job").lanes[0]
    assert lane.recommended_batch_size == 64  # every size costs 0: the default
    assert lane.confidence is not None
    assert 0 <= lane.confidence < 90


# -- script errors: a bug in the script is not the batch size's fault ---------------------


def crashed_before_epoch_1(number: int, size: int) -> TrialSnapshot:
    return TrialSnapshot(
        number, size, EXPLORE, TrialStatus.FAILED, stop_reason=StopReason.ABANDONED
    )


def test_a_crash_at_any_epoch_is_a_script_error() -> None:
    """An exception says nothing about the size (a typo in the validation code raises
    at any batch size); what the size did does: out of memory, a diverged metric."""
    assert outcome_of(crashed_before_epoch_1(1, 64)) is Outcome.SCRIPT_ERROR
    crashed_in_epoch_3 = trial(1, 64, TrialStatus.FAILED, StopReason.ABANDONED)
    assert outcome_of(crashed_in_epoch_3) is Outcome.SCRIPT_ERROR
    assert learning_view(snapshot(crashed_in_epoch_3)).trials == ()
    oom = TrialSnapshot(1, 64, EXPLORE, TrialStatus.FAILED, stop_reason=StopReason.OUT_OF_MEMORY)
    assert outcome_of(oom) is Outcome.OUT_OF_MEMORY  # before epoch 1 too: the size's fault
    diverged = trial(1, 64, TrialStatus.FAILED, StopReason.DIVERGED)
    assert outcome_of(diverged) is Outcome.FAILED
    assert learning_view(snapshot(diverged)).trials == (diverged,)


def test_script_errors_are_ignored_and_never_count_as_interruptions() -> None:
    errors = [crashed_before_epoch_1(n, 64) for n in range(1, 6)]
    assert learning_view(snapshot(*errors)).trials == ()
    # Interleaved with interruptions they neither count as one nor break their run.
    interrupted = [trial(n, 64, TrialStatus.INTERRUPTED, StopReason.INTERRUPTED) for n in (2, 4)]
    mixed = snapshot(
        crashed_before_epoch_1(1, 64), interrupted[0], crashed_before_epoch_1(3, 64), interrupted[1]
    )
    assert learning_view(mixed).trials == ()
    assert script_errors_in_a_row(snapshot(*errors)) == 5
    assert script_errors_in_a_row(mixed) == 0


def test_ruled_out_names_sizes_and_outcomes() -> None:
    lane = snapshot(
        trial(1, 64, TrialStatus.FAILED, StopReason.MAX_EPOCHS),
        trial(2, 64, TrialStatus.FAILED, StopReason.MAX_EPOCHS),
        trial(3, 128, TrialStatus.FAILED, StopReason.OUT_OF_MEMORY),
        trial(4, 32, TrialStatus.FAILED, StopReason.COST_BOUND),
        crashed_before_epoch_1(5, 16),
        trial(6, 16, TrialStatus.INTERRUPTED, StopReason.INTERRUPTED),
    )
    assert ruled_out(lane) == (
        "16: interrupted; 32: stopped (cost_bound); 64: failed (max_epochs) x2; 128: out_of_memory"
    )


def abandon(service: BsoService, number: int) -> None:
    ended = service.end_trial("job", number, reason=StopReason.ABANDONED)
    assert (ended.status, ended.reason) == (TrialStatus.FAILED, StopReason.ABANDONED)


@pytest.mark.parametrize("policy", ["bso", "zeus"])
def test_five_runs_that_raise_before_epoch_1_then_a_good_run_trains(policy: str) -> None:
    """The issue's scenario: 5 sizes, 5 runs raise before their first epoch (bso's own
    OperationOrderError, scale_lr's ValueError), then the fixed script gets a size."""
    service = BsoService(MemoryStore())
    service.register(spec(policy))
    first = service.next_trial("job")
    assert first.notice is None
    abandon(service, first.trial_number)
    for run in range(2, 6):
        assigned = service.next_trial("job")
        assert assigned.batch_size == first.batch_size  # a fixed script runs the same size
        assert (assigned.notice is None) == (run <= 3)
        abandon(service, assigned.trial_number)
    good = service.next_trial("job")
    assert good.batch_size == first.batch_size
    assert good.notice is not None
    assert "the last 5 runs of job job" in good.notice
    assert f"at batch size {first.batch_size}: a bug in the script, not held against" in (
        good.notice
    )
    converge(service, good.trial_number)
    lane = service.status("job").lanes[0]
    size = {s.batch_size: s for s in lane.sizes}[first.batch_size]
    assert size.outcomes == {"converged": 1, "script_error": 5}
    assert lane.recommended_batch_size == first.batch_size
    assert service.next_trial("job").notice is None  # a run trained: the streak is over


def train(service: BsoService, number: int, epochs: int, cost_per_epoch: float) -> None:
    """``epochs`` epoch reports below the target (eta 1: cost is energy)."""
    for epoch in range(1, epochs + 1):
        service.report_epoch(
            "job", number, epoch=epoch, time_s=float(epoch), energy_j=cost_per_epoch * epoch,
            metric=0.1,
        )  # fmt: skip


@pytest.mark.parametrize("policy", ["bso", "zeus"])
def test_a_script_that_crashes_mid_training_never_rules_out_the_size_it_ran(policy: str) -> None:
    """A new user's scenario: three good runs, then six runs whose validation code
    raises in epoch 2 (a KeyError), then the fixed script.  Charged to the size, two
    such crashes dropped the best size and six ruled out every size the job had run
    (NoFeasibleBatchSize for the fixed script too).  Now the crashes are the script's:
    the fixed script runs the size the broken one was given, and the job learns on."""
    service = BsoService(MemoryStore())
    service.register(spec(policy, batch_sizes=[32, 64], default_batch_size=64))
    for _ in range(3):
        good = service.next_trial("job")
        converge(service, good.trial_number)
    crashed: list[int] = []
    for _ in range(6):
        assigned = service.next_trial("job")
        crashed.append(assigned.batch_size)
        train(service, assigned.trial_number, epochs=1, cost_per_epoch=3.0)
        abandon(service, assigned.trial_number)
    assert len(set(crashed)) == 1  # each run of the broken script got the same size
    fixed = service.next_trial("job")
    assert fixed.batch_size == crashed[0]
    assert fixed.notice is not None
    assert "were ended by the training script itself" in fixed.notice
    converge(service, fixed.trial_number)
    lane = service.status("job").lanes[0]
    size = {s.batch_size: s for s in lane.sizes}[crashed[0]]
    assert size.outcomes.get("script_error") == 6
    assert "failed" not in size.outcomes
    service.next_trial("job")  # still a size: nothing was ruled out


@pytest.mark.parametrize("policy", ["bso", "zeus"])
@pytest.mark.parametrize("reason", [StopReason.ABANDONED, StopReason.INTERRUPTED])
def test_a_rank_crashing_before_epoch_1_never_exhausts_a_job(
    policy: str, reason: StopReason
) -> None:
    """A DDP job whose rank 1 crashed, again and again, for reasons unrelated to the
    size: rank 0 sees the collective fail (abandoned) or torchrun's SIGTERM (interrupted),
    before its first epoch."""
    service = BsoService(MemoryStore())
    service.register(spec(policy, batch_sizes=[64], default_batch_size=64))
    for _ in range(2 * MAX_INTERRUPTIONS):
        assigned = service.next_trial("job")
        service.end_trial("job", assigned.trial_number, reason=reason)
    assert service.next_trial("job").batch_size == 64


def test_silent_deaths_before_epoch_1_still_count_when_they_repeat() -> None:
    """SIGKILL by the host's OOM killer looks like a vanished client: repeated, it may
    be the size's fault, so it is not retried forever."""
    lane = snapshot(
        *(
            TrialSnapshot(
                n, 64, EXPLORE, TrialStatus.INTERRUPTED, stop_reason=StopReason.HEARTBEAT_TIMEOUT
            )
            for n in range(1, MAX_INTERRUPTIONS + 1)
        )
    )
    (counted,) = learning_view(lane).trials
    assert counted.failed


def fail_every_size(service: BsoService) -> None:
    """Runs that end at max_epochs (2) short of the target, until no size is handed out."""
    for _ in range(10):
        try:
            assigned = service.next_trial("job")
        except NoFeasibleBatchSize:
            return
        for epoch in (1, 2):
            service.report_epoch(
                "job", assigned.trial_number, epoch=epoch, time_s=epoch, energy_j=epoch, metric=0
            )


def test_no_feasible_batch_size_names_what_ruled_sizes_out_and_the_way_out() -> None:
    service = BsoService(MemoryStore())
    service.register(spec(batch_sizes=[32, 64], default_batch_size=32, max_epochs=2))
    fail_every_size(service)
    with pytest.raises(NoFeasibleBatchSize) as raised:
        service.next_trial("job")
    message = raised.value.message
    assert "failed (max_epochs)" in message
    assert "bso jobs reset job" in message
    assert f"bso jobs set-sizes job --lane '{GPU.key}' --batch-sizes 32,64" in message
    # bso status says the lane is stuck, and why, before a run finds out.
    lane = service.status("job").lanes[0]
    assert (lane.stage, lane.stuck) == ("stuck", message)
    # Following either piece of advice gets the job going again.
    service.reset_job("job")
    assert service.next_trial("job").batch_size in (32, 64)
    assert service.status("job").lanes[0].stage == "exploring"


def test_no_feasible_batch_size_names_the_sizes_the_search_never_tried() -> None:
    """The default 32 and 64 hit max_epochs with nothing converged: bso's walk does
    not go past a failing size, so 128 was never tried; the message says so rather
    than leave it out of what 'ruled out' lists."""
    service = BsoService(MemoryStore())
    service.register(spec(batch_sizes=[32, 64, 128], default_batch_size=32, max_epochs=2))
    fail_every_size(service)
    with pytest.raises(NoFeasibleBatchSize, match=r"; not tried: 128 \(the search does not go"):
        service.next_trial("job")
