"""The synthetic landscapes have the shapes they are named for."""

from __future__ import annotations

import pytest

from bso.replay.landscapes import (
    HELD_OUT_SHAPES,
    SECOND_HELD_OUT_SHAPES,
    SHAPES,
    landscape,
    landscape_workloads,
)
from bso.replay.workloads import Workload


@pytest.mark.parametrize("instance", range(3))
def test_shapes(instance: int) -> None:
    for name in SHAPES:
        w = landscape(name, instance)
        sizes = w.batch_sizes
        costs = {b: w.expected_cost(b, 0.5) for b in sizes}
        oracle, best = w.oracle(0.5)
        default = costs[w.default_batch_size]
        assert sizes[0] < w.default_batch_size < sizes[-1], name
        if name == "edge-small":
            assert oracle == sizes[0]
        elif name == "edge-large":
            assert oracle == sizes[-1]
        elif name.startswith("cliff"):
            assert oracle > w.default_batch_size
            past = [b for b in sizes if b > oracle]
            assert past
            assert all(costs[b] > 2 * best for b in past)  # inf for cliff-fail
        elif name == "noisy-flat":
            assert max(costs.values()) < 1.06 * min(costs.values())
            spreads = [max(r) / min(r) for r in w.runs.values() if None not in r]
            assert max(spreads) > 1.5  # noisy: runs of one size differ a lot
        elif name == "default-optimal":
            assert oracle == w.default_batch_size
        elif name == "lower-is-better":
            assert not w.higher_is_better_metric
            assert oracle != w.default_batch_size
            assert default > best


def test_deterministic_and_distinct() -> None:
    first = landscape_workloads()
    assert [w.runs for w in first] == [w.runs for w in landscape_workloads()]
    assert len({tuple(w.batch_sizes) for w in first}) > 3
    assert len(first) == 3 * len(SHAPES)


def at_eta_half(w: Workload) -> tuple[list[float], int, int]:
    """Each size's expected cost over the cheapest's at eta 0.5, and the indices of
    the cheapest and of the default."""
    sizes = w.batch_sizes
    oracle, best = w.oracle(0.5)
    relative = [w.expected_cost(b, 0.5) / best for b in sizes]
    return relative, sizes.index(oracle), sizes.index(w.default_batch_size)


@pytest.mark.parametrize("instance", range(3))
def test_held_out_shapes(instance: int) -> None:
    for name in HELD_OUT_SHAPES:
        w = landscape(name, instance)
        sizes = w.batch_sizes
        relative, at, around = at_eta_half(w)
        steps_from_default = abs(at - around)
        if name == "plateau":
            assert sum(r < 1.01 for r in relative) >= 3  # a near-tie
        elif name == "two-valleys":
            assert steps_from_default >= 2
            for neighbour in (around - 1, around + 1):  # the default is a valley too
                if 0 <= neighbour < len(sizes):
                    assert relative[neighbour] > relative[around]
        elif name == "steep-valley":
            assert 1 <= steps_from_default <= 2
            assert all(r > 1.15 for i, r in enumerate(relative) if abs(i - at) == 1)
        elif name == "lopsided":
            assert not w.higher_is_better_metric
            sides = [r for i, r in enumerate(relative) if abs(i - at) == 1]
            assert max(sides) > 1.1 or len(sides) == 1


@pytest.mark.parametrize("instance", range(3))
def test_second_held_out_shapes(instance: int) -> None:
    for name in SECOND_HELD_OUT_SHAPES:
        w = landscape(name, instance)
        relative, at, default = at_eta_half(w)
        if name == "distant-valley":
            farthest = max(abs(i - default) for i in range(len(relative)))
            assert abs(at - default) >= min(3, farthest)
        elif name == "decoy-valley":
            assert at == default
        elif name == "shelf":
            assert not w.higher_is_better_metric
            near = [i for i, r in enumerate(relative) if r < 1.03]  # the shelf, one run
            assert near == list(range(near[0], near[-1] + 1))
            assert at in near
        else:
            assert max(relative) > 1.05


def test_held_out_kinds_are_not_in_the_default_set() -> None:
    assert not set(HELD_OUT_SHAPES) & set(SHAPES)
    held_out = landscape_workloads(kinds="held-out")
    assert {w.name.rsplit("-", 1)[0] for w in held_out} == set(HELD_OUT_SHAPES)
    assert not set(SECOND_HELD_OUT_SHAPES) & (set(SHAPES) | set(HELD_OUT_SHAPES))
    second = landscape_workloads(kinds="second-held-out")
    assert {w.name.rsplit("-", 1)[0] for w in second} == set(SECOND_HELD_OUT_SHAPES)
