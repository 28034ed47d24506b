"""Rank 0's calls to the service, each an idempotent event (bso_client.service_calls)."""

from __future__ import annotations

from typing import Any, cast

import pytest

from bso.core.vocabulary import StopReason, TrialStatus
from bso.errors import ServiceUnavailable
from bso_client.errors import TrainFailError
from bso_client.service_calls import BsoServiceLike, JobCalls
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


class ReportRecorder:
    """A service that records each epoch report (event id and fields), failing while down."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, dict[str, Any]]] = []
        self.down = False

    def report_epoch(self, job_id: str, trial_number: int, *, event_id: str, **fields: Any) -> str:
        self.sent.append((event_id, {"job_id": job_id, "trial": trial_number, **fields}))
        if self.down:
            raise ServiceUnavailable("bso service at test: no reply (test)")
        return "decision"


def test_the_report_whose_reply_was_lost_is_kept_as_the_same_event() -> None:
    """What a detached run going back sends again if its trial ended meanwhile: the
    lost report's own event id and body, so the service answers with its first reply."""
    service = ReportRecorder()
    calls = JobCalls(cast(BsoServiceLike, service), lease_s=None, reprobe_memory=False)
    service.down = True
    with pytest.raises(ServiceUnavailable):
        calls.report_epoch("job", 1, epoch=2, time_s=2.0, energy_j=4.0, metric=0.3)
    lost = calls.forget_unanswered()
    assert lost is not None
    service.down = False
    assert lost() == "decision"
    assert service.sent[1] == service.sent[0]
    calls.report_epoch("job", 1, epoch=2, time_s=2.0, energy_j=4.0, metric=0.3)
    assert service.sent[2][0] != service.sent[0][0]  # forgotten: a new event from now on
    assert calls.forget_unanswered() is None  # the last report was answered
