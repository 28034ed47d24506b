"""A new lane starts from what the job's other lanes learned (bso/core/transfer.py)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from bso.commands.status import describe, start_line
from bso.core import transfer
from bso.core.bso_policy import BsoPolicy
from bso.core.epoch_predictions import revisit_guesses
from bso.core.size_evidence import SizeEvidence, gather_evidence
from bso.core.state import EpochFloor, EpochGuess, JobSnapshot, LanePrior, TrialSnapshot
from bso.core.vocabulary import StopReason, TrialPhase, TrialStatus
from bso.replay.landscapes import landscape
from bso.replay.lanes import TILTS, on_other_gpu, replay_pair
from bso.replay.workloads import synthetic_workloads
from bso.service import BsoService
from bso.spec import Hardware, JobSpec
from bso.status import StartStatus
from bso.storage.memory import MemoryStore
from tests.test_bso_policy import first_epoch_stop

SIZES = [32, 64, 128, 256, 512]
V100 = Hardware(gpu_model="V100", max_power_w=250.0)
A100 = Hardware(gpu_model="A100", max_power_w=400.0)
H100 = Hardware(gpu_model="H100", max_power_w=700.0)


def spec(hardware: Hardware = V100, policy: str = "bso") -> JobSpec:
    return JobSpec.model_validate(
        {
            "job_id": "job",
            "batch_sizes": SIZES,
            "default_batch_size": 512,
            "target_metric": 0.9,
            "eta_knob": 1.0,
            "mab_seed": 1,
            "policy": policy,
            "hardware": hardware,
        }
    )


def converged(number: int, size: int, cost: float) -> TrialSnapshot:
    return TrialSnapshot(
        number, size, TrialPhase.EXPLORATION, TrialStatus.CONVERGED, 10,
        energy_j=cost, cost=cost, stop_reason=StopReason.TARGET_REACHED,
    )  # fmt: skip


def lane(hardware: Hardware, *trials: TrialSnapshot) -> JobSnapshot:
    return JobSnapshot(spec(hardware), hardware, tuple(trials))


# Lane V100 learned: 128 is cheapest, 64 and 256 close, 32 and 512 far worse.
V100_COSTS = {32: 300.0, 64: 110.0, 128: 100.0, 256: 108.0, 512: 200.0}
V100_LANE = lane(
    V100,
    *[
        converged(number, size, cost)
        for number, (size, cost) in enumerate(
            [(s, c) for s, c in V100_COSTS.items() for _ in range(2)], start=1
        )
    ],
)


def test_a_new_lane_starts_at_the_other_lanes_recommendation() -> None:
    start = transfer.lane_start(lane(A100), [V100_LANE])
    assert start is not None
    assert (start.from_lane, start.recommended, start.batch_size) == (V100.key, 128, 128)
    assert start.converged_runs == 10
    assert start.relative_costs[512] == pytest.approx(2.0)


def test_a_flat_curve_starts_the_new_lane_at_the_default() -> None:
    """The V100 saves only 5% at 128 over the default 512, two doublings away: on
    another GPU the optimum may well be elsewhere, so the lane starts at the
    default (and bso status says why), with the curve still as its prior."""
    flat = lane(
        V100,
        *[converged(n, size, cost) for n, (size, cost) in enumerate([(128, 100.0), (512, 105.0)])],
    )
    start = transfer.lane_start(lane(A100), [flat])
    assert start is not None
    assert (start.recommended, start.batch_size) == (128, 512)
    line = start_line(StartStatus(**{k: getattr(start, k) for k in STATUS_FIELDS}), 512)
    assert line == (
        f"  started at the default 512: lane {V100.key}'s recommendation 128 (2 converged "
        "runs) is not cheaper than it by more than curves differ between GPUs"
    )


STATUS_FIELDS = ("from_lane", "recommended", "batch_size", "converged_runs")


def test_the_start_moves_to_the_lanes_nearest_candidate() -> None:
    other_sizes = lane(A100).spec.model_copy(update={"batch_sizes": [48, 96, 192, 512]})
    new_lane = JobSnapshot(other_sizes, A100)
    start = transfer.lane_start(new_lane, [V100_LANE])
    assert start is not None
    assert start.batch_size == 96  # log-nearest to 128 (ties: the smaller)


def test_the_start_does_not_move_under_a_lane_that_has_begun() -> None:
    """V100's trial at 128 is still running when the A100 lane begins: the A100 starts
    from what had ended (512), and when that trial converges later, cheaper, the
    A100 lane's start, its walk and bso status stay what they were."""
    service = BsoService(MemoryStore())
    service.register(spec())
    first = service.next_trial("job", V100)  # the default, 512
    report("job", first.trial_number, service, cost=200.0)
    running = service.next_trial("job", V100)  # the walk's next size
    a100 = service.next_trial("job", A100)
    assert a100.batch_size == 512  # all that had ended: one run of 512
    report("job", running.trial_number, service, cost=10.0)
    (lane_status,) = [ln for ln in service.status("job").lanes if ln.hardware == A100]
    assert lane_status.started_from is not None
    assert lane_status.started_from.recommended == 512


def report(job: str, trial: int, service: BsoService, cost: float) -> None:
    """One epoch that reaches the target at ``cost`` (eta 1: cost is energy), then the end."""
    service.report_epoch(job, trial, epoch=1, time_s=1.0, energy_j=cost, metric=1.0)
    service.end_trial(job, trial)


def test_the_lane_with_the_most_converged_runs_is_followed() -> None:
    little = lane(H100, converged(11, 32, 50.0))
    start = transfer.lane_start(lane(A100), [little, V100_LANE])
    assert start is not None
    assert start.from_lane == V100.key


def test_nothing_converged_elsewhere_means_the_default() -> None:
    failed = TrialSnapshot(
        1, 128, TrialPhase.EXPLORATION, TrialStatus.FAILED, 100,
        cost=1.0, stop_reason=StopReason.MAX_EPOCHS,
    )  # fmt: skip
    assert transfer.lane_start(lane(A100), [lane(V100, failed)]) is None
    assert transfer.lane_start(lane(A100), []) is None


def test_the_walk_skips_a_size_the_other_curve_puts_far_above() -> None:
    """From 128, the walk tries 256 (8% worse there: within how curves differ) but
    not 512 (2x) nor 32 (3x): it goes on to 64 instead.  The best size's own
    neighbours are always measured, whatever the other curve says."""
    start = transfer.lane_start(lane(A100), [V100_LANE])
    assert start is not None
    prior = transfer.lane_prior(lane(A100), start)
    assert prior.log_sd == pytest.approx(transfer.SHAPE_LOG_SD)  # nothing shared yet
    assert transfer.prior_says_worse(lane_with(prior), 512, 128)
    assert transfer.prior_says_worse(lane_with(prior), 32, 128)
    assert not transfer.prior_says_worse(lane_with(prior), 256, 128)
    assert not transfer.prior_says_worse(lane_with(prior), 512, 256)  # a neighbour
    policy, rng = BsoPolicy(), np.random.default_rng(0)
    first = policy.assign(lane_with(prior), rng)
    assert first.batch_size == 128
    tried = [converged(20, 128, 150.0), converged(21, 256, 160.0)]
    assert policy.assign(lane_with(prior, *tried), rng).batch_size == 64


def lane_with(prior: LanePrior, *trials: TrialSnapshot) -> JobSnapshot:
    return JobSnapshot(spec(A100), A100, tuple(trials), prior=prior)


def test_a_lane_whose_curve_differs_trusts_the_other_less() -> None:
    """Here 512 is the cheapest and 128 twice as dear: the opposite of the V100's
    curve, so the spread of how curves differ grows past the prior."""
    start = transfer.lane_start(lane(A100), [V100_LANE])
    assert start is not None
    unlike = lane(A100, converged(20, 128, 200.0), converged(21, 512, 100.0))
    assert transfer.shape_noise(unlike, start) > 2 * transfer.SHAPE_LOG_SD
    alike = lane(A100, converged(20, 128, 100.0), converged(21, 512, 200.0))
    assert transfer.shape_noise(alike, start) < transfer.SHAPE_LOG_SD


def test_the_service_starts_a_new_lane_from_the_other_and_bso_status_says_so() -> None:
    service = BsoService(MemoryStore())
    workload = synthetic_workloads()[0]
    service.register(workload.job_spec(job_id="job", seed=1))
    other = on_other_gpu(workload, TILTS[0])
    first_lane = [service.next_trial("job", workload.hardware) for _ in range(1)]
    for trial in first_lane:
        service.report_epoch("job", trial.trial_number, epoch=1, time_s=10.0, energy_j=1e3,
                             metric=workload.target_metric)  # fmt: skip
        service.end_trial("job", trial.trial_number)
    assignment = service.next_trial("job", other.hardware)
    assert assignment.batch_size == workload.default_batch_size  # its only converged size
    status = service.status("job")
    new_lane = next(ln for ln in status.lanes if ln.hardware.key == other.hardware.key)
    assert new_lane.started_from is not None
    assert new_lane.started_from.from_lane == workload.hardware.key
    old_lane = next(ln for ln in status.lanes if ln.hardware.key == workload.hardware.key)
    assert old_lane.started_from is None
    said = [line for line in describe(status).splitlines() if "started at" in line]
    assert said == [
        f"  started at {assignment.batch_size}, from lane {workload.hardware.key}'s "
        f"recommendation {workload.default_batch_size} (1 converged runs)"
    ]


def test_zeus_baseline_lanes_do_not_transfer() -> None:
    service = BsoService(MemoryStore())
    service.register(spec(policy="zeus"))
    trial = service.next_trial("job", V100)
    service.report_epoch("job", trial.trial_number, epoch=1, time_s=1.0, energy_j=1.0, metric=1.0)
    service.end_trial("job", trial.trial_number)
    service.next_trial("job", A100)
    assert all(ln.started_from is None for ln in service.status("job").lanes)


def test_a_lane_pair_replay_costs_no_more_than_a_cold_start_where_the_optimum_stays() -> None:
    """One synthetic job, 30 recurrences on one GPU then 30 on another whose curve
    is tilted: the second lane, started from the first, pays less than alone."""
    workload = synthetic_workloads()[0]
    result = replay_pair(
        workload, on_other_gpu(workload, TILTS[1]), eta_knob=0.5, seed=1, recurrences=30
    )
    assert result.transferred < result.cold


def test_alike_lanes_lean_on_each_others_epochs_and_unlike_ones_less() -> None:
    """Epochs to target belong to the optimisation: where both lanes converged at a
    size, how far their epochs differ beyond run-to-run noise is learnt."""
    assert transfer.lane_epochs_sd({}, {128: [10]}, 0.1) == pytest.approx(
        transfer.LANE_EPOCHS_LOG_SD
    )
    alike = transfer.lane_epochs_sd({64: [20], 128: [10]}, {64: [20], 128: [10, 11]}, 0.1)
    unlike = transfer.lane_epochs_sd({64: [40], 128: [25]}, {64: [20], 128: [10, 11]}, 0.1)
    assert alike < transfer.LANE_EPOCHS_LOG_SD < 2 * transfer.LANE_EPOCHS_LOG_SD < unlike
    # A gap within what both means' noise explains teaches nothing.
    noisy = transfer.lane_epochs_sd({128: [12]}, {128: [10]}, 0.3)
    assert noisy < transfer.LANE_EPOCHS_LOG_SD


# A job whose epochs to target and cost per epoch per size are fixed (eta 1: cost is
# energy): 128 is cheapest; 64 is twice as dear per epoch and needs nearly as many
# epochs, so a run of it costs 1.7x the best.
EPOCHS = {32: 8, 64: 9, 128: 10, 256: 20, 512: 45}
JOULES_PER_EPOCH = {32: 40.0, 64: 20.0, 128: 10.5, 256: 6.0, 512: 4.0}


def run_until_stopped(service: BsoService, job: str, hardware: Hardware) -> tuple[int, int]:
    """One trial as a training job runs it: (its size, the epochs it ran)."""
    trial = service.next_trial(job, hardware)
    size = trial.batch_size
    for epoch in range(1, EPOCHS[size] + 1):
        decision = service.report_epoch(
            job, trial.trial_number, epoch=epoch, time_s=float(epoch),
            energy_j=epoch * JOULES_PER_EPOCH[size], metric=float(epoch == EPOCHS[size]),
        )  # fmt: skip
        if decision.stop:
            break
    service.end_trial(job, trial.trial_number)
    return size, epoch


def test_a_size_another_gpu_showed_dear_is_stopped_after_its_first_epoch() -> None:
    """The V100 lane learned every size's epochs.  On the A100 (the same per-size
    figures), 64's first epoch costs 20: with the V100's 9 epochs it will cost
    about 180 against 128's 105, so it is stopped then.  The same A100 as a job of
    its own knows only that epochs shrink at most in proportion to the batch, and
    lets 64 run on."""
    service = BsoService(MemoryStore())
    service.register(spec())
    for _ in range(12):
        run_until_stopped(service, "job", V100)
    transferred = [run_until_stopped(service, "job", A100) for _ in range(8)]
    service.register(spec(A100).model_copy(update={"job_id": "cold"}))
    cold = [run_until_stopped(service, "cold", A100) for _ in range(8)]
    assert transferred[0] == (128, 10)  # the V100's recommendation, run to the target
    assert (64, 1) in transferred
    assert all(epochs > 1 for size, epochs in cold if size == 64)
    assert any(size == 64 for size, _ in cold)
    spent = sum(epochs * JOULES_PER_EPOCH[size] for size, epochs in transferred)
    assert spent < sum(epochs * JOULES_PER_EPOCH[size] for size, epochs in cold)


def test_a_size_stopped_on_another_lanes_epochs_is_predicted_from_them() -> None:
    """1024 was stopped after one epoch here, while 512's only run took an unlucky 27
    epochs.  Epochs do not shrink as the batch grows, so without other lanes the
    revisit guess may not go below 26; the other GPU measured 1024 itself at 21.6
    epochs, and that is what the guess rests on: 1024 stays in exploitation's draw
    (it would cost about 21.6 epochs at 1.07 against 512's 27 at 1.0)."""
    evidence = {
        512: SizeEvidence(1.0, (27,), (), 0),
        1024: SizeEvidence(1.07, (), (1,), 0),
    }
    alone = revisit_guesses(evidence)[1024]
    assert math.exp(alone.log_floor) == pytest.approx(1.07 * 26)
    guess = EpochGuess(math.log(21.6), 0.08, 0.08)
    evidence[1024] = dataclasses.replace(evidence[1024], other_lane=guess)
    told = revisit_guesses(evidence)[1024]
    assert math.exp(told.log_median) == pytest.approx(1.07 * 21.6)
    assert told.log_floor < told.log_median < math.log(27.0)
    assert told.log_sd == pytest.approx(0.08)


def test_a_size_cut_on_another_lanes_epochs_is_not_cut_for_good() -> None:
    """256 was cut after its first epoch: at 7 per epoch and the other GPU's 20
    epochs it would cost 140 against 128's 105.  A stop is a projection: 256 stays
    in exploitation's draw while its cost may plausibly be within the margin, so
    a GPU on which it needs fewer epochs still finds it, now and then."""
    trials = [
        converged(1, 128, 105.0),
        converged(2, 128, 105.0),
        converged(3, 64, 200.0),
        converged(5, 512, 300.0),  # the default, run first
        first_epoch_stop(4, 256, 7.0),
    ]
    guess = {256: EpochGuess(math.log(20.0), 0.12, 0.08)}
    here = JobSnapshot(spec(A100), A100, tuple(trials), other_lanes_epochs=guess)
    policy, rng = BsoPolicy(), np.random.default_rng(3)
    picks = [policy.next_trial(here, rng).batch_size for _ in range(400)]
    assert 0 < picks.count(256) < 40  # now and then, as a cost 1.3x the best's may win
    assert picks.count(128) > 300


def cost_stop(number: int, size: int, epochs: int, cost: float) -> TrialSnapshot:
    return TrialSnapshot(
        number, size, TrialPhase.EXPLORATION, TrialStatus.FAILED, epochs,
        energy_j=cost, cost=cost, stop_reason=StopReason.COST_BOUND,
    )  # fmt: skip


def first_epoch_of(size: int, per_epoch: float, floors: dict[int, EpochFloor]) -> bool:
    """Whether bso stops a run of ``size`` on the A100 after its first epoch, at
    ``per_epoch``, where 128 converged twice in 10 epochs at 105 a run."""
    here = lane(A100, converged(1, 128, 105.0), converged(2, 128, 105.0))
    here = dataclasses.replace(here, other_lanes_floors=floors)
    running = TrialSnapshot(3, size, TrialPhase.EXPLORATION, epochs=1, cost=per_epoch)
    return BsoPolicy().early_stop(here, running).stop


def test_a_size_another_gpu_cut_short_of_the_target_is_cut_after_its_first_epoch() -> None:
    """On the V100, 256 never converged: bso stopped it for cost after 40 epochs,
    four times 128's 10 (past the critical batch).  On the A100 its first epoch
    costs 6, so 40 epochs or more cost well over 128's 105: it is cut then.  A
    cold A100 knows only that a larger batch needs no fewer epochs than 128's 10,
    about 60 in all, and lets it run on.  Where 256's epoch is cheap enough that
    even the V100's epochs leave it a chance (2 a run), it runs here too: another
    GPU's dear size may be this one's cheapest."""
    v100 = lane(V100, converged(1, 128, 100.0), converged(2, 128, 100.0),
                cost_stop(3, 256, 40, 200.0), cost_stop(4, 256, 25, 120.0))  # fmt: skip
    a100 = lane(A100, converged(5, 128, 105.0))
    floors = transfer.epoch_floors(a100, [v100])
    assert set(floors) == {256}
    assert floors[256].epochs == 41
    assert 0 < floors[256].log_sd < 0.5
    assert first_epoch_of(256, 6.0, floors)
    assert not first_epoch_of(256, 6.0, {})
    assert not first_epoch_of(256, 2.0, floors)
    assert transfer.epoch_floors(a100, [a100]) == {}  # a lane teaches others, not itself


def test_a_new_lane_does_not_pay_again_for_a_size_past_the_critical_batch() -> None:
    """cliff-jump-0: past 128 a run needs several times the epochs.  The first lane
    ran 256 twice before dropping it; a second GPU, faster at every size, started
    cold, pays for both again; started from the first lane, it cuts 256 after one
    epoch (its epochs there are the first lane's) and costs less."""
    first = landscape("cliff-jump", 0)
    second = on_other_gpu(first, next(t for t in TILTS if t.name == "faster-large"))
    result = replay_pair(first, second, eta_knob=0.5, seed=1, recurrences=8)
    assert result.optimum_move == 0
    assert result.transferred < 0.95 * result.cold


# A lane that measured 128 and its neighbours, both clearly dearer, so bso's walk
# has ended; 32 and 512 are untried.  Another GPU converged at every size.
WALKED = (
    *[converged(n, 128, 100.0) for n in (1, 2)],
    *[converged(n, 256, 125.0) for n in (3, 4)],
    *[converged(n, 64, 130.0) for n in (5, 6)],
)
GUESSES = {b: EpochGuess(math.log(10), 0.1, 0.08) for b in SIZES}


def walked_lane(other_curve: dict[int, float]) -> JobSnapshot:
    prior = LanePrior(128, other_curve, transfer.SHAPE_LOG_SD)
    return JobSnapshot(spec(A100), A100, WALKED, prior=prior, other_lanes_epochs=GUESSES)


def test_a_size_past_the_walks_end_that_another_gpu_shows_far_cheaper_gets_one_epoch() -> None:
    """The other GPU's curve falls past 256, where this lane's walk ended (256 is a
    quarter dearer here, 5% cheaper there): 512 is predicted at 125 x 0.5 / 0.95 = 66,
    so one epoch of it is worth its price.  Where the other curve rises past 256 too,
    nothing is looked at and exploitation goes on."""
    falling = {32: 1.5, 64: 1.3, 128: 1.0, 256: 0.95, 512: 0.5}
    policy, rng = BsoPolicy(), np.random.default_rng(0)
    looked = policy.assign(walked_lane(falling), rng)
    assert (looked.batch_size, looked.phase) == (512, TrialPhase.EXPLORATION)
    rising = {32: 1.5, 64: 1.3, 128: 1.0, 256: 0.95, 512: 1.2}
    rising_lane = walked_lane(rising)
    assert transfer.one_epoch_look(rising_lane, gather_evidence(rising_lane)) is None
    assert policy.assign(walked_lane(rising), rng).phase is TrialPhase.EXPLOITATION


def test_only_a_size_whose_epochs_another_lane_measured_is_looked_at() -> None:
    """Without the other lanes' epochs a first epoch does not tell the size's cost,
    so the walk's end is the end: a job's only lane never looks."""
    falling = {32: 1.5, 64: 1.3, 128: 1.0, 256: 0.95, 512: 0.5}
    alone = dataclasses.replace(walked_lane(falling), other_lanes_epochs={})
    assert transfer.one_epoch_look(alone, gather_evidence(alone)) is None
    measured_elsewhere = dataclasses.replace(
        walked_lane(falling), other_lanes_epochs={b: GUESSES[b] for b in (32, 64, 128, 256)}
    )
    assert transfer.one_epoch_look(measured_elsewhere, gather_evidence(measured_elsewhere)) is None


def test_a_looks_value_weighs_its_chance_to_win_against_what_a_loss_costs() -> None:
    """A size predicted a third cheaper than the best is worth a look; one predicted
    as dear as the best, with little doubt, is not (it would run to the end about
    half the time and lose); great doubt about it makes it worth one epoch again."""
    guess = EpochGuess(math.log(20), 0.05, 0.05)
    assert transfer.look_value(100.0, math.log(67), 0.2, guess) > 20
    assert transfer.look_value(100.0, math.log(100), 0.05, guess) < 0
    assert transfer.look_value(100.0, math.log(100), 1.0, guess) > 0


def test_a_new_lane_looks_past_a_flat_stretch_the_other_gpu_showed_falls_away() -> None:
    """edge-large-0 on a lower-power GPU: cost is flat from 64 to 1024 there and
    falls by a fifth to 8192, the cheapest on both GPUs.  Cold, the walk ends on
    the flat stretch and stays there; started from the first lane, one epoch of
    8192 shows its cost, and the lane moves there."""
    first = landscape("edge-large", 0)
    second = on_other_gpu(first, next(t for t in TILTS if t.name == "low-power-small"))
    result = replay_pair(first, second, eta_knob=0.5, seed=1, recurrences=12)
    assert result.transferred < 0.95 * result.cold
