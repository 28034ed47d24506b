"""ZeusPolicy (bso/core/zeus_policy.py): pruning rounds, then Thompson sampling.

The pruning order is checked against a transcription of Zeus's
``PruningExploreManager.next_batch_size`` (shared/seeds/004_*.txt): default
first, then downward until a size fails, then upward until a size fails; the
next round runs over the survivors with the previous round's cheapest size as
the pivot.  The stop rules it shares with every policy are in test_policy.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest

from bso.core.policy import MAX_CONSECUTIVE_FAILURES, Assignment
from bso.core.state import TrialSnapshot
from bso.core.vocabulary import TrialPhase
from bso.errors import NoFeasibleBatchSize
from bso.spec import JobSpec
from tests.test_policy import EXPLORE, ZEUS, finished, make_spec, snapshot

EXPLOIT = TrialPhase.EXPLOITATION


def explore_until_exploitation(
    spec: JobSpec, outcome: Mapping[int, float | None]
) -> tuple[list[int], list[TrialSnapshot]]:
    """Run every exploration ZeusPolicy hands out; the sizes in order and the trials."""
    trials: list[TrialSnapshot] = []
    rng = np.random.default_rng(0)
    for _ in range(200):
        assignment = ZEUS.next_trial(snapshot(spec, trials), rng)
        if assignment.phase is not EXPLORE:
            return [t.batch_size for t in trials], trials
        trials.append(
            finished(len(trials) + 1, assignment.batch_size, outcome[assignment.batch_size])
        )
    raise AssertionError("pruning never ended")


# -- a transcription of Zeus's PruningExploreManager.next_batch_size (seed doc 004) ---


def zeus_reference_next(
    sizes: list[int],
    default: int,
    rounds: int,
    history: Mapping[int, list[float | None]],
) -> int | list[int]:
    """Next size to explore, or the surviving sizes; ``history[b][r]``: cost or None."""
    batch_sizes = list(sizes)
    exp_default_bs = default
    for round_index in range(rounds):
        converged_bs_list = []
        min_cost_of_round = float("inf")
        min_batch_size_of_round = 0
        batch_sizes.sort()
        idx = batch_sizes.index(exp_default_bs)
        down = sorted(batch_sizes[: idx + 1], reverse=True)
        up = sorted(batch_sizes[idx + 1 :])
        for bs_list in [down, up]:
            for bs in bs_list:
                if bs in history and len(history[bs]) > round_index:
                    cost = history[bs][round_index]
                    if cost is None:
                        break
                    converged_bs_list.append(bs)
                    if cost < min_cost_of_round:
                        min_cost_of_round = cost
                        min_batch_size_of_round = bs
                else:
                    return bs
        exp_default_bs = min_batch_size_of_round
        batch_sizes = converged_bs_list
        if len(batch_sizes) == 0:
            raise NoFeasibleBatchSize("No converged batch sizes")
    return sorted(batch_sizes)


# -- pruning order ----------------------------------------------------------------------


def test_pruning_order_of_the_zeus_doc() -> None:
    spec = make_spec()
    outcome = {8: None, 16: 50.0, 32: 40.0, 64: 60.0, 128: 70.0, 256: None}
    order, _ = explore_until_exploitation(spec, outcome)
    assert order == [
        # round 0: default, downward until 8 fails, then upward until 256 fails
        64, 32, 16, 8, 128, 256,
        # round 1 over the survivors, from the cheapest of round 0 (32)
        32, 16, 64, 128,
    ]  # fmt: skip


def test_a_failure_going_down_skips_the_smaller_sizes() -> None:
    spec = make_spec(sizes=[8, 16, 32, 64, 128], default=64)
    outcome = {8: 10.0, 16: 10.0, 32: None, 64: 60.0, 128: 50.0}
    order, _ = explore_until_exploitation(spec, outcome)
    assert order == [64, 32, 128, 128, 64]
    assert 8 not in order
    assert 16 not in order


def test_next_round_pivots_on_the_rounds_cheapest_size() -> None:
    spec = make_spec(sizes=[16, 32, 64, 128], default=128)
    outcome = {16: 30.0, 32: 20.0, 64: 25.0, 128: 40.0}
    order, _ = explore_until_exploitation(spec, outcome)
    assert order == [128, 64, 32, 16, 32, 16, 64, 128]


@pytest.mark.parametrize("rounds", [1, 2, 3])
def test_num_pruning_rounds(rounds: int) -> None:
    spec = make_spec(sizes=[16, 32, 64], default=32, num_pruning_rounds=rounds)
    outcome = {16: 30.0, 32: 20.0, 64: 25.0}
    order, _ = explore_until_exploitation(spec, outcome)
    assert len(order) == 3 * rounds
    assert order[:3] == [32, 16, 64]
    assert order == [32, 16, 64] * rounds


def test_default_failing_goes_straight_up() -> None:
    spec = make_spec(sizes=[16, 32, 64, 128], default=32)
    outcome = {16: 5.0, 32: None, 64: 40.0, 128: 30.0}
    order, _ = explore_until_exploitation(spec, outcome)
    assert order[:3] == [32, 64, 128]
    assert 16 not in order


@pytest.mark.parametrize("seed", range(40))
def test_pruning_matches_zeus_reference_on_random_jobs(seed: int) -> None:
    rng = np.random.default_rng(seed)
    sizes = sorted(int(s) for s in rng.choice([2**k for k in range(3, 13)], 6, replace=False))
    default = int(rng.choice(sizes))
    rounds = int(rng.integers(1, 4))
    spec = make_spec(sizes=sizes, default=default, num_pruning_rounds=rounds)
    fail_rate = float(rng.uniform(0.0, 0.5))
    trials: list[TrialSnapshot] = []
    history: dict[int, list[float | None]] = {}
    for _ in range(100):
        try:
            expected: int | list[int] | None = zeus_reference_next(sizes, default, rounds, history)
        except NoFeasibleBatchSize:
            expected = None
        if expected is None:
            with pytest.raises(NoFeasibleBatchSize):
                ZEUS.next_trial(snapshot(spec, trials), rng)
            return
        got = ZEUS.next_trial(snapshot(spec, trials), rng)
        if isinstance(expected, list):
            assert got.phase is EXPLOIT
            assert got.batch_size in expected
            assert ZEUS.pruning(snapshot(spec, trials)) == expected
            return
        assert got == Assignment(expected, EXPLORE)
        cost = None if rng.random() < fail_rate else float(rng.uniform(10, 100))
        history.setdefault(expected, []).append(cost)
        trials.append(finished(len(trials) + 1, expected, cost))
    raise AssertionError("reference pruning never ended")


def test_nothing_converging_is_no_feasible_batch_size() -> None:
    spec = make_spec(sizes=[16, 32, 64, 128], default=32)
    trials = [finished(1, 32, None), finished(2, 64, None)]
    with pytest.raises(NoFeasibleBatchSize, match="no batch size converged during pruning"):
        ZEUS.next_trial(snapshot(spec, trials), np.random.default_rng(0))


def test_pruning_only_reads_exploration_trials() -> None:
    spec = make_spec(sizes=[16, 32, 64], default=32)
    # Concurrent runs of other sizes do not count as explorations of those sizes.
    trials = [
        finished(1, 32, 10.0),
        finished(2, 32, 10.0, phase=TrialPhase.CONCURRENT),
        finished(3, 64, 5.0, phase=TrialPhase.CONCURRENT),
    ]
    assert ZEUS.next_trial(snapshot(spec, trials), np.random.default_rng(0)) == Assignment(
        16, EXPLORE
    )


# -- concurrent trials ------------------------------------------------------------------


def test_running_exploration_without_any_result_gives_the_default() -> None:
    spec = make_spec()
    trials = [TrialSnapshot(1, 64, EXPLORE)]
    assignment = ZEUS.next_trial(snapshot(spec, trials), np.random.default_rng(0))
    assert assignment == Assignment(64, TrialPhase.CONCURRENT)


def test_running_exploration_gives_the_best_known_size() -> None:
    spec = make_spec()
    trials = [finished(1, 64, 60.0), finished(2, 32, 40.0), TrialSnapshot(3, 16, EXPLORE)]
    assignment = ZEUS.next_trial(snapshot(spec, trials), np.random.default_rng(0))
    assert assignment == Assignment(32, TrialPhase.CONCURRENT)


def test_running_concurrent_trials_do_not_block_exploration() -> None:
    spec = make_spec()
    trials = [finished(1, 64, 60.0), TrialSnapshot(2, 64, TrialPhase.CONCURRENT)]
    assignment = ZEUS.next_trial(snapshot(spec, trials), np.random.default_rng(0))
    assert assignment == Assignment(32, EXPLORE)


# -- Thompson sampling stage -------------------------------------------------------------


def pruned_job(**changes: Any) -> tuple[JobSpec, list[TrialSnapshot]]:
    """The doc example after pruning: 16, 32, 64, 128 survived; 8 and 256 failed."""
    spec = make_spec(**changes)
    outcome = {8: None, 16: 50.0, 32: 40.0, 64: 60.0, 128: 70.0, 256: None}
    _, trials = explore_until_exploitation(spec, outcome)
    return spec, trials


def test_thompson_sampling_only_over_survivors() -> None:
    spec, trials = pruned_job()
    picks = {
        ZEUS.next_trial(snapshot(spec, trials), np.random.default_rng(seed)).batch_size
        for seed in range(300)
    }
    assert picks <= {16, 32, 64, 128}
    assert 32 in picks  # the cheapest survivor does get picked


def test_every_survivor_is_pulled_mab_num_explorations_times_first() -> None:
    spec, trials = pruned_job(mab_num_explorations=3)
    rng = np.random.default_rng(0)
    picks = []
    for _ in range(4):
        assignment = ZEUS.next_trial(snapshot(spec, trials), rng)
        assert assignment.phase is EXPLOIT
        picks.append(assignment.batch_size)
        trials.append(finished(len(trials) + 1, assignment.batch_size, 50.0, phase=EXPLOIT))
    assert sorted(picks) == [16, 32, 64, 128]


def exploiting_job() -> tuple[JobSpec, list[TrialSnapshot]]:
    """Two survivors: 64 is far cheaper than 32, so TS wants 64 almost always."""
    spec = make_spec(sizes=[32, 64], default=64)
    trials = [
        finished(1, 64, 100.0),
        finished(2, 32, 1000.0),
        finished(3, 64, 101.0),
        finished(4, 32, 1010.0),
    ]
    assert ZEUS.pruning(snapshot(spec, trials)) == [32, 64]
    return spec, trials


def picks_over_seeds(spec: JobSpec, trials: list[TrialSnapshot], seeds: int = 200) -> set[int]:
    return {
        ZEUS.next_trial(snapshot(spec, trials), np.random.default_rng(seed)).batch_size
        for seed in range(seeds)
    }


def test_a_size_failing_repeatedly_in_exploitation_is_never_handed_out_again() -> None:
    spec, trials = exploiting_job()
    assert 64 in picks_over_seeds(spec, trials)
    trials = [
        *trials,
        *(finished(5 + i, 64, None, EXPLOIT) for i in range(MAX_CONSECUTIVE_FAILURES)),
    ]
    assert picks_over_seeds(spec, trials) == {32}
    # ...and it stays dropped however many times the other size then runs.
    rng = np.random.default_rng(1)
    for _ in range(20):
        assignment = ZEUS.next_trial(snapshot(spec, trials), rng)
        assert assignment.batch_size == 32
        trials.append(finished(len(trials) + 1, 32, 1000.0, EXPLOIT))


def test_failures_that_are_not_consecutive_do_not_drop_a_size() -> None:
    spec, trials = exploiting_job()
    trials += [
        finished(5, 64, None, EXPLOIT),
        finished(6, 64, 100.0, EXPLOIT),
        finished(7, 64, None, EXPLOIT),
    ]
    assert 64 in picks_over_seeds(spec, trials)


def test_running_trials_do_not_count_as_failures() -> None:
    spec, trials = exploiting_job()
    trials += [finished(5, 64, None, EXPLOIT), TrialSnapshot(6, 64, EXPLOIT)]
    assert 64 in picks_over_seeds(spec, trials)


def test_every_survivor_failing_is_no_feasible_batch_size() -> None:
    spec, trials = exploiting_job()
    for size in (32, 64):
        for _ in range(MAX_CONSECUTIVE_FAILURES):
            trials.append(finished(len(trials) + 1, size, None, EXPLOIT))
    with pytest.raises(NoFeasibleBatchSize):
        ZEUS.next_trial(snapshot(spec, trials), np.random.default_rng(0))


def exploitation_sequence(seed: int, steps: int = 30) -> list[int]:
    spec = make_spec(sizes=[32, 64, 128], default=64, mab_seed=seed)
    trials = [finished(i + 1, b, c) for i, (b, c) in enumerate(
        [(64, 100.0), (32, 105.0), (128, 98.0), (128, 99.0), (64, 101.0), (32, 103.0)]
    )]  # fmt: skip
    rng = np.random.default_rng(seed)
    noise = np.random.default_rng(1234)  # the world is the same for every seed
    base = {32: 104.0, 64: 100.0, 128: 99.0}
    sequence = []
    for _ in range(steps):
        assignment = ZEUS.next_trial(snapshot(spec, trials), rng)
        sequence.append(assignment.batch_size)
        cost = base[assignment.batch_size] * float(noise.lognormal(0.0, 0.05))
        trials.append(finished(len(trials) + 1, assignment.batch_size, cost, EXPLOIT))
    return sequence


def test_same_seed_same_sequence() -> None:
    assert exploitation_sequence(5) == exploitation_sequence(5)
    sequences = {tuple(exploitation_sequence(seed)) for seed in range(5)}
    assert len(sequences) > 1  # the seed does matter
