"""Check a store against a serial replay of the events it accepted.

Whatever happened on the way (concurrent workers, redeliveries, duplicates,
crashes, restarts), the state of a job must be exactly what applying its
recorded events one by one, in the order the store committed them, gives.
:func:`audit` does that replay through an in-process :class:`BsoService` on a
fresh :class:`MemoryStore` and compares:

* every reply, byte for byte, with the one the store recorded;
* every trial (batch size, phase, status, epochs, time, energy, cost, last
  metric, stop reason, hardware) with the store's;
* every lane's hardware and random state (the bandit's generator);
* the set of trials: none missing, none extra.

The recorded history comes from :func:`bso.storage.history.replies_in_commit_order`
for a SQL store; the events themselves from the caller, who sent them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields

from bso.apikeys import split_job_key
from bso.service import BsoService
from bso.storage.base import JobReader, LaneRecord, Store, TrialRecord
from bso.storage.history import RecordedReply
from bso.storage.memory import MemoryStore
from bso.wire.events import Event

TRIAL_FIELDS = tuple(
    f.name
    for f in fields(TrialRecord)
    if f.name not in {"job_id", "trial_number", "created_at", "updated_at"}
)
"""What a trial is compared on: everything but its wall-clock timestamps."""


@dataclass(frozen=True)
class Difference:
    job_id: str
    what: str
    """``reply``, ``unknown_event``, ``trial``, ``missing_trial``, ``extra_trial``,
    ``lane`` or ``job``."""
    detail: str


@dataclass
class AuditReport:
    jobs: int = 0
    replayed: int = 0
    """Recorded events replayed."""
    trials: int = 0
    """Trials compared."""
    differences: list[Difference] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.differences

    def count(self, what: str) -> int:
        return sum(d.what == what for d in self.differences)


def comparable(trial: TrialRecord) -> tuple[object, ...]:
    return tuple(getattr(trial, name) for name in TRIAL_FIELDS)


def audit(
    recorded: Mapping[str, Sequence[RecordedReply]],
    events: Mapping[str, Event],
    live: Store,
) -> AuditReport:
    """Replay each job's recorded events serially and compare with ``live``.

    ``recorded`` maps jobs' keys (:func:`bso.apikeys.job_key`: each event is replayed
    as its tenant's) to their replies in commit order; ``events`` maps
    event ids to the events that were sent.  A recorded event missing from
    ``events`` cannot be replayed: it is reported (``unknown_event``) and the
    job's later comparisons will likely differ too.
    """
    serial = BsoService(MemoryStore())
    report = AuditReport()
    for job_id, history in sorted(recorded.items()):
        report.jobs += 1
        for entry in history:
            event = events.get(entry.event_id)
            if event is None:
                report.differences.append(
                    Difference(job_id, "unknown_event", f"event {entry.event_id} was not sent")
                )
                continue
            replayed = serial.handle(event, split_job_key(job_id)[0]).model_dump_json()
            report.replayed += 1
            if replayed != entry.reply_json:
                report.differences.append(
                    Difference(
                        job_id,
                        "reply",
                        f"event {entry.event_id}: recorded {entry.reply_json} "
                        f"but a serial replay answers {replayed}",
                    )
                )
        with serial.store.read(job_id) as expected, live.read(job_id) as actual:
            report.trials += _compare_job(job_id, expected, actual, report.differences)
    return report


def _compare_job(
    job_id: str, expected: JobReader, actual: JobReader, differences: list[Difference]
) -> int:
    want_job, have_job = expected.get_job(), actual.get_job()
    if (want_job is None) != (have_job is None) or (
        want_job is not None and have_job is not None and want_job.spec != have_job.spec
    ):
        differences.append(
            Difference(job_id, "job", f"replay has {want_job!r}, the store has {have_job!r}")
        )
    want = {t.trial_number: t for t in expected.trials()}
    have = {t.trial_number: t for t in actual.trials()}
    for number in sorted(want.keys() - have.keys()):
        differences.append(Difference(job_id, "missing_trial", f"trial {number} not in the store"))
    for number in sorted(have.keys() - want.keys()):
        differences.append(Difference(job_id, "extra_trial", f"trial {number} not in the replay"))
    for number in sorted(want.keys() & have.keys()):
        if comparable(want[number]) != comparable(have[number]):
            differences.append(
                Difference(
                    job_id,
                    "trial",
                    f"trial {number}: replay {comparable(want[number])}, "
                    f"store {comparable(have[number])}",
                )
            )
    for key in sorted({t.hardware_key for t in [*want.values(), *have.values()]}):
        want_lane, have_lane = expected.get_lane(key), actual.get_lane(key)
        if _lane(want_lane) != _lane(have_lane):
            differences.append(
                Difference(job_id, "lane", f"lane {key}: replay and store states differ")
            )
    return len(want.keys() & have.keys())


def _lane(lane: LaneRecord | None) -> tuple[object, ...] | None:
    return None if lane is None else (lane.hardware, lane.rng_state)
