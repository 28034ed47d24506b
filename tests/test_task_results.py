"""What a task returns for Flower: the reply's kind and the ids an operator searches for."""

from __future__ import annotations

from bso.core.vocabulary import StopReason, TrialPhase
from bso.wire.events import EpochDecision, ErrorReply, JobDeleted, TrialAssigned
from bso_workers.task_results import reply_summary


def test_a_new_trial_reads_as_its_job_trial_and_size() -> None:
    reply = TrialAssigned(
        event_id="e1", job_id="mnist", trial_number=3, batch_size=64, phase=TrialPhase.EXPLORATION
    )
    assert reply_summary(reply) == "trial job=mnist trial=3 bs=64"


def test_a_stop_names_its_reason() -> None:
    reply = EpochDecision(
        event_id="e2",
        job_id="mnist",
        trial_number=3,
        epoch=4,
        stop=True,
        converged=False,
        reason=StopReason.COST_BOUND,
        cost=1.5,
        message="",
    )
    assert reply_summary(reply) == (
        "epoch_decision job=mnist trial=3 epoch=4 stop=True converged=False reason=cost_bound"
    )


def test_an_error_names_the_events_job_and_its_code() -> None:
    reply = ErrorReply(event_id="e3", code="unknown_job", message="job 'x' is not registered")
    assert reply_summary(reply, "x") == "error job=x code=unknown_job"


def test_the_senders_tenant_tells_two_teams_jobs_of_one_id_apart() -> None:
    reply = TrialAssigned(
        event_id="e1", job_id="nightly", trial_number=1, batch_size=64, phase=TrialPhase.EXPLORATION
    )
    assert reply_summary(reply, tenant="team-a") == "trial job=nightly tenant=team-a trial=1 bs=64"


def test_a_delete_says_whether_there_was_a_job() -> None:
    """A delete is idempotent: deleting a job that is not there is answered, not refused,
    and the line says there was none."""
    reply = JobDeleted(event_id="e4", job_id="gone", existed=False)
    assert reply_summary(reply, tenant="team-a") == "deleted job=gone tenant=team-a existed=False"
