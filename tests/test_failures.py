"""What a failed event's caller and the operator's log are told (bso_workers.failures)."""

from __future__ import annotations

import logging

import pytest
from billiard.exceptions import SoftTimeLimitExceeded
from sqlalchemy.exc import IntegrityError, OperationalError

from bso_workers.failures import CAUSE_LIMIT, cause_of, failure_reply, log_failure

SECRET_ROW = {"w_job_id": "team-a:secret-job", "w_payload": "private"}


def test_the_cause_is_the_drivers_first_line_without_the_statement_or_its_parameters() -> None:
    error = IntegrityError(
        "INSERT INTO jobs VALUES (:w_job_id)", SECRET_ROW, Exception("duplicate key\nDETAIL: x")
    )
    assert cause_of(error) == "Exception: duplicate key"


def test_a_cause_without_text_is_its_class_and_a_long_one_is_cut() -> None:
    assert cause_of(TimeoutError()) == "TimeoutError"
    assert len(cause_of(RuntimeError("x" * 10_000))) == len("RuntimeError: ") + CAUSE_LIMIT


@pytest.mark.parametrize(
    "error",
    [
        OperationalError("SELECT * FROM jobs WHERE id = :w_job_id", SECRET_ROW, Exception("gone")),
        IntegrityError("INSERT INTO jobs", SECRET_ROW, Exception("duplicate key")),
        RuntimeError("team-a:secret-job private"),
    ],
)
def test_the_callers_reply_shows_no_statement_parameter_or_message(error: Exception) -> None:
    message = failure_reply("e1", error).message
    assert "secret-job" not in message
    assert "private" not in message
    assert "jobs" not in message
    assert "gone" not in message
    assert "duplicate" not in message
    assert type(error).__name__ in message
    assert "nothing was applied" in message


def test_only_transient_failures_ask_the_caller_to_send_again() -> None:
    assert failure_reply("e1", OperationalError("s", {}, Exception())).code == "service_unavailable"
    assert failure_reply("e1", SoftTimeLimitExceeded()).code == "service_unavailable"
    assert failure_reply("e1", RuntimeError("bug")).code == "bso_error"


def test_a_bug_keeps_its_traceback_at_error(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("bso.tests.failures")
    with caplog.at_level(logging.DEBUG, log.name):
        try:
            raise RuntimeError("boom")
        except RuntimeError as exc:
            log_failure(log, "event", exc, {"job_id": "j"})
    (record,) = caplog.records
    assert record.levelno == logging.ERROR
    assert record.exc_info is not None
    assert record.getMessage() == "event failed: RuntimeError: boom"


def test_a_transient_failure_is_one_warning_line_and_its_traceback_at_debug(
    caplog: pytest.LogCaptureFixture,
) -> None:
    log = logging.getLogger("bso.tests.failures")
    error = OperationalError("SELECT 1", SECRET_ROW, Exception("server closed the connection"))
    with caplog.at_level(logging.DEBUG, log.name):
        log_failure(log, "status read", error, {"job_id": "j"})
    warning, debug = caplog.records
    assert warning.levelno == logging.WARNING
    assert warning.exc_info is None
    assert "secret-job" not in warning.getMessage()
    assert warning.getMessage().endswith("Exception: server closed the connection")
    assert debug.levelno == logging.DEBUG
    assert debug.exc_info is not None
