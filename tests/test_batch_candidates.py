"""A JobSpec's batch sizes from the largest that fits (bso_client.batch_candidates)."""

from __future__ import annotations

from typing import Any

import pytest

from bso.errors import InvalidSpec
from bso.spec import MAX_BATCH_SIZE, JobSpec
from bso_client.batch_candidates import (
    AutoBatchSizes,
    auto_batch_sizes,
    candidate_batch_sizes,
    default_batch_size,
)


@pytest.mark.parametrize(
    ("maximum", "options", "expected"),
    [
        (1000, {}, [8, 16, 32, 64, 128, 256, 512, 1000]),
        (1024, {}, [8, 16, 32, 64, 128, 256, 512, 1024]),
        (8, {}, [8]),
        (1000, {"include_max": False}, [8, 16, 32, 64, 128, 256, 512]),
        (100, {"min_batch_size": 12}, [16, 32, 64, 100]),
        (100, {"min_batch_size": 1}, [1, 2, 4, 8, 16, 32, 64, 100]),
        (15, {"min_batch_size": 9}, [15]),
    ],
)
def test_candidate_batch_sizes(maximum: int, options: dict[str, Any], expected: list[int]) -> None:
    assert candidate_batch_sizes(maximum, **options) == expected


@pytest.mark.parametrize(
    ("maximum", "options", "match"),
    [
        (5, {}, r"largest batch size that fits \(5\) is below min_batch_size 8"),
        (15, {"min_batch_size": 9, "include_max": False}, "no candidate left"),
        (MAX_BATCH_SIZE + 1, {}, "largest batch size a JobSpec accepts"),
    ],
)
def test_candidate_batch_sizes_refuses_what_cannot_make_a_spec(
    maximum: int, options: dict[str, Any], match: str
) -> None:
    with pytest.raises(InvalidSpec, match=match):
        candidate_batch_sizes(maximum, **options)


@pytest.mark.parametrize(
    ("maximum", "cap", "expected"),
    [(1000, None, 512), (1024, None, 1024), (1000, 256, 256), (1000, 300, 256), (100, 4096, 64)],
)
def test_default_batch_size(maximum: int, cap: int | None, expected: int) -> None:
    assert default_batch_size(maximum, cap=cap) == expected


def test_default_batch_size_refuses_a_cap_below_the_minimum() -> None:
    with pytest.raises(InvalidSpec, match=r"min\(max_batch_size, cap\) = 4"):
        default_batch_size(1000, cap=4)
    with pytest.raises(ValueError, match="cap must be a positive"):
        default_batch_size(1000, cap=0)
    with pytest.raises(ValueError, match="max_batch_size must be positive"):
        candidate_batch_sizes(0)


def test_auto_batch_sizes_always_make_a_valid_spec() -> None:
    for maximum in [*range(8, 300), 4095, 4096, 4097, MAX_BATCH_SIZE]:
        for cap in (None, 8, 100, 256):
            auto = auto_batch_sizes(maximum, default_cap=cap)
            assert auto.default_batch_size in auto.batch_sizes
            assert auto.batch_sizes == sorted(set(auto.batch_sizes))
    auto = auto_batch_sizes(1000, default_cap=256)
    assert auto == AutoBatchSizes([8, 16, 32, 64, 128, 256, 512, 1000], 256)
    spec = JobSpec(job_id="auto", target_metric=0.9, **auto._asdict())
    assert (spec.batch_sizes, spec.default_batch_size) == (auto.batch_sizes, 256)
