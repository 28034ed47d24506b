"""scripts/soak.py's load side: the synthetic jobs, their runners, the random fault
schedule, the driver's ledger and the end-state check (see soak.py's docstring)."""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from soak_service import MAX_EPOCHS, RELAUNCH_S, SIZES, FaultLog, SoakStack

from bso.audit import AuditReport, audit
from bso.errors import BsoError, NoFeasibleBatchSize, OutOfOrder, ServiceUnavailable
from bso.spec import JobSpec
from bso.storage.history import RecordedReply, replies_in_commit_order
from bso.storage.sql import SqlStore
from bso.wire.events import (
    EndTrial,
    EpochDecision,
    EpochReport,
    Event,
    NextTrial,
    RegisterJob,
    TrialAssigned,
)
from bso_client.transport import ServiceClient, SuccessReply

# -- the synthetic world ----------------------------------------------------------------


@dataclass(frozen=True)
class World:
    """One recurring job: its spec and how each batch size trains (pre-drawn)."""

    index: int
    seed: int
    spec: JobSpec
    epochs_needed: dict[int, int | None]
    """Epochs each size needs to reach the target; None: never."""
    seconds_per_epoch: dict[int, float]
    watts: float

    @property
    def job_id(self) -> str:
        assert self.spec.job_id is not None
        return self.spec.job_id

    def report(self, trial: TrialAssigned, epoch: int) -> EpochReport:
        """The report of ``epoch`` of ``trial``: the same figures whenever it is built."""
        rng = random.Random(f"{self.seed}:{self.index}:{trial.trial_number}")
        needed = self.epochs_needed[trial.batch_size]
        if needed is not None:
            needed += rng.choice((0, 0, 0, 1))
        seconds = sum(
            self.seconds_per_epoch[trial.batch_size] * rng.uniform(0.9, 1.1) for _ in range(epoch)
        )
        reached = needed is not None and epoch >= needed
        return EpochReport(
            job_id=self.job_id,
            trial_number=trial.trial_number,
            epoch=epoch,
            time_s=round(seconds, 3),
            energy_j=round(seconds * self.watts, 3),
            metric=0.95 if reached else round(0.3 + 0.5 * epoch / (MAX_EPOCHS + 2), 4),
        )


def make_world(index: int, seed: int) -> World:
    rng = random.Random(f"world:{seed}:{index}")
    needed: dict[int, int | None] = {
        16: rng.randint(3, 6),
        32: rng.randint(3, 5),
        64: rng.randint(3, 6),
        128: None if rng.random() < 0.3 else rng.randint(3, 7),
    }
    base = rng.uniform(20, 60)
    spec = JobSpec(
        job_id=f"soak-{seed}-{index:04d}",
        batch_sizes=list(SIZES),
        default_batch_size=32,
        target_metric=0.9,
        max_epochs=MAX_EPOCHS,
        mab_seed=rng.randrange(2**31),
        policy="bso" if index % 2 == 0 else "zeus",
    )
    return World(
        index=index,
        seed=seed,
        spec=spec,
        epochs_needed=needed,
        seconds_per_epoch={b: base * (32 / b) ** 0.7 for b in SIZES},
        watts=rng.uniform(150, 300),
    )


# -- the driver's ledger ----------------------------------------------------------------


@dataclass
class Outcome:
    event: Event
    replies: list[str] = field(default_factory=list)
    """Success replies received (JSON), one per call that got one."""
    errors: list[str] = field(default_factory=list)
    """Typed error codes received."""
    gave_up: list[str] = field(default_factory=list)
    """Calls that raised something other than a typed error."""
    last: str = "pending"
    """``accepted``, ``rejected``, ``gave_up`` or ``pending``: the latest answer."""


class Ledger:
    """Every event the runners sent and every answer they got; thread-safe."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.outcomes: dict[str, Outcome] = {}
        self.epochs_accepted = 0
        self.problems: list[str] = []
        """Lines describing rule breaks seen while driving (they fail the run)."""
        self.double_counted = 0
        self.unexpected_refusals = 0

    def sending(self, event: Event) -> None:
        with self.lock:
            self.outcomes.setdefault(event.event_id, Outcome(event))

    def accepted(self, event: Event, reply_json: str) -> None:
        with self.lock:
            outcome = self.outcomes[event.event_id]
            if outcome.last != "accepted" and isinstance(event, EpochReport):
                self.epochs_accepted += 1
            outcome.replies.append(reply_json)
            outcome.last = "accepted"

    def refused(self, event: Event, code: str, expected: bool) -> None:
        with self.lock:
            outcome = self.outcomes[event.event_id]
            outcome.errors.append(code)
            if outcome.last != "accepted":
                outcome.last = "rejected"
            if not expected:
                self.unexpected_refusals += 1
                self.problems.append(f"unexpected {code} for {event.kind} {event.event_id}")

    def gave_up(self, event: Event, error: BaseException) -> None:
        with self.lock:
            outcome = self.outcomes[event.event_id]
            outcome.gave_up.append(f"{type(error).__name__}: {error}")
            if outcome.last == "pending":
                outcome.last = "gave_up"

    def problem(self, line: str, double: bool = False) -> None:
        with self.lock:
            self.problems.append(line)
            self.double_counted += double

    def last(self, event: Event) -> str:
        with self.lock:
            return self.outcomes[event.event_id].last

    def events(self) -> dict[str, Event]:
        with self.lock:
            return {i: o.event for i, o in self.outcomes.items()}


# -- the runners ------------------------------------------------------------------------


@dataclass
class Load:
    """What the runners share."""

    ledger: Ledger
    faults: FaultLog
    args: argparse.Namespace
    enough: threading.Event = field(default_factory=threading.Event)
    """Set once enough epochs were accepted: finish the recurrence, then stop."""
    cut: threading.Event = field(default_factory=threading.Event)
    """Set at the duration limit: stop after the current call."""


Refusals = tuple[type[BsoError], ...]
REORDER_REFUSALS: Refusals = (OutOfOrder,)
"""What an epoch report sent before its predecessor must get: nothing else is right."""


class Runner(threading.Thread):
    """One training process of one job, running recurrence after recurrence."""

    def __init__(self, world: World, number: int, load: Load, client: ServiceClient) -> None:
        super().__init__(name=f"{world.job_id}/{number}", daemon=True)
        self.world = world
        self.load = load
        self.client = client
        self.rng = random.Random(f"runner:{world.seed}:{world.index}:{number}")
        self.crashed: BaseException | None = None
        self.gave_up = False
        """A call of the current recurrence gave up: the rest of it is skipped."""

    def run(self) -> None:
        try:
            self._run()
        except BaseException as exc:
            self.crashed = exc
            self.load.ledger.problem(f"runner {self.name} crashed: {exc!r}")

    def _run(self) -> None:
        if self.send(RegisterJob(spec=self.world.spec)) is None:
            return
        while not (self.load.enough.is_set() or self.load.cut.is_set()):
            if self.gave_up:
                # A training job whose call gave up has crashed; it is launched again.
                self.gave_up = False
                time.sleep(RELAUNCH_S)
            event = NextTrial(job_id=self.world.job_id)
            trial = self.send(event, refusal_expected=(NoFeasibleBatchSize,))
            if not isinstance(trial, TrialAssigned):
                if self.load.ledger.last(event) == "rejected":
                    return  # every size kept failing: the job is done (a legitimate answer)
                continue
            self.train(trial)
            if self.load.cut.is_set():
                return
            if self.gave_up:
                continue
            self.send(EndTrial(job_id=self.world.job_id, trial_number=trial.trial_number))

    def train(self, trial: TrialAssigned) -> None:
        args = self.load.args
        abandon_at = (
            self.rng.randint(1, MAX_EPOCHS) if self.rng.random() < args.abandon_rate else None
        )
        epoch = 1
        while not self.load.cut.is_set() and epoch != abandon_at:
            report = self.world.report(trial, epoch)
            if self.rng.random() < args.reorder_rate:
                early = self.world.report(trial, epoch + 1)
                self.load.faults.log(
                    "reorder",
                    f"job={self.world.job_id} trial={trial.trial_number} epoch {epoch + 1} "
                    f"({early.event_id}) sent before epoch {epoch}",
                )
                if self.send(early, refusal_expected=REORDER_REFUSALS, allow_duplicate=False):
                    self.load.ledger.problem(
                        f"reordered epoch {epoch + 1} of {self.world.job_id} trial "
                        f"{trial.trial_number} was accepted before epoch {epoch}",
                        double=True,
                    )
                    return
            decision = self.send(report)
            if not isinstance(decision, EpochDecision) or decision.stop or self.gave_up:
                return
            epoch += 1

    def send(
        self, event: Event, *, refusal_expected: Refusals = (), allow_duplicate: bool = True
    ) -> SuccessReply | None:
        """Send ``event`` (now and then twice at once); None if refused or given up."""
        if allow_duplicate and self.rng.random() < self.load.args.duplicate_rate:
            return self._send_twice(event, refusal_expected)
        return self._call(event, refusal_expected)

    def _call(self, event: Event, refusal_expected: Refusals = ()) -> SuccessReply | None:
        return self._attempt(event, refusal_expected)[0]

    def _attempt(
        self, event: Event, refusal_expected: Refusals = ()
    ) -> tuple[SuccessReply | None, bool]:
        """The reply (None: refused or given up) and whether the caller gave up waiting."""
        ledger = self.load.ledger
        ledger.sending(event)
        try:
            reply = self.client.request(event)
        except ServiceUnavailable as exc:
            ledger.gave_up(event, exc)
            self.gave_up = True
            return None, True
        except BsoError as exc:
            ledger.refused(event, exc.code, expected=isinstance(exc, refusal_expected))
            return None, False
        except Exception as exc:
            ledger.gave_up(event, exc)
            self.gave_up = True
            return None, True
        ledger.accepted(event, reply.model_dump_json())
        return reply, False

    def _send_twice(self, event: Event, refusal_expected: Refusals) -> SuccessReply | None:
        at_once = self.rng.random() < 0.5
        how = "twice at once" if at_once else "again after its reply"
        self.load.faults.log(
            "duplicate", f"job={self.world.job_id} {event.kind} {event.event_id} sent {how}"
        )
        if at_once:
            other: list[tuple[SuccessReply | None, bool]] = []
            twin = threading.Thread(
                target=lambda: other.append(self._attempt(event, refusal_expected)), daemon=True
            )
            twin.start()
            mine, mine_gave_up = self._attempt(event, refusal_expected)
            twin.join()
            theirs, theirs_gave_up = other[0] if other else (None, True)
        else:
            mine, mine_gave_up = self._attempt(event, refusal_expected)
            theirs, theirs_gave_up = self._attempt(event, refusal_expected)
        if mine is not None and theirs is not None:
            if mine.model_dump_json() != theirs.model_dump_json():
                self.load.ledger.problem(
                    f"duplicate {event.event_id} answered differently: "
                    f"{mine.model_dump_json()} vs {theirs.model_dump_json()}",
                    double=True,
                )
        elif (mine is None) != (theirs is None) and not (mine_gave_up or theirs_gave_up):
            # A copy whose caller gave up waiting (two copies at once share one reply
            # key, and faults can outlast the retries) saw no answer, not another one:
            # the ledger reconciles it with the store like any give-up.
            self.load.ledger.problem(
                f"duplicate {event.event_id}: one copy accepted, the other not", double=True
            )
        return mine if mine is not None else theirs


# -- the fault injector -----------------------------------------------------------------


class Injector(threading.Thread):
    """Process-level faults at jittered random intervals while the load runs."""

    def __init__(self, stack: SoakStack, faults: FaultLog, args: argparse.Namespace) -> None:
        super().__init__(name="injector", daemon=True)
        self.stack = stack
        self.faults = faults
        self.args = args
        self.rng = random.Random(f"faults:{args.seed}")
        self.done = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        means = {
            "worker_kill": self.args.worker_kill_every,
            "redis_restart": self.args.redis_restart_every,
            "db_drop": self.args.db_drop_every,
            "garbage": self.args.garbage_every,
        }
        now = time.monotonic()
        due = {k: now + self._interval(m) for k, m in means.items() if m > 0}
        try:
            while due:
                kind = min(due, key=due.__getitem__)
                if self.done.wait(max(0.0, due[kind] - time.monotonic())):
                    return
                self.inject(kind)
                due[kind] = time.monotonic() + self._interval(means[kind])
        except BaseException as exc:
            self.error = exc
            self.faults.note(f"INJECTOR FAILED: {exc!r}")

    def _interval(self, mean: float) -> float:
        return mean * self.rng.uniform(0.5, 1.5)

    def inject(self, kind: str) -> None:
        if kind == "worker_kill":
            self.stack.kill_worker(self.rng)
        elif kind == "redis_restart":
            self.stack.restart_redis(self.rng, self.args.redis_down)
        elif kind == "db_drop":
            dropped = self.stack.drop_db_connections()
            self.faults.log("db_drop", f"pg_terminate_backend on {dropped} connections")
        elif kind == "garbage":
            count = self.rng.randint(1, self.args.garbage_burst)
            names = self.stack.push_garbage(self.rng, count)
            self.faults.log("garbage", f"LPUSHed {', '.join(names)}", count=len(names))


# -- checking the end state -------------------------------------------------------------


@dataclass
class Verdict:
    sent: int = 0
    accepted: int = 0
    rejected: int = 0
    lost: int = 0
    double_counted: int = 0
    epochs: int = 0
    findings: list[str] = field(default_factory=list)
    replay: AuditReport | None = None
    rejected_codes: Counter[str] = field(default_factory=Counter)


def check(ledger: Ledger, database_url: str, job_ids: Sequence[str]) -> Verdict:
    verdict = Verdict(double_counted=ledger.double_counted)
    outcomes = ledger.outcomes
    recorded = replies_in_commit_order(database_url, job_ids)
    by_event: dict[str, RecordedReply] = {r.event_id: r for rs in recorded.values() for r in rs}

    def lose(line: str, n: int = 1) -> None:
        verdict.lost += n
        verdict.findings.append(f"lost: {line}")

    def double(line: str, n: int = 1) -> None:
        verdict.double_counted += n
        verdict.findings.append(f"double: {line}")

    for event_id, outcome in outcomes.items():
        verdict.sent += 1
        if outcome.last == "accepted":
            verdict.accepted += 1
            verdict.epochs += isinstance(outcome.event, EpochReport)
            got = by_event.get(event_id)
            if got is None:
                lose(f"accepted {outcome.event.kind} {event_id} has no recorded reply")
            elif any(reply != got.reply_json for reply in outcome.replies):
                double(f"{event_id}: caller got {outcome.replies}, store recorded {got.reply_json}")
        elif outcome.last == "rejected":
            verdict.rejected += 1
            verdict.rejected_codes[outcome.errors[-1]] += 1
            got = by_event.get(event_id)  # a refusal is recorded as an error reply
            if got is not None and json.loads(got.reply_json).get("kind") != "error":
                double(f"refused {outcome.event.kind} {event_id} was applied")
        else:
            lose(f"{outcome.event.kind} {event_id}: {outcome.last} {outcome.gave_up[-1:]}")
    for event_id in by_event.keys() - outcomes.keys():
        double(f"recorded event {event_id} was never sent")

    # Trials: handed out once each, present, with exactly the epochs reported.
    handed: dict[tuple[str, int], list[str]] = {}
    reported: dict[tuple[str, int], list[int]] = {}
    accepted_epochs: dict[tuple[str, int], list[int]] = {}
    for job_id, history in recorded.items():
        for entry in history:
            reply = json.loads(entry.reply_json)
            if reply.get("kind") == "trial":
                handed.setdefault((job_id, reply["trial_number"]), []).append(entry.event_id)
            elif reply.get("kind") == "epoch_decision":
                reported.setdefault((job_id, reply["trial_number"]), []).append(reply["epoch"])
    for outcome in outcomes.values():
        event = outcome.event
        if outcome.last == "accepted" and isinstance(event, EpochReport):
            accepted_epochs.setdefault((event.job_id, event.trial_number), []).append(event.epoch)
    for (job_id, number), ids in handed.items():
        if len(ids) > 1:
            double(f"trial {number} of {job_id} handed out to {len(ids)} events", len(ids) - 1)
    store = SqlStore(database_url)
    try:
        for job_id in job_ids:
            with store.read(job_id) as tx:
                trials = {t.trial_number: t for t in tx.trials()}
            for number, trial in trials.items():
                if (job_id, number) not in handed:
                    double(f"trial {number} of {job_id} was created by no recorded event")
                reports = reported.get((job_id, number), [])
                if trial.epochs > len(reports):
                    double(
                        f"trial {number} of {job_id} has {trial.epochs} epochs for "
                        f"{len(reports)} recorded reports",
                        trial.epochs - len(reports),
                    )
            for job, number in handed:
                if job == job_id and number not in trials:
                    lose(f"trial {number} of {job_id} (handed out) is missing")
            for (job, number), epochs in accepted_epochs.items():
                if job != job_id or number not in trials:
                    continue
                missing = [e for e in epochs if e > trials[number].epochs]
                if missing:
                    lose(
                        f"trial {number} of {job_id} lacks accepted epochs {missing}", len(missing)
                    )
        replay = verdict.replay = audit(recorded, ledger.events(), store)
    finally:
        store.close()
    for difference in replay.differences:
        double(f"replay {difference.what} in {difference.job_id}: {difference.detail}")
    return verdict
