"""Typed errors shared by the core, the service, the workers and the client.

Every error carries a stable ``code`` so that it can cross the wire inside an
error reply and be rebuilt as the same exception type on the caller's side.
"""

from __future__ import annotations

from typing import ClassVar


class BsoError(Exception):
    """Base class of every error bso raises on purpose."""

    code: ClassVar[str] = "bso_error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidSpec(BsoError):
    """The job specification is not usable (bad sizes, knobs out of range...)."""

    code = "invalid_spec"


class InvalidEvent(BsoError):
    """An event could not be parsed or is inconsistent with itself."""

    code = "invalid_event"


class UnknownJob(BsoError):
    """The event names a job id that was never registered (or was deleted)."""

    code = "unknown_job"


class UnknownTrial(BsoError):
    """The event names a trial number the job does not have."""

    code = "unknown_trial"


class ConfigMismatch(BsoError):
    """A job id was registered again with a different configuration."""

    code = "config_mismatch"


class OutOfOrder(BsoError):
    """An event arrived that the trial's state does not allow (e.g. after it ended)."""

    code = "out_of_order"


class NoFeasibleBatchSize(BsoError):
    """Every batch size of the job failed: the user must reconfigure the job."""

    code = "no_feasible_batch_size"


class TrialNotResumable(BsoError):
    """A run resumed from a checkpoint asked to reopen a trial that ended for good
    (converged, failed, a script error) or is not the checkpoint's."""

    code = "trial_not_resumable"


class ServiceUnavailable(BsoError):
    """The service could not be reached or did not answer in time."""

    code = "service_unavailable"


class RateLimited(ServiceUnavailable):
    """The tenant's queue is full or its rate is spent: the event was refused at the
    door, not queued, so nothing was or will be applied; send it again after
    :attr:`retry_after_s`.  A :class:`ServiceUnavailable`, so a fail-open run treats it
    as it treats any unavailability: training goes on."""

    code = "rate_limited"

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        """Seconds until the door admits again (None: not known, e.g. a worker's refusal)."""


class PoisonEvent(BsoError):
    """The event's worker died every time it ran it (hard time limit, OOM, crash):
    the service stopped delivering it.  Its worker logs name the event id."""

    code = "poison_event"


class Unauthorized(BsoError):
    """The event carried no API key, a malformed one, or one the service does not
    accept (unknown, wrong secret, revoked).  Nothing was applied."""

    code = "unauthorized"


class Forbidden(BsoError):
    """The API key is valid but its tenant does not own the job the event names.

    Workers from before job ids were per tenant sent it; no job of another tenant
    can be named now (:func:`bso.apikeys.job_key`).  Kept so that a client still
    understands it from such a worker during a rolling upgrade."""

    code = "forbidden"


class EventIdConflict(BsoError):
    """The job already applied an event with this id and a different body: event ids
    name one event, so a retry must resend the same body and a new event needs a new id."""

    code = "event_id_conflict"


ERROR_TYPES: dict[str, type[BsoError]] = {
    cls.code: cls
    for cls in (
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
    )
}


def error_from_code(code: str, message: str) -> BsoError:
    """Rebuild the typed exception named by an error reply's ``code``."""
    return ERROR_TYPES.get(code, BsoError)(message)
