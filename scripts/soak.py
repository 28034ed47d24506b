"""Soak test: the live bso service on PostgreSQL under load, with faults injected at random.

Load.  ``--jobs`` synthetic recurring training jobs (default 100), each driven
by ``--runners-per-job`` threads (default 2, so two recurrences of one job run
at once and race for its lock), each thread with its own ``ServiceClient``:
register, then recurrence after recurrence: next trial, epoch reports until
the service says stop (now and then a trial is ended early, as a crash
would), end.  Epoch figures are small synthetic numbers from a seeded world
per job (no sleeping).  The load stops once ``--epochs-total`` epoch reports
(default 10,000) were accepted: every thread finishes its recurrence and exits.

Service.  Started the way ``bso up`` starts it (``bso_workers.launcher.Stack``):
Redis with append-only persistence in a temporary data folder, ``--workers``
Celery nodes (default 4, solo pool: one process each), on PostgreSQL (a
private throwaway cluster started with initdb/pg_ctl on a free port, as the
tests do, unless ``--database-url`` names a migrated or empty database; it must
be one nobody else uses while the soak runs).  A supervisor thread restarts
worker nodes that die, as ``bso up`` does.  Beat and Flower are not started.

Faults, each logged with a timestamp to the fault log (one line per fault):

* ``worker_kill``: SIGKILL a random worker node (the supervisor starts it again);
* ``redis_restart``: SIGTERM or SIGKILL Redis, keep it down a moment, start it
  again with the same command line (port, data folder, append-only file);
  clients must ride the outage out;
* ``db_drop``: ``pg_terminate_backend`` every other connection to the database;
* ``duplicate``: a runner sends one event twice (same event id): half of the
  time as two concurrent calls, otherwise again once the first call was
  answered; both replies must be identical;
* ``reorder``: a runner sends the report of epoch n+1 before that of epoch n;
  it must get a typed error and change nothing, and that event id stays
  refused (its refusal is recorded, so a copy still in flight can never be
  applied later); then n and a new report of n+1 are sent in order and are
  accepted (unless the service stopped the trial at n);
* ``garbage``: items that are not bso messages (non-JSON, ``[]``, wrong
  envelopes, unknown tasks, pickle, oversized) LPUSHed straight onto the
  events queue over the workers' own (privileged) Redis connection; one in
  ten is PUBLISHed on Celery's remote-control channel instead, which every
  worker node listens to.

Check.  After the load the service is stopped (workers finish what they
hold), then:

* the recorded replies are read from the store per job in commit order and
  replayed through an in-process ``BsoService`` on a fresh ``MemoryStore``
  (:func:`bso.audit.audit`): every reply byte for byte, every trial (epochs,
  time, energy, cost, status, stop reason, ...), every lane's random state;
* the driver's ledger (every event it sent and the answers it got) is
  compared with the store.

Definitions (counted per distinct event id; an event sent several times, by a
duplicate or by the client's own re-sends, is one event):

* ``sent``: events the runners sent (register, next trial, epoch, end).
* ``accepted``: events that got a success reply.
* ``rejected``: events whose last answer was a typed error (the early copy of
  a reordered report, and any unexpected refusal, which is also listed and
  fails the run).
* ``lost``: a call that gave up (the client raised ServiceUnavailable or any
  non-typed error, so a training job would have crashed), an event sent that
  got no answer at all, or an accepted event whose effect is missing from the
  store: its reply not recorded, a trial it was handed missing, or a trial
  with fewer epochs than its highest accepted report.
* ``double_counted``: an effect beyond the accepted events: a recorded reply
  that differs from the one the caller got, an event applied though the
  caller was told it was refused (or never sent), the two copies of a
  duplicate answered differently, an early reordered report that was
  accepted, a trial number handed out to two events, a trial in the store
  that no recorded event created, a trial with more epochs than recorded
  reports for it, and every difference between the store and the serial
  replay (reply, trial, lane).

Output: progress on stderr, the fault log's path, a summary, and as the last
line::

    soak: sent=... accepted=... rejected=... lost=0 double_counted=0 epochs=... replay=ok ... \
faults: worker_kill=... redis_restart=... db_drop=... duplicate=... reorder=... garbage=...

Exit status 0 only if lost and double_counted are 0, the replay matches, no
unexpected refusal or worker death occurred, and the load reached
``--epochs-total`` before ``--duration-limit``.

    .venv/bin/python scripts/soak.py                    # full run, a few minutes
    .venv/bin/python scripts/soak.py --jobs 4 --epochs-total 100 --workers 2  # smoke
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import logging
import os
import pickle
import pwd
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TextIO

import psycopg
import redis
from sqlalchemy.engine import make_url

from bso import keys
from bso.audit import AuditReport, audit
from bso.errors import BsoError, NoFeasibleBatchSize, OutOfOrder, ServiceUnavailable
from bso.events import (
    EndTrial,
    EpochDecision,
    EpochReport,
    Event,
    NextTrial,
    RegisterJob,
    TrialAssigned,
)
from bso.spec import JobSpec
from bso.storage.history import RecordedReply, replies_in_commit_order
from bso.storage.sql import SqlStore
from bso_client.transport import ServiceClient, SuccessReply, celery_message
from bso_workers.launcher import ManagedProcess, Stack, StackConfig, free_port, spawn
from bso_workers.settings import WorkerSettings

FAULT_KINDS = ("worker_kill", "redis_restart", "db_drop", "duplicate", "reorder", "garbage")
SIZES = (16, 32, 64, 128)
MAX_EPOCHS = 8
PROGRESS_EVERY_S = 10.0
RELAUNCH_S = 1.0
BROADCAST_SHARE = 0.1
"""Share of garbage items PUBLISHed on Celery's remote-control channel instead of queued."""
"""How long a runner whose call gave up (its training job crashed) waits before the next one."""


# -- options ----------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n", 1)[0] if __doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = parser.add_argument
    add("--jobs", type=int, default=100, help="recurring jobs")
    add("--runners-per-job", type=int, default=2, help="threads running recurrences of each job")
    add("--epochs-total", type=int, default=10_000, help="accepted epoch reports to reach")
    add("--workers", type=int, default=4, help="Celery worker nodes (solo pool)")
    add("--seed", type=int, default=1, help="seed of the worlds and of the fault schedule")
    add("--database-url", help="PostgreSQL URL (default: a private cluster in a temp folder)")
    add("--duration-limit", type=float, default=900.0, help="seconds before the load is cut")
    add("--min-seconds", type=float, default=0.0, help="keep the load on at least this long")
    add("--data-dir", type=Path, help="folder for Redis, logs, fault log (default: a temp one)")
    add("--fault-log", type=Path, help="fault log path (default: DATA_DIR/faults.log)")
    add("--client-timeout", type=float, default=10.0, help="ServiceClient timeout_s")
    add("--worker-kill-every", type=float, default=12.0, help="mean seconds; 0: never")
    add("--redis-restart-every", type=float, default=30.0, help="mean seconds; 0: never")
    add("--redis-down", type=float, default=2.0, help="longest seconds Redis stays down")
    add("--db-drop-every", type=float, default=15.0, help="mean seconds; 0: never")
    add("--garbage-every", type=float, default=0.5, help="mean seconds between bursts; 0: never")
    add("--garbage-burst", type=int, default=3, help="most items per garbage burst")
    add("--duplicate-rate", type=float, default=0.015, help="share of events sent twice at once")
    add("--reorder-rate", type=float, default=0.015, help="share of epoch reports sent early")
    add("--abandon-rate", type=float, default=0.03, help="share of trials ended early")
    args = parser.parse_args(argv)
    if args.jobs < 1 or args.runners_per_job < 1 or args.workers < 1 or args.epochs_total < 1:
        parser.error("--jobs, --runners-per-job, --workers and --epochs-total must be >= 1")
    return args


# -- the fault log ----------------------------------------------------------------------


class FaultLog:
    """One line per fault, timestamped, to a file; counts per kind."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.counts: Counter[str] = Counter(dict.fromkeys(FAULT_KINDS, 0))
        self._lock = threading.Lock()
        self._start = time.monotonic()
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file: TextIO = path.open("w", encoding="utf-8")

    def log(self, kind: str, detail: str, count: int = 1) -> None:
        now = datetime.now(UTC).isoformat(timespec="milliseconds")
        with self._lock:
            self.counts[kind] += count
            elapsed = time.monotonic() - self._start
            self._file.write(f"{now} +{elapsed:.3f}s {kind} {detail}\n")
            self._file.flush()

    def note(self, detail: str) -> None:
        """A line that is not a fault (set-up, recovery) in the same log."""
        self.log("note", detail, count=0)

    def summary(self) -> str:
        return " ".join(f"{kind}={self.counts[kind]}" for kind in FAULT_KINDS)

    def close(self) -> None:
        with self._lock:
            self._file.close()


# -- PostgreSQL ---------------------------------------------------------------------------


class PrivateCluster:
    """A throwaway PostgreSQL cluster on a free port of 127.0.0.1, as tests/fixtures/postgres.py.

    initdb and pg_ctl refuse to run as root, so root runs them as ``postgres``.
    fsync is off: the soak drops connections, it never crashes the database.
    """

    USER = "postgres"
    DATABASE = "bso_soak"

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="bso-soak-pg-"))
        self.port = free_port()
        self.bindir = self._find_bindir()

    @staticmethod
    def _find_bindir() -> Path:
        candidates = sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True)
        if on_path := shutil.which("pg_ctl"):
            candidates.append(Path(on_path).parent)
        for folder in candidates:
            if (folder / "initdb").is_file() and (folder / "pg_ctl").is_file():
                return folder
        raise SystemExit("soak: PostgreSQL server binaries not found; pass --database-url")

    def _run(self, args: Sequence[str]) -> None:
        prefix = ["runuser", "-u", self.USER, "--"] if os.geteuid() == 0 else []
        done = subprocess.run([*prefix, *args], capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed:\n{done.stdout}\n{done.stderr}")

    def start(self) -> str:
        if os.geteuid() == 0:
            entry = pwd.getpwnam(self.USER)
            os.chown(self.root, entry.pw_uid, entry.pw_gid)
        data = self.root / "data"
        self._run(
            [str(self.bindir / "initdb"), "--pgdata", str(data), "--username", self.USER,
             "--auth", "trust", "--encoding", "UTF8", "--no-locale", "--no-sync"]
        )  # fmt: skip
        options = (
            f"-k {self.root} -p {self.port} -c listen_addresses=127.0.0.1 "
            "-c fsync=off -c synchronous_commit=off -c full_page_writes=off "
            "-c max_connections=200"
        )
        self._run(
            [str(self.bindir / "pg_ctl"), "--pgdata", str(data), "--log",
             str(self.root / "server.log"), "--options", options, "--wait", "start"]
        )  # fmt: skip
        with psycopg.connect(
            host="127.0.0.1", port=self.port, user=self.USER, dbname="postgres", autocommit=True
        ) as connection:
            connection.execute(f'CREATE DATABASE "{self.DATABASE}"')
        return f"postgresql+psycopg://{self.USER}@127.0.0.1:{self.port}/{self.DATABASE}"

    def stop(self) -> None:
        data = self.root / "data"
        if (data / "postmaster.pid").exists():
            with contextlib.suppress(RuntimeError):
                self._run(
                    [str(self.bindir / "pg_ctl"), "--pgdata", str(data), "-m", "fast", "stop"]
                )
        shutil.rmtree(self.root, ignore_errors=True)


def libpq_url(database_url: str) -> str:
    """The SQLAlchemy URL as psycopg wants it (no ``+driver``)."""
    url = make_url(database_url).set(drivername="postgresql")
    return url.render_as_string(hide_password=False)


def drop_connections(database_url: str) -> int:
    """Terminate every other connection to the database; returns how many."""
    with psycopg.connect(libpq_url(database_url), autocommit=True) as connection:
        row = connection.execute(
            "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()) AS t"
        ).fetchone()
    return int(row[0]) if row else 0


# -- the service ------------------------------------------------------------------------


class SoakStack:
    """The service under test and the faults that hit it.

    The one place that starts the stack (:meth:`start`) and makes clients
    (:meth:`client`), so that changes to how ``bso up`` starts and secures
    things are followed here in one spot.
    """

    def __init__(self, data_dir: Path, database_url: str, workers: int, faults: FaultLog) -> None:
        self.data_dir = data_dir
        self.database_url = database_url
        self.faults = faults
        self.lock = threading.RLock()
        """Held while the process list changes (restarts) or is read."""
        self.killed: set[int] = set()
        """Pids this soak killed on purpose."""
        self.unexpected_deaths: list[str] = []
        self.kill_times: dict[str, list[float]] = {}
        settings = WorkerSettings(_env_file=None, task_events=False, log_level="INFO")
        self.stack = Stack(
            StackConfig(
                data_dir=data_dir,
                workers=workers,
                database_url=database_url,
                flower=False,
                beat=False,
                settings=settings,
            )
        )
        self._stop = threading.Event()
        self._supervisor = threading.Thread(target=self._supervise, name="supervisor", daemon=True)

    # -- start, clients, stop

    def start(self) -> None:
        self.stack.start()
        self._ensure_append_only()
        self._supervisor.start()

    @property
    def worker_url(self) -> str:
        """Redis URL with the workers' rights (used to push garbage)."""
        return self.stack.settings.broker_url

    @property
    def client_url(self) -> str:
        """Redis URL a training client gets (the client ACL user)."""
        assert self.stack.client_url is not None, "the stack is not started"
        return self.stack.client_url

    def client(self, timeout_s: float) -> ServiceClient:
        return ServiceClient.connect(
            self.client_url, api_key=self.stack.api_key, timeout_s=timeout_s
        )

    def stop(self) -> None:
        self._stop.set()
        if self._supervisor.is_alive():
            self._supervisor.join()
        with self.lock:
            self.stack.stop()

    # -- supervision (as `bso up` does)

    def _supervise(self) -> None:
        while not self._stop.wait(0.5):
            with self.lock:
                for process in self.stack.restart_dead_workers():
                    if process.pid in self.killed:
                        self.faults.note(f"restarted {process.name} (killed pid {process.pid})")
                    else:
                        self.unexpected_deaths.append(
                            f"{process.name} pid {process.pid} exited "
                            f"({process.popen.returncode}): {process.log_tail(5)}"
                        )
                        self.faults.note(
                            f"UNEXPECTED death of {process.name} pid {process.pid} "
                            f"({process.popen.returncode}); restarted"
                        )
                for process in self.stack.dead():
                    if process.name == "redis" and process.pid not in self.killed:
                        self.unexpected_deaths.append(f"redis pid {process.pid} exited")
                        self.killed.add(process.pid)  # reported once

    # -- faults

    def kill_worker(self, rng: random.Random) -> None:
        now = time.monotonic()
        with self.lock:
            nodes = [p for p in self.stack.processes if p.name.startswith("worker") and p.alive()]
            # `bso up` gives up on a node killed 5 times in 5 minutes; stay below that.
            nodes = [
                p for p in nodes if sum(now - t < 300 for t in self.kill_times.get(p.name, [])) < 4
            ]
            if not nodes:
                return
            victim = rng.choice(nodes)
            self.killed.add(victim.pid)
            self.kill_times.setdefault(victim.name, []).append(now)
            os.kill(victim.pid, signal.SIGKILL)
        self.faults.log("worker_kill", f"node={victim.name} pid={victim.pid} signal=SIGKILL")

    def restart_redis(self, rng: random.Random, longest_down_s: float) -> None:
        hard = rng.random() < 0.5
        down_s = rng.uniform(0.1, longest_down_s)
        with self.lock:
            index, old = self._redis()
            self.killed.add(old.pid)
            old.popen.send_signal(signal.SIGKILL if hard else signal.SIGTERM)
            old.popen.wait()
            time.sleep(down_s)
            new = self._respawn(old)
            self.stack.processes[index] = new
        self.faults.log(
            "redis_restart",
            f"signal={'SIGKILL' if hard else 'SIGTERM'} old_pid={old.pid} "
            f"exit={old.popen.returncode} down_s={down_s:.2f} new_pid={new.pid}",
        )

    def _redis(self) -> tuple[int, ManagedProcess]:
        for index, process in enumerate(self.stack.processes):
            if process.name == "redis":
                return index, process
        raise RuntimeError("the stack has no redis process")

    def _respawn(self, old: ManagedProcess, extra: Sequence[str] = ()) -> ManagedProcess:
        """Redis again, with the command line it had (same port, folder, files)."""
        argv = [*command_line(old), *extra]
        new = spawn("redis", argv, old.log_path.parent, dict(os.environ), self.data_dir.resolve())
        client = redis.Redis.from_url(self.worker_url, socket_connect_timeout=1, socket_timeout=1)
        deadline = time.monotonic() + 60
        try:
            while True:
                if not new.alive():
                    raise RuntimeError(f"redis did not start again: {new.log_tail()}")
                with contextlib.suppress(redis.RedisError):
                    if client.ping():
                        return new
                if time.monotonic() > deadline:
                    raise RuntimeError("redis did not answer within 60 s of its restart")
                time.sleep(0.05)
        finally:
            client.close()

    def _ensure_append_only(self) -> None:
        """Redis must persist to an append-only file, or a restart loses the queue
        (``bso up`` starts it so; this guards against that changing unnoticed)."""
        with self.lock:
            _, redis_process = self._redis()
            if _option(command_line(redis_process), "--appendonly") != "yes":
                raise RuntimeError("the launcher started Redis without --appendonly yes")

    def push_garbage(self, rng: random.Random, count: int) -> list[str]:
        client = redis.Redis.from_url(self.worker_url, socket_connect_timeout=2, socket_timeout=5)
        names = []
        try:
            for _ in range(count):
                name, item = garbage_item(rng)
                if rng.random() < BROADCAST_SHARE:
                    # Celery's remote-control channel, which every worker listens to.
                    db = client.connection_pool.connection_kwargs.get("db", 0)
                    client.publish(f"{keys.BROKER_KEY_PREFIX}/{db}.celery.pidbox", item)
                    name = f"broadcast:{name}"
                else:
                    client.lpush(keys.BROKER_KEY_PREFIX + keys.EVENTS_QUEUE, item)
                names.append(name)
        finally:
            client.close()
        return names

    def dead_letter_counts(self) -> dict[str, int]:
        """What the workers refused before decoding, per reason (and ``total``)."""
        client = redis.Redis.from_url(self.worker_url, decode_responses=True, socket_timeout=5)
        try:
            counts = client.hgetall(keys.DEADLETTER_COUNTS_KEY)
        finally:
            client.close()
        return {str(reason): int(n) for reason, n in sorted(counts.items())}

    def drop_db_connections(self) -> int:
        return drop_connections(self.database_url)


def command_line(process: ManagedProcess) -> list[str]:
    args = process.popen.args
    if isinstance(args, str | bytes | os.PathLike):
        return [os.fsdecode(args)]
    return [os.fsdecode(a) for a in args]


def _option(argv: Sequence[str], name: str) -> str | None:
    """The last value given to ``name`` on a command line."""
    value = None
    for i, arg in enumerate(argv[:-1]):
        if arg == name:
            value = argv[i + 1]
    return value


def garbage_item(rng: random.Random) -> tuple[str, bytes]:
    """One item that is not a bso message, and its kind."""
    payload = json.dumps({"event_id": f"garbage-{rng.getrandbits(48):x}", "kind": "epoch"})
    kinds: list[tuple[str, Callable[[], bytes]]] = [
        ("not_json", lambda: b"\x00\xff this is not json {"),
        ("list", lambda: b"[]"),
        ("number", lambda: b"42"),
        ("empty_object", lambda: b"{}"),
        ("string", lambda: b'"hello"'),
        ("wrong_body", lambda: json.dumps({"body": 17, "headers": [], "properties": 3}).encode()),
        ("unknown_task", lambda: celery_message("bso.no_such_task", payload, "garbage.1").encode()),
        ("invalid_event", lambda: celery_message(keys.TASK_EPOCH, payload, "garbage.2").encode()),
        ("not_an_event", lambda: celery_message(keys.TASK_EPOCH, "nope", "garbage.3").encode()),
        ("pickle", _pickle_envelope),
        ("random_bytes", lambda: rng.randbytes(rng.randint(1, 300))),
    ]
    if rng.random() < 0.02:
        return "oversized", b"[" + b"1," * (1024 * 1024) + b"1]"
    name, make = rng.choice(kinds)
    return name, make()


def _pickle_envelope() -> bytes:
    """A kombu envelope whose body is a pickle (harmless here; a worker must not load it)."""
    message = json.loads(celery_message(keys.TASK_EPOCH, "{}", "garbage.4"))
    message["content-type"] = "application/x-python-serialize"
    message["content-encoding"] = "binary"
    message["body"] = base64.b64encode(pickle.dumps(("soak", "not for loading"))).decode()
    message["properties"]["body_encoding"] = "base64"
    return json.dumps(message).encode()


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
        ledger = self.load.ledger
        ledger.sending(event)
        try:
            reply = self.client.request(event)
        except ServiceUnavailable as exc:
            ledger.gave_up(event, exc)
            self.gave_up = True
            return None
        except BsoError as exc:
            ledger.refused(event, exc.code, expected=isinstance(exc, refusal_expected))
            return None
        except Exception as exc:
            ledger.gave_up(event, exc)
            self.gave_up = True
            return None
        ledger.accepted(event, reply.model_dump_json())
        return reply

    def _send_twice(self, event: Event, refusal_expected: Refusals) -> SuccessReply | None:
        at_once = self.rng.random() < 0.5
        how = "twice at once" if at_once else "again after its reply"
        self.load.faults.log(
            "duplicate", f"job={self.world.job_id} {event.kind} {event.event_id} sent {how}"
        )
        if at_once:
            other: list[SuccessReply | None] = []
            twin = threading.Thread(
                target=lambda: other.append(self._call(event, refusal_expected)), daemon=True
            )
            twin.start()
            mine = self._call(event, refusal_expected)
            twin.join()
            theirs = other[0] if other else None
        else:
            mine = self._call(event, refusal_expected)
            theirs = self._call(event, refusal_expected)
        if mine is not None and theirs is not None:
            if mine.model_dump_json() != theirs.model_dump_json():
                self.load.ledger.problem(
                    f"duplicate {event.event_id} answered differently: "
                    f"{mine.model_dump_json()} vs {theirs.model_dump_json()}",
                    double=True,
                )
        elif (mine is None) != (theirs is None):
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


# -- main -------------------------------------------------------------------------------


@contextlib.contextmanager
def database(url: str | None) -> Iterator[str]:
    if url is not None:
        yield url
        return
    cluster = PrivateCluster()
    try:
        yield cluster.start()
    finally:
        cluster.stop()


def progress(load: Load, started: float, target: int) -> str:
    elapsed = time.monotonic() - started
    with load.ledger.lock:
        sent = len(load.ledger.outcomes)
        epochs = load.ledger.epochs_accepted
    return (
        f"soak: {elapsed:6.1f} s  epochs {epochs}/{target}  events sent {sent} "
        f"({sent / max(elapsed, 1e-9):.0f}/s)  faults: {load.faults.summary()}"
    )


def run(args: argparse.Namespace) -> int:
    data_dir = args.data_dir or Path(tempfile.mkdtemp(prefix="bso-soak-"))
    data_dir.mkdir(parents=True, exist_ok=True)
    faults = FaultLog(args.fault_log or data_dir / "faults.log")
    logging.basicConfig(
        filename=data_dir / "soak.log",
        level=logging.INFO,
        format="%(asctime)s %(threadName)s %(name)s %(levelname)s %(message)s",
    )
    print(f"soak: data and logs in {data_dir}; fault log {faults.path}", file=sys.stderr)
    worlds = [make_world(i, args.seed) for i in range(args.jobs)]
    ledger = Ledger()
    load = Load(ledger, faults, args)
    with database(args.database_url) as database_url:
        stack = SoakStack(data_dir, database_url, args.workers, faults)
        injector = Injector(stack, faults, args)
        clients: list[ServiceClient] = []
        try:
            stack.start()
            faults.note(f"set-up: {args.workers} worker nodes up; load starts")
            runners = []
            for world in worlds:
                for number in range(args.runners_per_job):
                    client = stack.client(args.client_timeout)
                    clients.append(client)
                    runners.append(Runner(world, number, load, client))
            started = time.monotonic()
            for runner in runners:
                runner.start()
            injector.start()
            last_progress = started
            while any(r.is_alive() for r in runners):
                time.sleep(0.2)
                now = time.monotonic()
                if (
                    ledger.epochs_accepted >= args.epochs_total
                    and now - started >= args.min_seconds
                ):
                    load.enough.set()
                if now - started > args.duration_limit and not load.cut.is_set():
                    load.cut.set()
                    faults.note("duration limit reached: load cut")
                if now - last_progress >= PROGRESS_EVERY_S:
                    last_progress = now
                    print(progress(load, started, args.epochs_total), file=sys.stderr, flush=True)
            elapsed = time.monotonic() - started
            injector.done.set()
            injector.join()
            dead_letters = stack.dead_letter_counts()
            faults.note(f"load done after {elapsed:.1f} s; dead letters {dead_letters}; stopping")
        finally:
            injector.done.set()
            for client in clients:
                with contextlib.suppress(Exception):
                    client.close()
            stack.stop()
        faults.close()
        verdict = check(ledger, database_url, [w.job_id for w in worlds])
    return report(
        args=args,
        verdict=verdict,
        ledger=ledger,
        stack=stack,
        injector=injector,
        faults=faults,
        elapsed=elapsed,
        cut=load.cut.is_set(),
        dead_letters=dead_letters,
    )


def report(
    *,
    args: argparse.Namespace,
    verdict: Verdict,
    ledger: Ledger,
    stack: SoakStack,
    injector: Injector,
    faults: FaultLog,
    elapsed: float,
    cut: bool,
    dead_letters: dict[str, int],
) -> int:
    failures = [*ledger.problems, *verdict.findings, *stack.unexpected_deaths]
    if injector.error is not None:
        failures.append(f"fault injector failed: {injector.error!r}")
    if cut:
        failures.append(f"duration limit {args.duration_limit:g} s reached before the target")
    for line in failures[:40]:
        print(f"  {line}", file=sys.stderr)
    if len(failures) > 40:
        print(f"  ... and {len(failures) - 40} more", file=sys.stderr)
    replay = verdict.replay
    replay_ok = replay is not None and replay.ok
    print(f"fault log: {faults.path}")
    if replay is not None:
        print(
            f"replay: {replay.jobs} jobs, {replay.replayed} recorded events replayed serially, "
            f"{replay.trials} trials compared, {len(replay.differences)} differences"
        )
    print(f"dead letters (items the workers refused before decoding): {dead_letters or 'none'}")
    codes = ", ".join(f"{c}={n}" for c, n in sorted(verdict.rejected_codes.items())) or "none"
    print(f"rejected by code: {codes}; unexpected worker deaths: {len(stack.unexpected_deaths)}")
    ok = (
        verdict.lost == 0
        and verdict.double_counted == 0
        and replay_ok
        and not ledger.unexpected_refusals
        and not stack.unexpected_deaths
        and injector.error is None
        and not cut
        and verdict.epochs >= args.epochs_total
    )
    print(
        f"soak: sent={verdict.sent} accepted={verdict.accepted} rejected={verdict.rejected} "
        f"lost={verdict.lost} double_counted={verdict.double_counted} epochs={verdict.epochs} "
        f"jobs={args.jobs} workers={args.workers} seconds={elapsed:.0f} "
        f"replay={'ok' if replay_ok else 'differs'} result={'pass' if ok else 'FAIL'} "
        f"faults: {faults.summary()}",
        flush=True,
    )
    return 0 if ok else 1


def _interrupt(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # Ctrl-C / SIGTERM: unwind through the finally blocks, which stop everything.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        return run(args)
    except KeyboardInterrupt:
        print("soak: interrupted; everything started was stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
