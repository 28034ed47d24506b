"""BatchGrowth: the one schedule the client grows a run by and the replay replays."""

from __future__ import annotations

import pytest

from bso.core.growth import BatchGrowth

SIZES = [16, 32, 64, 128, 200]


def test_doubles_every_epoch_up_to_the_largest_size() -> None:
    assert BatchGrowth().schedule(16, SIZES, 7) == [16, 32, 64, 128, 200, 200, 200]


def test_grows_only_at_its_epochs() -> None:
    assert BatchGrowth(every_epochs=2).schedule(32, SIZES, 6) == [32, 32, 64, 64, 128, 128]


def test_a_factor_between_sizes_takes_the_largest_size_within_it() -> None:
    assert BatchGrowth(factor=3.0).schedule(16, SIZES, 4) == [16, 32, 64, 128]
    assert BatchGrowth(factor=1.5).schedule(16, SIZES, 3) == [16, 16, 16]  # no size within


def test_max_batch_size_caps_growth() -> None:
    assert BatchGrowth(max_batch_size=64).schedule(16, SIZES, 5) == [16, 32, 64, 64, 64]


@pytest.mark.parametrize("fields", [{"every_epochs": 0}, {"factor": 1.0}, {"max_batch_size": 0}])
def test_nonsense_schedules_are_refused(fields: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="must be"):
        BatchGrowth(**fields)  # type: ignore[arg-type]
