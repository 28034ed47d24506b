"""The synthetic landscapes have the shapes they are named for."""

from __future__ import annotations

import pytest

from bso.replay.landscapes import SHAPES, landscape, landscape_workloads


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
