"""Client-side soak: simulated training runs that lose the service, die, or break.

The service soak (``scripts/soak.py``) proves the service loses nothing; this
one proves the training side does not: no failure of bso ends a run, no
script bug or dead client leaves a job without a batch size, and a run that
trained while the service was down reaches it once, exactly once.

Load.  ``--runs`` simulated training runs (default 50) spread over ``--jobs``
recurring jobs (default 10), at most ``--concurrency`` at a time, each a
subprocess of this script (``--client``) that uses the real client library
(:class:`bso_client.BatchSizeOptimizer`, no torch): it asks for a batch size,
then trains epochs of ``--epoch-s`` seconds each, whose metric rises towards
the job's target at a pace set by the size, and reports each one, until bso
says stop or ``max_epochs``.  Its time is real (the time-only energy monitor),
its energy 0.

Service.  The stack ``bso up`` runs (:class:`bso_workers.stack.Stack`: Redis
with its append-only file, ``--workers`` Celery nodes, SQLite), on a free
port in ``--data-dir``; no beat, so that no trial is ended by the lease sweep,
which the audit cannot replay (a killed client's trial stays running).

Faults:

* **outage**: once ``--outage-after`` of the runs have started and one of
  those running has trained an epoch (so that some lose it mid-run), the whole
  stack is stopped for ``--outage-s`` seconds (default 600) while runs go on
  and new ones start, then started again on the same port and data folder;
* **kill -9**: ``--kill-share`` of the runs are SIGKILLed by this script after
  their second epoch's report;
* **script bugs**: ``--bug-share`` of the runs raise before their first epoch.

Checks, printed as figures and, last line, one JSON document:

* ``unfinished_runs``: runs neither killed nor buggy that did not train until
  bso stopped them or ``max_epochs`` (a crash, a hang, an error from bso);
  goal 0;
* ``jobs_without_size``: jobs whose final run (one per job, after the
  outage) got no batch size; goal 0;
* ``detached_runs`` (runs that went on without the service), ``delivered``
  (their journals the service acknowledged) and ``delivered_twice``; goal:
  all delivered, none twice (see :func:`deliveries`); no job with more
  detached epochs delivered than its detached runs trained
  (``detached_epochs_extra``, goal 0); no journal left on the machine
  (``journals_left``, goal 0);
* ``audit``: every job's recorded events replayed serially on a fresh store
  (:func:`bso.audit.audit`, as ``scripts/soak.py`` does) must give the same
  replies, trials and lanes.  Each client logs every event it sends (its
  ledger), which is what the replay needs.

Exit status 0 only if every goal is met.  Run by hand::

    .venv/bin/python scripts/client_soak.py                 # 50 runs, a 10-minute outage
    .venv/bin/python scripts/client_soak.py --outage-s 5 --runs 12 --jobs 3   # tiny (CI)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import zlib
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

EXIT_RELAUNCH = 3
SIZES = (16, 32, 64, 128)
DEFAULT_SIZE = 32
TARGET = 0.9
KILL_AFTER_EPOCH = 2
POLL_S = 0.05
END_JOURNALED = "its end is journaled to"
"""What the client logs (``bso_client.detachment``) when it journals a run whose end
could not be sent."""


# -- the client: one simulated training run (a subprocess) ------------------------------


def metric_after(epoch: int, batch_size: int) -> float:
    """A learning curve that reaches :data:`TARGET` sooner at the sizes near the default."""
    pace = 0.8 - 0.15 * abs(math.log2(batch_size / DEFAULT_SIZE))
    return 1.0 - 0.9 * math.exp(-pace * epoch)


def client_main(args: argparse.Namespace) -> int:
    """One run; every event sent, every epoch trained and how it ended go to the ledger."""
    from bso_client import BatchSizeOptimizer, JobSpec, TrainFailError
    from bso_client.transport import ServiceClient

    ledger = Path(args.ledger)

    def note(**entry: Any) -> None:
        """One line, written at once: a SIGKILL loses nothing already noted."""
        with ledger.open("a", encoding="utf-8") as file:
            file.write(json.dumps(entry) + "\n")

    round_trip = ServiceClient._round_trip

    def logged_round_trip(self: ServiceClient, task_name: str, message: Any) -> Any:
        if not task_name.endswith("status"):  # reads are not events
            note(kind="event", event=message.model_dump(mode="json"))
        return round_trip(self, task_name, message)

    ServiceClient._round_trip = logged_round_trip  # type: ignore[method-assign]

    job = JobSpec(
        job_id=args.job,
        batch_sizes=list(SIZES),
        default_batch_size=DEFAULT_SIZE,
        target_metric=TARGET,
        max_epochs=args.max_epochs,
        eta_knob=0.5,
        mab_seed=zlib.crc32(args.job.encode()),  # a seeded bandit: the audit replays its draws
    )
    bso = BatchSizeOptimizer(job, os.environ["BSO_BROKER_URL"])
    status = 0
    try:
        with bso:
            batch_size = bso.get_batch_size()
            note(kind="batch", batch_size=batch_size, trial=bso.trial_number)
            if args.bug:
                raise ValueError("a bug in the training script, before its first epoch")
            bso.on_train_begin()
            try:
                for epoch in range(1, args.max_epochs + 1):
                    time.sleep(args.epoch_s * (0.5 + batch_size / 128))
                    note(kind="epoch", epoch=epoch)
                    bso.on_evaluate(metric_after(epoch, batch_size))
                    note(kind="reported", epoch=epoch, detached=detached(bso))
                    if bso.training_finished:
                        break
            except TrainFailError:
                status = EXIT_RELAUNCH
        note(kind="end", status=status, stopped=bso.training_finished)
    finally:  # a bug run too: its end may be what lost the service
        note(kind="closed", detached=detached(bso))
    return status


def detached(bso: Any) -> bool:
    """Whether the run is going on without the service (the client's own flag)."""
    return bool(getattr(bso, "detached", getattr(bso, "_detached", False)))


# -- the driver ---------------------------------------------------------------------------


@dataclass
class Run:
    number: int
    job: str
    kind: str
    """``normal``, ``kill``, ``bug`` or ``final`` (a job's last run, after the outage)."""
    ledger: Path
    popen: subprocess.Popen[bytes] | None = None
    returncode: int | None = None
    killed: bool = False
    entries: list[dict[str, Any]] = field(default_factory=list)

    def read(self) -> list[dict[str, Any]]:
        if self.ledger.exists():
            text = self.ledger.read_text(encoding="utf-8")
            self.entries = [json.loads(line) for line in text.splitlines() if line.endswith("}")]
        return self.entries

    def epochs(self) -> int:
        return max((e["epoch"] for e in self.entries if e["kind"] == "epoch"), default=0)

    def reported(self) -> int:
        """Epochs whose report returned: killed after one, the run's detached flag is known."""
        return max((e["epoch"] for e in self.entries if e["kind"] == "reported"), default=0)

    def was_detached(self) -> bool:
        """Went on without the service with something to deliver: epochs, or a trial
        the service handed out (a run detached at its start that broke before its
        first epoch has neither, and its journal is rightly dropped)."""
        trial = next((e["trial"] for e in self.entries if e["kind"] == "batch"), None)
        flagged = any(e.get("detached") for e in self.entries)
        return flagged and (self.epochs() > 0 or trial is not None)

    def end_journaled(self) -> bool:
        """Its end could not be sent (the service went down as it ended, a script
        bug's end too): the client journals the run and says so in its log."""
        log = self.ledger.with_suffix(".log")
        return log.exists() and END_JOURNALED in log.read_text(encoding="utf-8", errors="replace")

    def left_journal(self) -> bool:
        """Left one journal for a later run to deliver."""
        return self.was_detached() or self.end_journaled()

    def finished(self, max_epochs: int) -> bool:
        """Exited 0 or 3 having trained until bso stopped it, or to ``max_epochs``."""
        end = next((e for e in self.entries if e["kind"] == "end"), None)
        return (
            self.returncode in (0, EXIT_RELAUNCH)
            and end is not None
            and (end["stopped"] or self.epochs() == max_epochs)
        )


def schedule(args: argparse.Namespace) -> list[Run]:
    """The runs in launch order; each job's last run is a ``final`` one, after the outage."""
    rng = random.Random(args.seed)
    jobs = [f"client-soak-{j:02d}" for j in range(args.jobs)]
    middle = max(args.runs - args.jobs, 0)
    kinds = ["normal"] * middle
    kills, bugs = round(middle * args.kill_share), round(middle * args.bug_share)
    kinds[:kills] = ["kill"] * kills
    kinds[kills : kills + bugs] = ["bug"] * bugs
    rng.shuffle(kinds)
    pairs = [(jobs[i % args.jobs], kind) for i, kind in enumerate(kinds)]
    pairs += [(job, "final") for job in jobs]
    folder = args.data_dir / "ledgers"
    folder.mkdir(parents=True, exist_ok=True)
    return [
        Run(n, job, kind, folder / f"run-{n:03d}.jsonl") for n, (job, kind) in enumerate(pairs, 1)
    ]


class Service:
    """The stack ``bso up`` runs, stopped and started again on the same port and data."""

    def __init__(self, data_dir: Path, workers: int) -> None:
        from bso_workers.stack import StackConfig
        from bso_workers.supervision import free_port
        from bso_workers.tenant_keys import LOAD_GENERATOR_LIMITS

        self.config = StackConfig(
            data_dir=data_dir / "service",
            redis_port=free_port(),
            workers=workers,
            flower=False,
            beat=False,
            metrics=False,
            default_tenant_limits=LOAD_GENERATOR_LIMITS,
        )
        self.stack: Any = None

    def start(self) -> None:
        from kombu import pools

        from bso_workers.stack import Stack

        pools.reset()  # the pooled connections to the stopped Redis are dead
        self.stack = Stack(self.config).start()

    def stop(self) -> None:
        self.stack.stop()

    def env(self, home: Path, bound_s: float | None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k != "XDG_CACHE_HOME"}
        env.update(
            BSO_BROKER_URL=self.stack.client_url,
            BSO_API_KEY=self.stack.api_key,
            HOME=str(home),  # one machine: the clients share its journal folder
            BSO_CACHE_DIR=str(home / ".cache" / "bso"),
            PYTHONUNBUFFERED="1",
        )
        if bound_s is not None:
            env["BSO_UNAVAILABLE_BOUND_S"] = f"{bound_s:g}"
        return env


def drive(args: argparse.Namespace, service: Service, runs: list[Run]) -> dict[str, float]:
    """Launch the runs, stop the service mid-way, kill some clients; returns timings."""
    home = args.data_dir / "home"
    home.mkdir(exist_ok=True)
    env = service.env(home, args.bound_s)
    outage_at = max(1, round(args.outage_after * (len(runs) - args.jobs)))
    started = time.monotonic()
    timings: dict[str, float] = {}
    pending, running = list(runs), list[Run]()
    outage_end: float | None = None
    while pending or running:
        for run in list(running):
            run.read()
            if run.kind == "kill" and not run.killed and run.reported() >= KILL_AFTER_EPOCH:
                assert run.popen is not None
                run.popen.send_signal(signal.SIGKILL)
                run.killed = True
            if run.popen is not None and (code := run.popen.poll()) is not None:
                run.returncode = code
                run.read()
                running.remove(run)
        launched = len(runs) - len(pending)
        mid_run = any(r.epochs() >= 1 for r in running)  # some runs lose it mid-training
        if launched >= outage_at and mid_run and "outage_start_s" not in timings:
            timings["outage_start_s"] = time.monotonic() - started
            log(f"outage: stopping the service for {args.outage_s:g} s")
            service.stop()
            outage_end = time.monotonic() + args.outage_s
        if outage_end is not None and time.monotonic() >= outage_end:
            service.start()
            env = service.env(home, args.bound_s)
            timings["outage_end_s"] = time.monotonic() - started
            log("outage over: the service is back")
            outage_end = None
        finals_wait = pending and pending[0].kind == "final" and (outage_end or running)
        if pending and len(running) < args.concurrency and not finals_wait:
            run = pending.pop(0)
            argv = [sys.executable, __file__, "--client", "--job", run.job]
            argv += ["--ledger", str(run.ledger), "--max-epochs", str(args.max_epochs)]
            argv += ["--epoch-s", str(args.epoch_s), *(["--bug"] if run.kind == "bug" else [])]
            log_file = run.ledger.with_suffix(".log").open("wb")
            run.popen = subprocess.Popen(argv, env=env, stdout=log_file, stderr=log_file)
            running.append(run)
        time.sleep(POLL_S)
    timings["wall_s"] = time.monotonic() - started
    return timings


def check(args: argparse.Namespace, service: Service, runs: list[Run]) -> dict[str, Any]:
    """The goals, from the runs' ledgers and the store, and the audit's replay."""
    from bso.audit import audit
    from bso.storage.history import replies_in_commit_order
    from bso.storage.sql import SqlStore
    from bso.wire.events import EVENT_ADAPTER
    from bso_workers.tenant_keys import database_url_of

    database_url = database_url_of(service.config.data_dir.resolve())
    jobs = sorted({r.job for r in runs})
    events = {}
    for run in runs:
        for entry in run.entries:
            if entry["kind"] == "event":
                event = EVENT_ADAPTER.validate_python(entry["event"])
                events[event.event_id] = event
    recorded = replies_in_commit_order(database_url, jobs)
    store = SqlStore(database_url)
    try:
        trials = 0
        for job in jobs:
            with store.read(job) as tx:
                trials += len(list(tx.trials()))
        replay = audit(recorded, events, store)
    finally:
        store.close()
    normal = [r for r in runs if r.kind in ("normal", "final")]
    finals = [r for r in runs if r.kind == "final"]
    left = list((args.data_dir / "home" / ".cache" / "bso" / "detached").glob("*/*.json"))
    return {
        "runs": len(runs),
        "jobs": len(jobs),
        "killed": sum(r.killed for r in runs),
        "script_bugs": sum(r.kind == "bug" for r in runs),
        "unfinished_runs": sum(not r.finished(args.max_epochs) for r in normal),
        "unfinished": [r.number for r in normal if not r.finished(args.max_epochs)],
        "jobs_without_size": sum(not any(e["kind"] == "batch" for e in r.entries) for r in finals),
        **deliveries(runs, recorded, events),
        "journals_left": len(left),
        "epochs_trained": sum(r.epochs() for r in runs),
        "trials": trials,
        "audit_ok": replay.ok,
        "audit_replayed": replay.replayed,
        "audit_differences": [f"{d.job_id} {d.what}: {d.detail}"[:300] for d in replay.differences],
    }


def deliveries(
    runs: list[Run], recorded: Mapping[str, Sequence[Any]], events: Mapping[str, Any]
) -> dict[str, int]:
    """Detached runs against the journals the service acknowledged, per job.

    A detached run writes one journal, and so does a run whose end could not be
    sent (:meth:`Run.end_journaled`: a bug run that raised as the outage began
    was counted as delivered twice); the service applies its delivery once (the
    journal's id is the event's) and records its answer.  Delivered: a detached
    run's journal acknowledged.  Delivered twice: an acknowledged journal beyond
    the job's detached runs, or a second journal for one trial.  And no job may
    get more detached epochs than its detached runs trained.  (A journal whose
    trial the service had already ended on its own, the reply lost in the
    outage, is acknowledged but leaves that trial as it was: not marked detached.)
    """
    detached_runs: Counter[str] = Counter()
    trained: Counter[str] = Counter()
    for run in runs:
        if run.left_journal():
            detached_runs[run.job] += 1
            trained[run.job] += run.epochs()
    acked: Counter[str] = Counter()
    acked_trials: dict[str, set[int]] = {}
    epochs: Counter[str] = Counter()
    for job, history in recorded.items():
        for entry in history:
            reply = json.loads(entry.reply_json)
            if reply.get("kind") == "detached_run_delivered":
                acked[job] += 1
                acked_trials.setdefault(job, set()).add(reply["trial_number"])
                epochs[job] += len(events[entry.event_id].epochs)
    jobs = sorted({*detached_runs, *acked})
    return {
        "detached_runs": sum(detached_runs.values()),
        "delivered": sum(min(acked[j], detached_runs[j]) for j in jobs),
        "delivered_twice": sum(
            max(acked[j] - detached_runs[j], 0) + acked[j] - len(acked_trials.get(j, ()))
            for j in jobs
        ),
        "detached_epochs_trained": sum(trained.values()),
        "detached_epochs_delivered": sum(epochs.values()),
        "detached_epochs_extra": sum(max(epochs[j] - trained[j], 0) for j in jobs),
    }


def log(line: str) -> None:
    print(f"client-soak: {line}", file=sys.stderr, flush=True)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--jobs", type=int, default=10)
    parser.add_argument("--concurrency", type=int, default=5, help="runs at once")
    parser.add_argument("--max-epochs", type=int, default=6)
    parser.add_argument("--epoch-s", type=float, default=0.5, help="seconds of a simulated epoch")
    parser.add_argument(
        "--outage-s", type=float, default=600.0, help="how long the service is down"
    )
    parser.add_argument(
        "--outage-after", type=float, default=0.4, help="share of the runs started before it"
    )
    parser.add_argument("--kill-share", type=float, default=0.1, help="runs killed with -9")
    parser.add_argument("--bug-share", type=float, default=0.1, help="runs that raise early")
    parser.add_argument(
        "--bound-s", type=float, help="the client's fail-open bound (default: the client's)"
    )
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-dir", type=Path, help="default: a temporary folder")
    parser.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--job", help=argparse.SUPPRESS)
    parser.add_argument("--ledger", help=argparse.SUPPRESS)
    parser.add_argument("--bug", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not args.client and args.runs < args.jobs:
        parser.error("--runs must be at least --jobs (each job ends with a final run)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.client:
        return client_main(args)
    with tempfile.TemporaryDirectory(prefix="bso-client-soak-") as scratch:
        args.data_dir = (args.data_dir or Path(scratch)).resolve()
        args.data_dir.mkdir(parents=True, exist_ok=True)
        service = Service(args.data_dir, args.workers)
        runs = schedule(args)
        log(f"{len(runs)} runs over {args.jobs} jobs; service data in {args.data_dir}")
        service.start()
        try:
            timings = drive(args, service, runs)
        finally:
            for run in runs:
                if run.popen is not None and run.popen.poll() is None:
                    run.popen.kill()
            service.stop()
        result = {**check(args, service, runs), **{k: round(v, 1) for k, v in timings.items()}}
    result["outage_s"] = args.outage_s
    result["pass"] = (
        result["unfinished_runs"] == 0
        and result["jobs_without_size"] == 0
        and result["delivered"] == result["detached_runs"]
        and result["delivered_twice"] == 0
        and result["detached_epochs_extra"] == 0
        and result["journals_left"] == 0
        and result["audit_ok"]
    )
    for name in ("runs", "killed", "script_bugs", "unfinished_runs", "jobs_without_size"):
        log(f"{name:>18}: {result[name]}")
    for name in (
        "detached_runs",
        "delivered",
        "delivered_twice",
        "detached_epochs_trained",
        "detached_epochs_delivered",
        "journals_left",
        "audit_ok",
        "wall_s",
    ):
        log(f"{name:>18}: {result[name]}")
    for line in result["audit_differences"][:10]:
        log(f"audit: {line}")
    print(json.dumps(result), flush=True)
    return 0 if result["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
