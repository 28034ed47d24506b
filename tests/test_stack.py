"""The stack's configuration: what it refuses before it starts anything."""

from __future__ import annotations

import pytest

from bso_workers.stack import StackConfig, check_concurrency, describe_pool


def test_a_solo_node_runs_one_process() -> None:
    check_concurrency("solo", 1)
    check_concurrency("prefork", 4)
    with pytest.raises(ValueError, match="--concurrency 2 needs --pool prefork"):
        check_concurrency("solo", 2)
    with pytest.raises(ValueError, match="needs --pool prefork"):
        StackConfig(pool="solo", concurrency=3)


def test_the_pool_is_described_as_the_processes_it_runs() -> None:
    assert describe_pool(StackConfig()) == "solo pool: one process each"
    assert describe_pool(StackConfig(pool="prefork", concurrency=1)) == (
        "prefork pool: 1 process each"
    )
    assert describe_pool(StackConfig(pool="prefork", concurrency=4)) == (
        "prefork pool: 4 processes each"
    )
