"""Versioned events (caller -> service) and replies (service -> caller).

Every event carries an ``event_id``: the service records the reply it gave to
each id, so a retried or redelivered event changes state once and gets the
same reply again.  The models are plain JSON on the wire (no pickle).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    TypeAdapter,
    model_serializer,
)

from bso.core.vocabulary import StopReason, TrialPhase, TrialStatus
from bso.ids import EVENT_ID_PATTERN, JOB_ID_RULE, is_job_id
from bso.spec import (
    MAX_BATCH_SIZE,
    MAX_BATCH_SIZES,
    MAX_ENERGY_J,
    MAX_METRIC,
    MAX_SQL_INT,
    MAX_TIME_S,
    BatchPlan,
    Hardware,
    JobSpec,
)
from bso.wire.micro_batch_timings import MicroBatchTimings, one_run

SCHEMA_VERSION: Literal[1] = 1

EventId = Annotated[str, Field(pattern=EVENT_ID_PATTERN)]
"""1-128 letters, digits, ``.``, ``_``, ``:`` or ``-`` (:data:`bso.ids.EVENT_ID_PATTERN`)."""


def new_event_id() -> str:
    """A fresh random event id."""
    return uuid.uuid4().hex


EndReason = Literal[
    StopReason.ABANDONED, StopReason.DIVERGED, StopReason.OUT_OF_MEMORY, StopReason.INTERRUPTED
]
"""Why a caller ends a trial that bso did not stop (:class:`EndTrial`)."""

MIN_LEASE_S = 10.0
MAX_LEASE_S = 7 * 24 * 3600.0


class _Event(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    version: Literal[1] = SCHEMA_VERSION
    event_id: EventId = Field(default_factory=new_event_id)


def _check_job_id(value: str) -> str:
    if not is_job_id(value):
        raise ValueError(JOB_ID_RULE)
    return value


JobId = Annotated[str, AfterValidator(_check_job_id)]
"""The spec's job id rule (:data:`bso.ids.JOB_ID_PATTERN`): an event can only name a
job that could have been registered, and never carries control characters."""

TrialNumber = Annotated[int, Field(ge=1, le=MAX_SQL_INT)]
"""1 to 2^31 - 1: the store keeps trial numbers in a 32-bit column."""


class _OmitsAbsentAdditions(BaseModel):
    """A model whose fields added after version 1 shipped (:attr:`_ADDITIONS`) are left
    out of its JSON when absent (None or empty), so that what it sends stays what an
    earlier bso sent and reads: an earlier peer's model (``extra="forbid"``) refuses
    an unknown key, and an event stored before the upgrade keeps its body hash
    (:func:`bso.service.event_digest`) when it is retried after it."""

    _ADDITIONS: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _omit_absent_additions(self, handler: SerializerFunctionWrapHandler) -> Any:
        data = handler(self)
        if isinstance(data, dict):
            for name in self._ADDITIONS:
                if data.get(name, ...) in (None, [], ()):
                    del data[name]
        return data


class RegisterJob(_Event):
    kind: Literal["register"] = "register"
    spec: JobSpec
    plan_proposed: bool = False
    """The spec's batch plan came from a memory probe, not from the user: where the
    lane already has a plan, the job keeps it and the reply says which (a probe on
    another machine of the same GPU model finds a maximum a few samples off, which
    is no reason to refuse it).  False: a different plan is a ConfigMismatch."""


class NextTrial(_Event):
    kind: Literal["next_trial"] = "next_trial"
    job_id: JobId
    hardware: Hardware | None = None
    """Hardware of this recurrence; the registered spec's hardware when omitted."""
    lease_s: Annotated[float, Field(ge=MIN_LEASE_S, le=MAX_LEASE_S)] | None = None
    """The caller promises an event (a heartbeat, a report) at least this often:
    a trial silent for longer is ended as interrupted by the sweep.  None: the
    service's ``heartbeat_timeout_s`` (hours, for callers that send no heartbeats)."""
    reprobe_memory: bool = False
    """The caller re-probed what fits in memory on this hardware: forget the
    out-of-memory limits its earlier trials set (:mod:`bso.core.outcomes`)."""


class DetachedEpoch(BaseModel):
    """One epoch of a run that trained while the service was unreachable: the
    figures an :class:`EpochReport` would have carried (cumulative time and energy)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    epoch: Annotated[int, Field(ge=1, le=MAX_SQL_INT)]
    time_s: Annotated[float, Field(ge=0, le=MAX_TIME_S, allow_inf_nan=False)]
    energy_j: Annotated[float, Field(ge=0, le=MAX_ENERGY_J, allow_inf_nan=False)]
    metric: Annotated[float, Field(ge=-MAX_METRIC, le=MAX_METRIC, allow_inf_nan=False)]
    batch_size: Annotated[int, Field(ge=1, le=MAX_BATCH_SIZE)] | None = None
    """What the epoch ran at, when online growth changed it; None: the run's own size."""


class EpochReport(_Event, _OmitsAbsentAdditions):
    _ADDITIONS = ("micro_batches", "trained_to")
    kind: Literal["epoch"] = "epoch"
    job_id: JobId
    trial_number: TrialNumber
    epoch: Annotated[int, Field(ge=1, le=MAX_SQL_INT)]
    """1-based index of the epoch that just finished (at most 2^31 - 1, a 32-bit column)."""
    time_s: Annotated[float, Field(ge=0, le=MAX_TIME_S, allow_inf_nan=False)]
    """Cumulative training time of the trial so far, in seconds: 0 to
    :data:`bso.spec.MAX_TIME_S` (1e9)."""
    energy_j: Annotated[float, Field(ge=0, le=MAX_ENERGY_J, allow_inf_nan=False)]
    """Cumulative energy of the trial so far (all GPUs of the job), in joules: 0 to
    :data:`bso.spec.MAX_ENERGY_J` (1e15)."""
    metric: Annotated[float, Field(ge=-MAX_METRIC, le=MAX_METRIC, allow_inf_nan=False)]
    """Finite, absolute value at most :data:`bso.spec.MAX_METRIC` (1e15)."""
    batch_size: Annotated[int, Field(ge=1, le=MAX_BATCH_SIZE)] | None = None
    """The batch size this epoch ran at, when online growth changed it (one of the
    lane's sizes, never below the trial's); None: the trial's own size."""
    micro_batches: Annotated[MicroBatchTimings | None, AfterValidator(one_run)] = None
    """The micro-batch exploration this run made at its start (the trial's batch
    size), sent with the first report after it; kept once per trial.  Each
    micro-batch must divide the batch per device."""
    trained_to: DetachedEpoch | None = None
    """A journaled epoch sent when the run is back from an outage
    (``bso_client.reattachment``): the run trained on without bso up to this
    epoch, at least as far as this report's.  If bso stops the trial at this
    report, the trial ends at ``trained_to`` instead, charged what the run spent,
    since bso could not stop it sooner."""


class EndTrial(_Event):
    kind: Literal["end"] = "end"
    job_id: JobId
    trial_number: TrialNumber
    reason: EndReason = StopReason.ABANDONED
    """Why the caller ends a trial bso has not stopped; each has its own effect on
    learning (:mod:`bso.core.outcomes`).  Ignored when the trial already ended."""
    batch_size: Annotated[int, Field(ge=1, le=MAX_BATCH_SIZE)] | None = None
    """The batch size running when it ended, when online growth changed it: an
    out-of-memory end is charged to that size (as :attr:`EpochReport.batch_size`)."""


class Heartbeat(_Event):
    """The caller's training is alive: extends the trial's lease.

    Not recorded as a reply (a long run sends thousands), and safe to repeat:
    a duplicate only moves the trial's last-seen time forward.
    """

    kind: Literal["heartbeat"] = "heartbeat"
    job_id: JobId
    trial_number: TrialNumber


class DeleteJob(_Event):
    kind: Literal["delete"] = "delete"
    job_id: JobId


class ResetJob(_Event):
    """Forget a job's finished trials (``bso jobs reset``) but keep its spec and lanes.

    Trial numbers go on from where they were, so event ids already answered keep
    their replies.  A trial still running is kept: its run goes on, and how it
    ends counts as usual (bso never ends a user's run)."""

    kind: Literal["reset"] = "reset"
    job_id: JobId


def _check_lane_key(value: str) -> str:
    if not value.isprintable():
        raise ValueError("must be printable text (a hardware key such as 'NVIDIA A100 x8')")
    return value


LaneKey = Annotated[str, Field(min_length=1, max_length=160), AfterValidator(_check_lane_key)]
"""A hardware lane's key, as ``bso status`` shows it (:attr:`bso.spec.Hardware.key`)."""


class SetLaneSizes(_Event):
    """Give one hardware lane a new list of batch sizes (``bso jobs set-sizes``).

    Trials at sizes still in the list keep counting; trials at sizes left out no
    longer take part in decisions (``bso status`` still shows them).  The lane's
    micro-batch size and devices stay; the bandit's random state goes on."""

    kind: Literal["set_sizes"] = "set_sizes"
    job_id: JobId
    lane: LaneKey
    batch_sizes: Annotated[
        list[Annotated[int, Field(ge=1, le=MAX_BATCH_SIZE)]],
        Field(min_length=1, max_length=MAX_BATCH_SIZES),
    ]
    default_batch_size: Annotated[int, Field(ge=1, le=MAX_BATCH_SIZE)] | None = None
    """None: the lane's default if it is still listed, else the listed size nearest it."""


MAX_DETACHED_EPOCHS = 100_000
"""Epochs a detached run may carry: a job's largest ``max_epochs``."""


class DeliverDetachedRun(_Event):
    """A run that trained detached (the service was unreachable), delivered afterwards
    from the client's journal (:mod:`bso_client.detached_journal`).

    Its ``event_id`` is the journal's id, so a journal delivered twice (a retry, two
    runs of the job on one machine) is applied once.  bso could not stop the run, so
    its cost is what it really cost, up to the epoch that reached the target.
    """

    kind: Literal["detached_run"] = "detached_run"
    job_id: JobId
    hardware: Hardware
    batch_size: Annotated[int, Field(ge=1, le=MAX_BATCH_SIZE)]
    trial_number: TrialNumber | None = None
    """The trial the service assigned before the outage; None: the run never got one
    (the service was unreachable at its start)."""
    epochs: Annotated[list[DetachedEpoch], Field(max_length=MAX_DETACHED_EPOCHS)] = []
    end_reason: EndReason = StopReason.ABANDONED
    """Why the run ended, when its epochs neither reached the target nor ``max_epochs``."""


class TrialStanding(BaseModel):
    """Where a trial stands: its epochs reported and their cumulative time."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    epochs: Annotated[int, Field(ge=0, le=MAX_SQL_INT)]
    time_s: Annotated[float, Field(ge=0, le=MAX_TIME_S, allow_inf_nan=False)]


class ResumeTrial(_Event, _OmitsAbsentAdditions):
    """Reopen a trial for a run resumed from a checkpoint (:mod:`bso.resumes`): the
    trial goes on from the checkpoint's epoch and cumulative figures; epochs run after
    the checkpoint by the killed process are lost work.  Replied with TrialAssigned.

    A run going back to the service after an outage (``bso_client.reattachment``)
    sends it too, naming in :attr:`standing` where it left its trial."""

    _ADDITIONS = ("standing",)

    kind: Literal["resume"] = "resume"
    job_id: JobId
    trial_number: TrialNumber
    hardware_key: LaneKey
    batch_size: Annotated[int, Field(ge=1, le=MAX_BATCH_SIZE)]
    epochs: Annotated[int, Field(ge=0, le=MAX_SQL_INT)]
    """Epochs reported up to the checkpoint."""
    time_s: Annotated[float, Field(ge=0, le=MAX_TIME_S, allow_inf_nan=False)] = 0.0
    energy_j: Annotated[float, Field(ge=0, le=MAX_ENERGY_J, allow_inf_nan=False)] = 0.0
    lease_s: Annotated[float, Field(ge=MIN_LEASE_S, le=MAX_LEASE_S)] | None = None
    standing: Annotated[tuple[TrialStanding, ...], Field(max_length=2)] = ()
    """Where the trial may stand, for a run that never stopped: the epoch the service
    acknowledged last, and the next, whose reply an outage may have lost.  A trial
    that stands elsewhere was resumed by another process meanwhile, and is not taken
    from it.  Empty: the caller is a run resumed from a checkpoint, which takes the
    trial over from the process that was killed."""


Event = Annotated[
    RegisterJob
    | NextTrial
    | EpochReport
    | EndTrial
    | Heartbeat
    | DeleteJob
    | DeliverDetachedRun
    | ResetJob
    | SetLaneSizes
    | ResumeTrial,
    Field(discriminator="kind"),
]


def _require_event_id(value: object) -> object:
    """On the wire an event must name itself: the models generate a missing
    ``event_id`` for in-process callers, but a received event without one could
    be neither deduplicated nor answered (its reply key is derived from the id
    the caller sent, :func:`bso.wire.keys.reply_key_for`)."""
    if isinstance(value, Mapping) and "event_id" not in value:
        raise ValueError("event_id is missing: every event sent to bso carries its event_id")
    return value


EVENT_ADAPTER: TypeAdapter[Event] = TypeAdapter(
    Annotated[Event, BeforeValidator(_require_event_id)]
)
"""Validates a received event (JSON object or text): a model of the ten kinds,
``event_id`` required."""


class _Reply(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    version: Literal[1] = SCHEMA_VERSION
    event_id: str


class JobRegistered(_Reply):
    kind: Literal["registered"] = "registered"
    job_id: str
    created: bool
    """False when the job already existed with the same configuration."""
    plan: BatchPlan | None = None
    """The batch plan of the registering hardware's lane, when it is not the one the
    spec proposed (:attr:`RegisterJob.plan_proposed`): run with this one."""


class TrialAssigned(_Reply, _OmitsAbsentAdditions):
    _ADDITIONS = ("micro_batches",)
    kind: Literal["trial"] = "trial"
    job_id: str
    trial_number: int
    batch_size: int
    phase: TrialPhase
    notice: str | None = None
    """Said plainly when the lane's last runs were ended by the script itself (a bug
    in the script, not the size: :func:`bso.core.outcomes.script_error_notice`); the
    client logs it as a warning.  None otherwise, and from older services."""
    micro_batches: MicroBatchTimings | None = None
    """What earlier runs of this lane timed at this batch size (per micro-batch, all
    runs together): where this run's micro-batch exploration starts.  None: nothing."""


class EpochDecision(_Reply):
    kind: Literal["epoch_decision"] = "epoch_decision"
    job_id: str
    trial_number: int
    epoch: int
    stop: bool
    converged: bool
    reason: StopReason | None
    cost: float
    """Cost of the trial so far (joules)."""
    message: str = ""


class TrialEnded(_Reply):
    kind: Literal["trial_ended"] = "trial_ended"
    job_id: str
    trial_number: int
    status: TrialStatus
    reason: StopReason | None


class HeartbeatAck(_Reply):
    """The trial's state when the heartbeat arrived: a caller whose trial was ended
    (its lease ran out during a partition, say) learns it here."""

    kind: Literal["heartbeat_ack"] = "heartbeat_ack"
    job_id: str
    trial_number: int
    status: TrialStatus
    reason: StopReason | None


class JobDeleted(_Reply):
    kind: Literal["deleted"] = "deleted"
    job_id: str
    existed: bool


class DetachedRunDelivered(_Reply):
    """What the service made of a detached run: the trial it is now, and how it ended."""

    kind: Literal["detached_run_delivered"] = "detached_run_delivered"
    job_id: str
    trial_number: int
    status: TrialStatus
    reason: StopReason | None
    rewritten: bool
    """True: the run's own trial (assigned before the outage) now holds its epochs;
    False: a new trial was added, or the service had already ended the run's trial
    on its own (kept as it was)."""


class JobReset(_Reply):
    kind: Literal["job_reset"] = "job_reset"
    job_id: str
    forgotten: int
    """Finished trials forgotten."""
    running: int
    """Trials still running, kept (their runs go on and count when they end)."""


class LaneSizesSet(_Reply):
    kind: Literal["lane_sizes_set"] = "lane_sizes_set"
    job_id: str
    lane: str
    plan: BatchPlan
    """The lane's plan now."""
    kept_trials: int
    """The lane's trials at sizes still listed: they keep counting."""
    set_aside_trials: int
    """The lane's trials at sizes no longer listed: shown, no longer decided on."""


class ErrorReply(_Reply):
    """A typed error: ``code`` names a :mod:`bso.errors` class."""

    kind: Literal["error"] = "error"
    code: str
    message: str


Reply = Annotated[
    JobRegistered
    | TrialAssigned
    | EpochDecision
    | TrialEnded
    | HeartbeatAck
    | JobDeleted
    | DetachedRunDelivered
    | JobReset
    | LaneSizesSet
    | ErrorReply,
    Field(discriminator="kind"),
]
REPLY_ADAPTER: TypeAdapter[Reply] = TypeAdapter(Reply)
