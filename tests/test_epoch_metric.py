"""What ``on_evaluate`` takes as a metric, and the warning when a run's first epoch
already meets the target (:mod:`bso_client.epoch_metric`)."""

from __future__ import annotations

import logging
import pickle
from decimal import Decimal
from typing import Any

import numpy as np
import pytest

from bso.spec import JobSpec
from bso_client import MetricTypeError
from bso_client.epoch_metric import metric_value
from tests.test_optimizer import SPEC, RecordingService, make

EXPECTS = (
    "on_evaluate expects a number (int, float, or a numpy array or torch tensor of one value), got"
)


def training(service: RecordingService, spec: JobSpec = SPEC) -> Any:
    bso = make(service, spec=spec)
    bso.get_batch_size()
    bso.on_train_begin()
    return bso


@pytest.mark.parametrize(
    ("metric", "got"),
    [
        ({"accuracy": 0.85}, "got dict (pass the one metric"),
        (None, "got None (did the validation function return its value?)"),
        ("0.85", "got str '0.85' (convert it with float()"),
        (True, "got bool"),
        ([0.85], "got list"),
        (np.array([0.8, 0.9]), "got numpy.ndarray of shape (2,)"),
        (np.bool_(True), "got numpy.bool"),
    ],
)
def test_on_evaluate_refuses_what_is_not_one_number_saying_what_came(
    metric: object, got: str
) -> None:
    service = RecordingService()
    bso = training(service)
    with pytest.raises(MetricTypeError) as refused:
        bso.on_evaluate(metric)
    assert str(refused.value).startswith(EXPECTS)
    assert got in str(refused.value)
    assert isinstance(refused.value, TypeError)  # what float(None) raised before
    assert "report_epoch" not in service.methods()
    # Nothing was measured: the same epoch reported again with a number goes through.
    assert bso.on_evaluate(0.5).epoch == 1
    bso.close()


def test_a_metric_type_error_survives_pickling_for_the_other_ranks() -> None:
    with pytest.raises(MetricTypeError) as refused:
        metric_value(None)
    copy = pickle.loads(pickle.dumps(refused.value))
    assert (type(copy), str(copy)) == (MetricTypeError, str(refused.value))


@pytest.mark.parametrize(
    "metric",
    [0.5, 1, np.float32(0.5), np.float64(0.5), np.int64(1), np.array(0.5), Decimal("0.5")],
    ids=repr,
)
def test_on_evaluate_takes_numbers_and_numpy_scalars(metric: object) -> None:
    service = RecordingService()
    bso = training(service)
    bso.on_evaluate(metric)  # type: ignore[arg-type]
    (report,) = [kw for m, _, kw in service.calls if m == "report_epoch"]
    assert report["metric"] == float(metric)  # type: ignore[arg-type]
    assert type(report["metric"]) is float
    bso.close()


def test_on_evaluate_takes_a_torch_tensor_of_one_value_and_refuses_a_vector() -> None:
    """A tensor of one value, 0-d or not, was a number to float() before the check
    and still is; several values are not one metric."""
    torch = pytest.importorskip("torch")
    service = RecordingService()
    bso = training(service)
    with pytest.raises(MetricTypeError, match=r"got torch\.Tensor of shape \(2,\)"):
        bso.on_evaluate(torch.tensor([0.5, 0.6]))
    bso.on_evaluate(torch.tensor(0.5, requires_grad=True) * 1)
    bso.on_evaluate(torch.tensor([0.25]))
    reports = [kw["metric"] for m, _, kw in service.calls if m == "report_epoch"]
    assert reports == [0.5, 0.25]
    bso.close()


LOSS_JOB = SPEC.model_copy(update={"job_id": "tinyl", "target_metric": 0.35})


def test_a_loss_reported_as_higher_is_better_warns_at_the_first_epoch(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The user's report: a validation loss, target 0.35, higher_is_better_metric left
    True: every run 'converged' at epoch 1 without a word."""
    caplog.set_level(logging.INFO, logger="bso_client")
    bso = training(RecordingService(), LOSS_JOB)
    assert bso.on_evaluate(2.3).converged
    bso.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    (line,) = warnings
    assert "job tinyl met its target at its first epoch" in line
    assert "metric 2.3, target_metric 0.35, higher_is_better_metric=True" in line
    assert "set higher_is_better_metric=False" in line
    assert "bso jobs delete tinyl" in line


def test_lower_is_better_suggests_the_other_direction(caplog: pytest.LogCaptureFixture) -> None:
    spec = LOSS_JOB.model_copy(update={"higher_is_better_metric": False, "target_metric": 0.9})
    bso = training(RecordingService(), spec)
    bso.on_evaluate(0.5)
    bso.close()
    (line,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "higher_is_better_metric=False" in line
    assert "set higher_is_better_metric=True" in line


def test_no_warning_when_the_target_takes_epochs(caplog: pytest.LogCaptureFixture) -> None:
    bso = training(RecordingService())
    bso.on_evaluate(0.5)  # below 0.9 at the first epoch
    assert bso.on_evaluate(0.95).converged  # reached at the second: as it should be
    bso.close()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_diverged_first_epoch_is_no_easy_target(caplog: pytest.LogCaptureFixture) -> None:
    bso = training(RecordingService())
    with pytest.raises(Exception, match="diverged"):
        bso.on_evaluate(float("inf"))
    bso.close()
    assert not [r for r in caplog.records if "first epoch" in r.getMessage()]
