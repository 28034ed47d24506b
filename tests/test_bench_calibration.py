"""scripts/bench_calibration.py: the reliability figures of bso's confidence."""

from __future__ import annotations

from types import ModuleType

import pytest

from tests.fixtures.scripts import load_script


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_script("bench_calibration")


def test_a_confidence_that_matches_its_hit_rate_has_no_calibration_error(
    bench: ModuleType,
) -> None:
    # Replay 1: said 0.25 four times, right once; replay 2: said 0.95 twenty times, right 19.
    found = [(0.25, i == 0, 1) for i in range(4)] + [(0.95, i > 0, 2) for i in range(20)]
    assert bench.ece(found) == pytest.approx(0.0)


def test_the_error_is_the_share_weighted_gap_per_bin(bench: ModuleType) -> None:
    # 0.9 said ten times, right five times: a gap of 0.4 on every sample.
    found = [(0.9, i < 5, i % 3) for i in range(10)]
    assert bench.ece(found) == pytest.approx(0.4)


def test_the_interval_resamples_whole_replays(bench: ModuleType) -> None:
    # One replay always right at 0.5, another always wrong at 0.5: depending on
    # which replays are drawn the error is anywhere from 0 to 0.5.
    found = [(0.5, True, 1)] * 10 + [(0.5, False, 2)] * 10
    low, high = bench.ece_interval(found)
    assert low <= bench.ece(found) <= high
    assert high == pytest.approx(0.5)


def test_per_kind_lines_take_each_replay_from_its_own_workload(
    bench: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    """Replays are numbered per workload in turn (here 2 each): a kind's line
    counts only its own workloads' samples."""
    from bso.replay.landscapes import landscape

    workloads = [landscape("plateau", 0), landscape("plateau", 1), landscape("lopsided", 0)]
    found = [(0.995, False, 1), (0.5, True, 3), (0.995, True, 5), (0.995, True, 6)]
    bench.report_by_kind(workloads, found, 2)
    plateau, lopsided = capsys.readouterr().out.splitlines()
    assert plateau.split()[:2] == ["plateau", "2"]
    assert plateau.endswith("at >= 99: 1, 100.0% missed")
    assert lopsided.split()[:2] == ["lopsided", "2"]
    assert lopsided.endswith("at >= 99: 2, 0.0% missed")
