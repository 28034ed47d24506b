"""Rank 0's calls to the service, each an idempotent event (bso_client.service_calls)."""

from __future__ import annotations

import pytest

from bso.core.vocabulary import StopReason, TrialStatus
from bso.errors import ServiceUnavailable
from bso_client.errors import TrainFailError
from tests.test_optimizer import RecordingService, make


def test_a_retried_next_trial_does_not_start_a_second_trial() -> None:
    service = RecordingService(fail_after={2})
    bso = make(service, on_unavailable="raise")
    with pytest.raises(ServiceUnavailable):
        bso.get_batch_size()
    assert bso.get_batch_size() == 16
    assert bso.trial_number == 1
    (_, first, _), (_, second, _) = service.calls[1:3]
    assert first == second
    bso.close()


@pytest.mark.parametrize("metric", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_metric_ends_the_trial_as_diverged(metric: float) -> None:
    service = RecordingService()
    bso = make(service)
    bso.get_batch_size()
    bso.on_train_begin()
    assert not bso.on_evaluate(0.5).stop
    with pytest.raises(TrainFailError, match="diverged") as raised:
        bso.on_evaluate(metric)
    assert raised.value.reason is StopReason.DIVERGED
    assert bso.training_finished
    assert service.methods() == ["register", "next_trial", "report_epoch", "end_trial"]
    trial = service.trial(1)
    assert (trial.status, trial.stop_reason, trial.epochs) == (
        TrialStatus.FAILED,
        StopReason.DIVERGED,
        1,
    )
    bso.close()
    assert service.methods().count("end_trial") == 1
