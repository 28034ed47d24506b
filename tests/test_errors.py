"""Typed errors survive the wire: a code in an error reply rebuilds the same class."""

from __future__ import annotations

import inspect

import pytest

import bso.errors as errors_module
from bso.errors import (
    ERROR_TYPES,
    BsoError,
    ConfigMismatch,
    EventIdConflict,
    Forbidden,
    InvalidEvent,
    InvalidSpec,
    NoFeasibleBatchSize,
    OutOfOrder,
    PoisonEvent,
    RateLimited,
    ServiceUnavailable,
    TrialNotResumable,
    Unauthorized,
    UnknownJob,
    UnknownTrial,
    error_from_code,
)

ALL_ERRORS: list[type[BsoError]] = [
    BsoError,
    InvalidSpec,
    InvalidEvent,
    UnknownJob,
    UnknownTrial,
    ConfigMismatch,
    OutOfOrder,
    NoFeasibleBatchSize,
    TrialNotResumable,
    ServiceUnavailable,
    RateLimited,
    PoisonEvent,
    Unauthorized,
    Forbidden,
    EventIdConflict,
]


@pytest.mark.parametrize("cls", ALL_ERRORS, ids=lambda c: c.__name__)
def test_every_code_maps_back_to_its_class(cls: type[BsoError]) -> None:
    rebuilt = error_from_code(cls.code, "something went wrong")
    assert type(rebuilt) is cls
    assert rebuilt.message == "something went wrong"
    assert str(rebuilt) == "something went wrong"


def test_every_error_class_of_the_module_is_registered() -> None:
    defined = {
        obj
        for _, obj in inspect.getmembers(errors_module, inspect.isclass)
        if issubclass(obj, BsoError)
    }
    assert defined == set(ERROR_TYPES.values())
    assert defined == set(ALL_ERRORS)


def test_codes_are_unique_and_stable() -> None:
    codes = [cls.code for cls in ALL_ERRORS]
    assert len(set(codes)) == len(codes)
    # Codes cross the wire: renaming one breaks every deployed client.
    assert UnknownJob.code == "unknown_job"
    assert ConfigMismatch.code == "config_mismatch"
    assert NoFeasibleBatchSize.code == "no_feasible_batch_size"
    assert OutOfOrder.code == "out_of_order"
    assert TrialNotResumable.code == "trial_not_resumable"


@pytest.mark.parametrize("code", ["", "no_such_code", "UNKNOWN_JOB", "unknown-job"])
def test_unknown_code_gives_the_base_error(code: str) -> None:
    rebuilt = error_from_code(code, "from a newer server")
    assert type(rebuilt) is BsoError
    assert rebuilt.message == "from a newer server"


@pytest.mark.parametrize("cls", ALL_ERRORS[1:], ids=lambda c: c.__name__)
def test_every_error_is_caught_as_bso_error(cls: type[BsoError]) -> None:
    with pytest.raises(BsoError, match="boom"):
        raise error_from_code(cls.code, "boom")
