"""Replays: one shared world per comparison, honest cost accounting, learning converges."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path
from typing import Any

import pytest

from bso.replay import simulate
from bso.replay.simulate import (
    ATTEMPTS_PER_RECURRENCE,
    RecurrenceResult,
    World,
    compare,
    make_world,
    replay_fixed,
    replay_policy,
    replay_schedule,
    walk_floor_schedule,
)
from bso.replay.traces import load_trace_workloads
from bso.replay.workloads import Workload, synthetic_workloads
from bso.service import BsoService
from bso.spec import Hardware, PolicyName
from bso.wire.events import EpochDecision, TrialAssigned

TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"
SYNTHETIC = {w.name: w for w in synthetic_workloads()}
LANGUAGE = SYNTHETIC["synthetic-language"]


@pytest.fixture(scope="module")
def trace_workloads() -> dict[str, Workload]:
    if not (TRACES / "summary_train.csv").is_file():
        pytest.fail(
            f"Zeus's traces are missing: expected {TRACES}/summary_train.csv and "
            "summary_power_v100.csv (the shared/ folder beside the repository)"
        )
    return {w.name: w for w in load_trace_workloads(TRACES)}


def run_cost(w: Workload, size: int, epochs: int, eta: float) -> float:
    return epochs * w.epoch_cost(size, eta)


# -- the world --------------------------------------------------------------------------


def test_world_is_determined_by_the_seed() -> None:
    a = make_world(LANGUAGE, recurrences=4, seed=3)
    assert a == make_world(LANGUAGE, recurrences=4, seed=3)
    assert a.draws != make_world(LANGUAGE, recurrences=4, seed=4).draws
    assert len(a.draws) == 4
    assert all(len(r) == ATTEMPTS_PER_RECURRENCE for r in a.draws)
    for recurrence in a.draws:
        for attempt in recurrence:
            assert set(attempt) == set(LANGUAGE.batch_sizes)
            for b, epochs in attempt.items():
                assert epochs in LANGUAGE.runs[b]


def test_world_json_for_the_zeus_driver() -> None:
    world = make_world(LANGUAGE, recurrences=2, seed=1, attempts=3)
    spec = LANGUAGE.job_spec(job_id="lang", seed=1)
    data = json.loads(json.dumps(world.to_json(spec)))
    assert data["job"]["job_id"] == "lang"
    assert data["job"]["batch_sizes"] == LANGUAGE.batch_sizes
    assert data["job"]["max_power_w"] == LANGUAGE.max_power_w
    assert set(data["sizes"]) == {str(b) for b in LANGUAGE.batch_sizes}
    assert len(data["recurrences"]) == 2
    assert len(data["recurrences"][0]) == 3
    smallest = str(LANGUAGE.batch_sizes[0])
    assert data["recurrences"][0][0][smallest] is None  # never converges: null


# -- fixed sizes ------------------------------------------------------------------------


def expected_fixed_costs(world: World, size: int, eta: float) -> list[tuple[float, int, bool]]:
    """Cost, tries and convergence of each recurrence when always training ``size``."""
    w = world.workload
    out = []
    for recurrence in world.draws:
        total, tries, converged = 0.0, 0, False
        for attempt in recurrence:
            needed = attempt[size]
            tries += 1
            if needed is not None and needed <= w.max_epochs:
                total += run_cost(w, size, needed, eta)
                converged = True
                break
            total += run_cost(w, size, w.max_epochs, eta)
        out.append((total, tries, converged))
    return out


@pytest.mark.parametrize("eta", [0.0, 0.5, 1.0])
def test_replay_fixed_of_the_oracle_costs_what_the_world_says(eta: float) -> None:
    for w in SYNTHETIC.values():
        world = make_world(w, recurrences=10, seed=5)
        oracle, _ = w.oracle(eta)
        result = replay_fixed(world, oracle, eta, "oracle")
        expected = expected_fixed_costs(world, oracle, eta)
        assert result.policy == "oracle"
        assert len(result.recurrences) == 10
        for rec, (cost, tries, converged) in zip(result.recurrences, expected, strict=True):
            assert rec.cost == pytest.approx(cost)
            assert rec.tries == tries
            assert rec.converged is converged
            assert rec.sizes == [oracle] * tries
            assert rec.recommendation == oracle
        assert result.total_cost == pytest.approx(sum(c for c, _, _ in expected))


def test_replay_fixed_of_a_size_that_never_converges_retries_every_attempt() -> None:
    world = make_world(LANGUAGE, recurrences=2, seed=5, attempts=4)
    smallest = LANGUAGE.batch_sizes[0]
    result = replay_fixed(world, smallest, 0.5, "smallest")
    for rec in result.recurrences:
        assert not rec.converged
        assert rec.tries == 4
        assert rec.cost == pytest.approx(4 * run_cost(LANGUAGE, smallest, LANGUAGE.max_epochs, 0.5))


def test_walk_floor_walks_from_the_default_to_the_oracle_one_size_per_recurrence() -> None:
    for w in SYNTHETIC.values():
        for eta in (0.0, 1.0):
            oracle, _ = w.oracle(eta)
            schedule = walk_floor_schedule(w, eta, recurrences=20)
            sizes = w.batch_sizes
            steps = abs(sizes.index(oracle) - sizes.index(w.default_batch_size))
            assert len(schedule) == 20
            assert schedule[0] == w.default_batch_size
            assert schedule[steps:] == [oracle] * (20 - steps)
            for a, b in itertools.pairwise(schedule[: steps + 1]):
                assert abs(sizes.index(a) - sizes.index(b)) == 1


def test_walk_floor_lies_between_the_oracle_and_what_its_sizes_cost() -> None:
    world = make_world(LANGUAGE, recurrences=12, seed=4)
    oracle, _ = LANGUAGE.oracle(0.5)
    schedule = walk_floor_schedule(LANGUAGE, 0.5, 12)
    assert LANGUAGE.default_batch_size != oracle, "the walk must have a path to cover"
    floor = replay_schedule(world, schedule, 0.5, "walk-floor")
    for index, size in enumerate(schedule):
        alone = replay_fixed(world, size, 0.5, "fixed").recurrences[index]
        assert floor.recurrences[index].cost == pytest.approx(alone.cost)
        assert floor.recurrences[index].sizes == alone.sizes
    assert floor.total_cost > replay_fixed(world, oracle, 0.5, "oracle").total_cost


def test_recurrence_cost_is_the_cost_formula_of_its_time_and_energy() -> None:
    world = make_world(LANGUAGE, recurrences=5, seed=2)
    for result in (
        replay_fixed(world, LANGUAGE.default_batch_size, 0.3, "default"),
        replay_policy(world, "zeus", eta_knob=0.3, beta_knob=2.0, seed=2),
    ):
        power = LANGUAGE.max_power_w * LANGUAGE.gpu_count
        for rec in result.recurrences:
            assert rec.cost == pytest.approx(0.3 * rec.energy_j + 0.7 * power * rec.time_s)


# -- learning policies through the service ---------------------------------------------


class Attempt:
    def __init__(self, size: int) -> None:
        self.size = size
        self.decision: EpochDecision | None = None


class RecordingService(BsoService):
    """The service the replay drives, noting what it hands out and decides."""

    attempts: list[Attempt] = []

    def next_trial(
        self, job_id: str, hardware: Hardware | None = None, **event: Any
    ) -> TrialAssigned:
        trial = super().next_trial(job_id, hardware, **event)
        RecordingService.attempts.append(Attempt(trial.batch_size))
        return trial

    def report_epoch(self, job_id: str, trial_number: int, **kw: Any) -> EpochDecision:
        decision = super().report_epoch(job_id, trial_number, **kw)
        if decision.stop:
            RecordingService.attempts[-1].decision = decision
        return decision


def recorded_replay(
    monkeypatch: pytest.MonkeyPatch, world: World, policy: PolicyName, eta: float
) -> tuple[list[RecurrenceResult], list[list[Attempt]]]:
    """Replay ``policy`` and split what the service saw by recurrence."""
    RecordingService.attempts = []
    monkeypatch.setattr(simulate, "BsoService", RecordingService)
    per_recurrence: list[list[Attempt]] = []
    seen = 0

    def on_recurrence(_: RecurrenceResult) -> None:
        nonlocal seen
        per_recurrence.append(RecordingService.attempts[seen:])
        seen = len(RecordingService.attempts)

    result = replay_policy(
        world,
        policy,
        eta_knob=eta,
        beta_knob=2.0,
        seed=4,
        on_recurrence=on_recurrence,
    )
    return result.recurrences, per_recurrence


@pytest.mark.parametrize("policy", ["bso", "zeus"])
def test_replays_see_the_world_and_count_every_attempt(
    monkeypatch: pytest.MonkeyPatch, policy: PolicyName
) -> None:
    w = SYNTHETIC["synthetic-vision"]
    world = make_world(w, recurrences=15, seed=4)
    recurrences, attempts = recorded_replay(monkeypatch, world, policy, 0.5)
    assert len(recurrences) == len(attempts) == 15
    for r, (rec, tried) in enumerate(zip(recurrences, attempts, strict=True)):
        assert rec.sizes == [a.size for a in tried]
        decisions = [a.decision for a in tried]
        assert all(d is not None for d in decisions)
        # The recurrence costs the sum of its attempts, as the service costed them.
        assert rec.cost == pytest.approx(sum(d.cost for d in decisions if d is not None))
        for a, attempt in enumerate(tried):
            assert attempt.decision is not None
            needed = world.draws[r][a][attempt.size]
            if attempt.decision.converged:
                # Converged exactly at the epoch the world drew for this attempt.
                assert attempt.decision.epoch == needed
                assert attempt.decision.cost == pytest.approx(
                    run_cost(w, attempt.size, attempt.decision.epoch, 0.5)
                )
            else:
                assert needed is None or needed > attempt.decision.epoch
        assert rec.converged == (decisions[-1] is not None and decisions[-1].converged)


@pytest.mark.parametrize("policy", ["bso", "zeus"])
@pytest.mark.parametrize("name", sorted(SYNTHETIC))
def test_learning_policies_converge_in_every_recurrence(policy: PolicyName, name: str) -> None:
    w = SYNTHETIC[name]
    world = make_world(w, recurrences=50, seed=1)
    result = replay_policy(world, policy, eta_knob=0.5, beta_knob=2.0, seed=1)
    assert result.policy == policy
    assert len(result.recurrences) == 50
    assert [r.index for r in result.recurrences] == list(range(50))
    for rec in result.recurrences:
        assert rec.converged, (name, policy, rec)
        assert 1 <= rec.tries <= ATTEMPTS_PER_RECURRENCE
        assert set(rec.sizes) <= set(w.batch_sizes)
        assert rec.recommendation in w.batch_sizes
        assert rec.confidence is not None
        assert 0 <= rec.confidence <= 100
    # The first recurrence starts from the default, as Zeus does.
    assert result.recurrences[0].sizes[0] == w.default_batch_size


def test_replays_are_deterministic() -> None:
    world = make_world(LANGUAGE, recurrences=10, seed=9)
    for policy in ("bso", "zeus"):
        a = replay_policy(world, policy, eta_knob=0.5, beta_knob=2.0, seed=9)
        b = replay_policy(world, policy, eta_knob=0.5, beta_knob=2.0, seed=9)
        assert a.to_dict() == b.to_dict()


def test_compare_replays_every_policy_on_the_same_world() -> None:
    comparison = compare(
        LANGUAGE, ["bso", "zeus"], eta_knob=0.5, beta_knob=2.0, recurrences=8, seed=6
    )
    world = make_world(LANGUAGE, 8, 6)
    assert set(comparison.results) == {"oracle", "default", "bso", "zeus"}
    assert comparison.oracle_batch_size == LANGUAGE.oracle(0.5)[0]
    default = replay_fixed(world, LANGUAGE.default_batch_size, 0.5, "default")
    assert comparison.results["default"].to_dict() == default.to_dict()
    oracle = replay_fixed(world, comparison.oracle_batch_size, 0.5, "oracle")
    assert comparison.results["oracle"].to_dict() == oracle.to_dict()
    bso = replay_policy(world, "bso", eta_knob=0.5, beta_knob=2.0, seed=6)
    assert comparison.results["bso"].to_dict() == bso.to_dict()
    assert comparison.ratio("oracle") == 1.0
    assert comparison.ratio("zeus", "default") == pytest.approx(
        comparison.results["zeus"].total_cost / comparison.results["default"].total_cost
    )
    data = comparison.results["zeus"].to_dict()
    assert data["total_cost"] == pytest.approx(comparison.results["zeus"].total_cost)
    json.dumps(data)


def test_on_recurrence_is_called_once_per_recurrence_and_policy() -> None:
    seen: list[int] = []
    compare(
        LANGUAGE,
        ["bso", "zeus"],
        eta_knob=0.5,
        beta_knob=None,
        recurrences=3,
        seed=1,
        on_recurrence=lambda rec: seen.append(rec.index),
    )
    assert seen == [0, 1, 2, 0, 1, 2]


@pytest.mark.parametrize("name", ["cifar100", "movielens-1m"])
def test_learning_beats_a_poor_default_on_the_v100_traces(
    trace_workloads: dict[str, Workload], name: str
) -> None:
    w = trace_workloads[name]
    comparison = compare(w, ["bso", "zeus"], eta_knob=0.5, beta_knob=2.0, recurrences=50, seed=1)
    for policy in ("bso", "zeus"):
        result = comparison.results[policy]
        assert all(r.converged for r in result.recurrences), policy
        assert comparison.ratio(policy) < comparison.ratio("default"), policy
        assert math.isfinite(comparison.ratio(policy))
        # Where the default is poor, the learners end up recommending something else.
        assert result.recurrences[-1].recommendation != w.default_batch_size, policy
