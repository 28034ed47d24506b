"""bso.core.micro_batch: the micro-batch exploration's arithmetic, order, stop rule
and recommendation, on step times drawn from known throughput curves."""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import pytest

from bso.core.micro_batch import (
    DROP_BELOW,
    MIN_TIMED_STEPS,
    STOP_CONFIDENCE,
    WARMUP_STEPS,
    MicroBatchChoice,
    MicroBatchExploration,
    Timings,
    accumulation_steps,
    candidates,
    learned_choice,
    merge_timings,
    step_budget,
)


def test_candidates_are_the_divisors_of_the_per_device_batch_that_fit() -> None:
    assert candidates(64) == [1, 2, 4, 8, 16, 32, 64]
    assert candidates(96, devices=2) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 48]
    assert candidates(96, devices=2, largest_fitting=20) == [1, 2, 3, 4, 6, 8, 12, 16]
    with pytest.raises(ValueError, match="does not split evenly over 3 devices"):
        candidates(64, devices=3)
    with pytest.raises(ValueError, match="must be positive"):
        candidates(0)


def test_accumulation_keeps_the_global_batch() -> None:
    for devices in (1, 2, 4):
        for micro in candidates(96 * devices, devices=devices):
            passes = accumulation_steps(96 * devices, devices, micro)
            assert passes * micro * devices == 96 * devices
    with pytest.raises(ValueError, match="does not divide batch 96"):
        accumulation_steps(96, 2, 5)


def test_the_budget_is_a_share_of_the_expected_steps() -> None:
    assert step_budget(10_000) == 200
    assert step_budget(10_000, share=0.05) == 500
    assert step_budget(40) == 0  # too short a run to explore
    with pytest.raises(ValueError, match="fraction"):
        step_budget(100, share=1.5)


def run(
    exploration: MicroBatchExploration,
    seconds_per_sample: Callable[[int], float],
    noise: float = 0.02,
    seed: int = 1,
    batch: int = 64,
) -> list[int]:
    """Steps the exploration asks for, each timed from the curve with log-normal noise."""
    rng = random.Random(seed)
    taken = []
    while (micro := exploration.next_micro_batch()) is not None:
        taken.append(micro)
        jitter = math.exp(rng.gauss(0, noise))
        warmup = 5.0 if len(exploration.steps.get(micro, [])) < WARMUP_STEPS else 1.0
        exploration.record(micro, batch, batch * seconds_per_sample(micro) * jitter * warmup)
    return taken


def peaked(best: int) -> Callable[[int], float]:
    """Per-sample time falls with the micro-batch up to ``best``, then rises (memory-bound)."""
    return lambda m: 1.0 + 0.3 * abs(math.log2(m / best))


def test_it_finds_a_peak_below_the_largest_and_skips_the_slow_small_ones() -> None:
    exploration = MicroBatchExploration(candidates(64), base=64, budget=60)
    taken = run(exploration, peaked(16))
    choice = exploration.choice()
    assert choice.micro_batch == 16
    assert choice.confidence >= STOP_CONFIDENCE
    assert choice.performance == pytest.approx(1.6, rel=0.05)  # 64 costs 1.6x per sample
    assert len(taken) < 60  # stopped early: 16 is clearly best
    # Past a hopeless size below the best, smaller ones are never timed (slowest steps).
    assert 1 not in taken
    assert 2 not in taken
    assert taken[0] == 64  # the base first


def test_one_slow_size_below_the_best_does_not_end_the_descent() -> None:
    """64 dips on its own (an awkward kernel shape); 32 below it is the fastest."""
    curve = {128: 1.5, 64: 2.2, 32: 1.0, 16: 1.3, 8: 2.0, 4: 3.0, 2: 4.0, 1: 5.0}
    exploration = MicroBatchExploration(candidates(128), base=128, budget=80)
    taken = run(exploration, lambda m: curve[m], batch=128)
    assert exploration.choice().micro_batch == 32
    assert 1 not in taken  # past 8 and 4, hopeless in a row below 32


def test_steps_alternate_with_the_best_so_far() -> None:
    exploration = MicroBatchExploration([64, 32], base=64, budget=20)
    taken = run(exploration, {64: 1.0, 32: 1.005}.__getitem__, noise=0.05)
    warm_ups_and_base = 1 + WARMUP_STEPS + MIN_TIMED_STEPS - 1
    after = taken[warm_ups_and_base:]
    assert after[:6] == [32, 64, 32, 64, 32, 64]  # whichever of the two is ahead


def test_the_base_is_timed_first_and_the_rest_from_the_largest_down() -> None:
    exploration = MicroBatchExploration(candidates(64), base=8, budget=100)
    taken = run(exploration, peaked(32))
    first_seen = list(dict.fromkeys(taken))
    assert first_seen[:3] == [8, 64, 32]
    assert exploration.choice().micro_batch == 32


def test_it_never_takes_more_steps_than_its_budget() -> None:
    exploration = MicroBatchExploration(candidates(64), base=64, budget=7)
    taken = run(exploration, peaked(16), noise=0.2)
    assert len(taken) == 7
    assert exploration.next_micro_batch() is None


def test_a_near_tie_is_settled_by_the_tolerance() -> None:
    """Two micro-batches 0.2% apart: which is faster would take thousands of steps
    to tell, but both are right, and the exploration stops."""
    curve = {32: 1.000, 16: 1.002, 8: 1.5, 4: 2.0, 2: 3.0, 1: 5.0}
    exploration = MicroBatchExploration(candidates(32), base=32, budget=200)
    taken = run(exploration, lambda m: curve[m], noise=0.003)
    assert exploration.choice().micro_batch in (16, 32)
    assert exploration.choice().confidence >= STOP_CONFIDENCE
    assert len(taken) < 40


def test_noisy_steps_keep_the_confidence_honest() -> None:
    """With 30% step noise and a 5% gap, a few steps cannot settle it."""
    curve = {8: 1.0, 4: 1.05, 2: 1.6, 1: 2.5}
    exploration = MicroBatchExploration(candidates(8), base=8, budget=12)
    run(exploration, lambda m: curve[m], noise=0.3, seed=3)
    assert exploration.choice().confidence < STOP_CONFIDENCE


def test_hopeless_candidates_are_not_timed_again() -> None:
    curve = {16: 1.0, 8: 3.0, 4: 6.0, 2: 9.0, 1: 12.0}
    exploration = MicroBatchExploration(candidates(16), base=16, budget=100)
    run(exploration, lambda m: curve[m], noise=0.05)
    assert 8 in exploration.dropped
    timed = len(exploration.steps[8]) - WARMUP_STEPS
    assert timed == MIN_TIMED_STEPS
    chance = exploration.choice().probability
    assert chance[8] < DROP_BELOW


def test_the_warm_up_step_is_not_counted() -> None:
    """16 compiles slowly and 8 quickly; counted, the warm-ups would make 8 look
    the faster, but past them 16 is twice as fast."""
    exploration = MicroBatchExploration([16, 8], base=8, budget=100)
    exploration.record(16, 64, 500.0)  # compiling kernels
    exploration.record(8, 64, 5.0)
    for _ in range(MIN_TIMED_STEPS):
        exploration.record(16, 64, 64.0)
        exploration.record(8, 64, 128.0)
    choice = exploration.choice()
    assert choice.micro_batch == 16
    assert choice.performance == pytest.approx(2.0)
    assert exploration.cost_per_sample(16) == pytest.approx(0.5)  # eta 0.5, unit power
    assert exploration.steps_taken == 2 + 2 * MIN_TIMED_STEPS


def test_a_single_candidate_needs_no_steps() -> None:
    assert MicroBatchExploration([64], base=64, budget=20).next_micro_batch() is None


def test_a_candidate_is_compared_only_once_timed_enough() -> None:
    exploration = MicroBatchExploration([16, 8], base=16, budget=100)
    for _ in range(WARMUP_STEPS + MIN_TIMED_STEPS):
        exploration.record(16, 64, 64.0)
    exploration.record(8, 64, 1.0)  # warm-up
    exploration.record(8, 64, 1.0)  # one lucky step is not an answer
    assert exploration.choice().micro_batch == 16
    assert set(exploration.choice().probability) == {16}


def test_energy_counts_at_the_jobs_eta() -> None:
    """At eta 1 only energy counts: the slower micro-batch that draws far less power wins."""
    exploration = MicroBatchExploration([16, 8], base=16, budget=100, eta_knob=1.0)
    for _ in range(WARMUP_STEPS + MIN_TIMED_STEPS):
        exploration.record(16, 64, 1.0, energy_j=300.0)
        exploration.record(8, 64, 1.2, energy_j=150.0)
    assert exploration.choice().micro_batch == 8
    assert exploration.choice().performance == pytest.approx(2.0)


def test_before_any_step_the_base_is_the_choice_at_no_confidence() -> None:
    exploration = MicroBatchExploration([32, 16], base=16, budget=10)
    assert exploration.choice() == MicroBatchChoice(16, 1.0, 0.0, {})
    assert exploration.next_micro_batch() == 16


def test_the_interim_log_line_reads_like_cerebrass() -> None:
    line = MicroBatchChoice(2, 1.2, 0.4567, {2: 0.4567}).log_line()
    assert line == (
        "current recommended micro_batch_size: 2, estimated performance: 1.20x base, "
        "confidence score: 45 (out of 100)"
    )


def test_bad_steps_and_bases_are_refused() -> None:
    with pytest.raises(ValueError, match="base 3 is not among the candidates"):
        MicroBatchExploration([4, 2, 1], base=3, budget=10)
    exploration = MicroBatchExploration([4, 2, 1], base=4, budget=10)
    with pytest.raises(ValueError, match="not a candidate"):
        exploration.record(3, 4, 1.0)
    with pytest.raises(ValueError, match="a step trains samples in time"):
        exploration.record(4, 4, 0.0)


def test_timings_of_two_runs_add_up_to_the_timings_of_all_their_steps() -> None:
    rng = random.Random(4)
    first = [rng.gauss(-3.0, 0.1) for _ in range(7)]
    second = [rng.gauss(-2.9, 0.1) for _ in range(4)]
    together = Timings.of(first).merged(Timings.of(second))
    expected = Timings.of(first + second)
    assert together.steps == expected.steps == 11
    assert together.mean == pytest.approx(expected.mean, abs=1e-12)
    assert together.squares == pytest.approx(expected.squares, abs=1e-12)
    merged = merge_timings({8: Timings.of(first)}, {8: Timings.of(second), 4: Timings.of(first)})
    assert merged[8].steps == 11
    assert merged[4] == Timings.of(first)


def test_a_run_starts_from_what_earlier_runs_timed() -> None:
    earlier = MicroBatchExploration(candidates(64), base=64, budget=60)
    run(earlier, peaked(16))
    known = earlier.run_timings()
    assert sum(t.steps for t in known.values()) == earlier.steps_taken - WARMUP_STEPS * len(
        earlier.steps
    )  # warm-ups are never sent
    settled = MicroBatchExploration(candidates(64), base=64, budget=60, known=known)
    assert settled.choice().micro_batch == 16
    assert settled.next_micro_batch() is None  # confident already: no step this run
    assert settled.run_timings() == {}
    # Knowing only the base, a run times the rest and not the base again first.
    partial = MicroBatchExploration(candidates(64), base=64, budget=60, known={64: known[64]})
    assert partial.next_micro_batch() == 32


def test_timings_of_a_candidate_no_longer_possible_are_ignored() -> None:
    known = {64: Timings(5, 0.0, 0.001), 128: Timings(5, -1.0, 0.001)}
    exploration = MicroBatchExploration(candidates(64), base=64, budget=10, known=known)
    assert 128 not in exploration.known
    assert exploration.timed(64) == 5


def test_the_learned_choice_is_the_fastest_timed_with_its_confidence() -> None:
    assert learned_choice({}) is None
    known = {32: Timings(12, math.log(1.0), 0.01), 64: Timings(12, math.log(1.3), 0.01)}
    choice = learned_choice(known)
    assert choice is not None
    assert choice.micro_batch == 32
    assert choice.performance == pytest.approx(1.3)
    assert choice.confidence > 0.99


def test_one_timed_candidate_settles_nothing() -> None:
    """A run whose budget ran out after the base alone: any other may be faster."""
    known = {64: Timings(12, 0.0, 0.01)}
    choice = learned_choice(known, candidates(64))
    assert choice is not None
    assert choice.micro_batch == 64
    assert choice.confidence == pytest.approx(1 / len(candidates(64)))
    assert learned_choice(known, [1, 2, 4]) is None  # none of its candidates was timed
    exploration = MicroBatchExploration(candidates(64), base=64, budget=30, known=known)
    assert exploration.next_micro_batch() == 32  # the descent goes on


def test_a_step_whose_energy_read_zero_counts_against_the_budget_and_says_nothing() -> None:
    """Energy only (eta 1): a step shorter than the counter's update reads 0 J."""
    exploration = MicroBatchExploration(candidates(64), base=64, budget=3, eta_knob=1.0)
    exploration.record(64, 64, 0.01, 0.0)
    exploration.record(64, 64, 0.01, 0.0)
    assert exploration.timings(64) is None
    assert exploration.steps_taken == 2
    exploration.record(64, 64, 0.01, 5.0)
    assert exploration.next_micro_batch() is None  # the budget is spent
    with pytest.raises(ValueError, match="negative"):
        exploration.record(64, 64, 0.01, -1.0)
