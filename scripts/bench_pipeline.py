"""Latency and throughput of the live bso service, with Zeus's FastAPI server as reference.

C concurrent simulated jobs (threads of this process), each doing, round after
round: register -> next trial -> E epoch reports -> end trial.  Every call is
timed from the caller's side; the table gives p50/p95/p99 per event type and
epoch reports per second (all epoch reports of the phase over its wall time,
the other events running alongside).

Systems, all started first and then measured back to back for each C (so a
comparison at one C spans seconds, not the whole run), each on loopback:

* bso through ``bso_workers.stack.Stack`` (its own Redis, SQLite with
  migrations, N worker nodes running one event at a time each, in the Celery
  pool ``--pool`` names: ``solo``, the default, as bso's workers now run, or
  ``prefork`` with one pool process per node; no Flower, no beat), called
  through ``ServiceClient`` (one per job, as separate training processes
  would have), for every ``--workers`` count;
* a bare Celery task on the same broker (``scripts/bench_baseline_task.py``:
  one SQLite commit, one SET EX reply, announced and taken like bso's replies), on
  as many nodes as that bso stack has (``bare1``..``bareN``, same pool, one
  SQLite file shared by all, as bso's nodes share theirs), as the floor of any
  pipeline of one Celery task per event.  It is measured twice: in blocks
  between bso's C=1 rounds (``--bare-calls`` round trips in all, one caller),
  for the C=1 latency ratio; and, right after bso's phase at every C, as its
  own closed-loop load ("bare Nw" rows): C callers (threads, each with its own
  ``BareClient``), each doing round trips back to back, as many as each bso job
  sends epoch reports in that phase when no trial stops early (rounds x
  epochs), so both phases make about the same number of event calls;
* Zeus 0.16.0's batch size optimizer server (FastAPI under uvicorn, SQLite via
  aiosqlite) from the side venv ``.venv-zeus`` (``scripts/setup_zeus_venv.sh``),
  over HTTP/1.1 with one keep-alive connection per job, on the REST routes
  Zeus's own client uses (POST /jobs, GET /jobs/batch_size, POST /report,
  PATCH /trials).

The simulated job converges exactly at its last epoch and every batch size
costs the same per epoch.  bso runs its Zeus-compatible policy by default
(``--policy zeus``), so both services take the same decisions, neither stops a
trial early, and both get the same sequence of calls; ``--policy bso`` lets
bso's own policy stop explorations it cannot win (the job then moves on to its
next round).  The load is closed-loop with no think time (a job sends its next
event as soon as the last is answered), so at C jobs the latency is about C
over the throughput: a stress test, not a model of real epochs, which are
minutes apart.

Besides the caller-side latencies it prints, per phase, the time bso's tasks
spent inside the task (from the workers' "event handled" log lines) and the CPU
time of every process involved per call (Linux ``/proc``), next to how busy the
whole machine was: on a shared machine that says how much of it we actually got.
Targets are printed, never asserted.  After the C=32 p99 target (bso 2 workers
against Zeus), it prints the bare task's calls/s and p99 at that same point:
every event task does at least that commit and that reply, and a closed loop of
32 callers on 2 nodes queues behind them, so if even the bare task misses the
p99 target, no pipeline of one Celery task per event can meet it with 2 nodes
of that pool on that broker and machine.

    .venv/bin/python scripts/bench_pipeline.py            # full run, ~1.5-3 min
    .venv/bin/python scripts/bench_pipeline.py --quick    # smoke run, ~20 s
    .venv/bin/python scripts/bench_pipeline.py --no-zeus  # bso (and bare task) only
    .venv/bin/python scripts/bench_pipeline.py --pool prefork  # bso and bare on prefork

Ctrl-C or SIGTERM stops the run and everything it started; its children also
die with it if it is killed outright (``PR_SET_PDEATHSIG``, see bso_workers.supervision).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import logging
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from types import FrameType
from typing import Any, Protocol

import numpy as np

SCRIPTS = Path(__file__).resolve().parent
ROOT = SCRIPTS.parent
if str(SCRIPTS) not in sys.path:  # bench_baseline_task, also when imported by the tests
    sys.path.insert(0, str(SCRIPTS))

from bench_baseline_task import BENCH_QUEUE, DB_ENV, TASK_NAME  # noqa: E402

from bso.spec import JobSpec, PolicyName  # noqa: E402
from bso.wire import keys  # noqa: E402
from bso.wire.events import EpochReport  # noqa: E402
from bso.wire.replies import RedisReplyBackend  # noqa: E402
from bso_client.transport import RedisPublisher, ServiceClient  # noqa: E402
from bso_workers.celery_app import WORKER_POOLS, WorkerPool  # noqa: E402
from bso_workers.settings import WorkerSettings  # noqa: E402
from bso_workers.stack import Stack, StackConfig, node_name, wait_for_workers  # noqa: E402
from bso_workers.supervision import (  # noqa: E402
    ManagedProcess,
    free_port,
    http_ok,
    spawn,
    stop_together,
    wait_until,
)
from bso_workers.tenant_keys import LOAD_GENERATOR_LIMITS  # noqa: E402

KINDS = ("register", "next_trial", "epoch", "end")
ZEUS_PYTHON = ROOT / ".venv-zeus" / "bin" / "python"
HOST = "127.0.0.1"
CALL_TIMEOUT_S = 60.0
"""Reply wait per call; long enough that no call is retried under load."""

BATCH_SIZES = [32, 64, 128, 256, 512]
DEFAULT_BATCH_SIZE = 128
TARGET_METRIC = 0.9
EPOCH_TIME_S = 10.0
POWER_W = 200.0
MAX_POWER_W = 300.0

# Targets from the pipeline issue (printed against, never asserted).
TARGET_THROUGHPUT_RATIO = 3.0
TARGET_P99_RATIO = 0.1
TARGET_BARE_RATIO = 2.0


# -- one simulated job -------------------------------------------------------------------


class JobDriver(Protocol):
    """The four calls of one job's round, against one system."""

    def register(self) -> None: ...
    def next_trial(self) -> tuple[int, int]:
        """(trial number, batch size)."""
        ...

    def report(self, trial: tuple[int, int], epoch: int) -> bool:
        """Report ``epoch``'s cumulative totals; True when the service says stop."""
        ...

    def end(self, trial: tuple[int, int]) -> None: ...
    def close(self) -> None: ...


def epoch_totals(epoch: int, epochs: int) -> tuple[float, float, float]:
    """Cumulative (time s, energy J, metric) after ``epoch``: the target is met at the last."""
    time_s = epoch * EPOCH_TIME_S
    metric = TARGET_METRIC if epoch >= epochs else 0.5 + 0.3 * epoch / epochs
    return time_s, time_s * POWER_W, metric


class BsoJob:
    """A job talking to bso through its own ``ServiceClient`` (own connections)."""

    def __init__(
        self,
        broker_url: str,
        api_key: str | None,
        job_id: str,
        *,
        seed: int,
        epochs: int,
        policy: PolicyName,
    ) -> None:
        self.client = ServiceClient.connect(
            broker_url, api_key=api_key, timeout_s=CALL_TIMEOUT_S, retries=0
        )
        self.epochs = epochs
        self.spec = JobSpec(
            job_id=job_id,
            batch_sizes=BATCH_SIZES,
            default_batch_size=DEFAULT_BATCH_SIZE,
            target_metric=TARGET_METRIC,
            beta_knob=None,
            max_epochs=100,
            mab_seed=seed,
            policy=policy,
        )

    def register(self) -> None:
        self.client.register(self.spec)

    def next_trial(self) -> tuple[int, int]:
        trial = self.client.next_trial(self.spec.job_id or "")
        return trial.trial_number, trial.batch_size

    def report(self, trial: tuple[int, int], epoch: int) -> bool:
        time_s, energy_j, metric = epoch_totals(epoch, self.epochs)
        decision = self.client.report_epoch(
            self.spec.job_id or "",
            trial[0],
            epoch=epoch,
            time_s=time_s,
            energy_j=energy_j,
            metric=metric,
        )
        return decision.stop

    def end(self, trial: tuple[int, int]) -> None:
        self.client.end_trial(self.spec.job_id or "", trial[0])

    def close(self) -> None:
        self.client.close()


class ZeusJob:
    """A job talking to Zeus's server over one keep-alive HTTP/1.1 connection."""

    def __init__(self, port: int, job_id: str, prefix: str, seed: int, epochs: int) -> None:
        self.port = port
        self.job_id = job_id
        self.epochs = epochs
        self.conn = http.client.HTTPConnection(HOST, port, timeout=CALL_TIMEOUT_S)
        self.spec = {
            "job_id": job_id,
            "job_id_prefix": prefix,
            "batch_sizes": BATCH_SIZES,
            "default_batch_size": DEFAULT_BATCH_SIZE,
            "eta_knob": 0.5,
            "beta_knob": None,
            "target_metric": TARGET_METRIC,
            "higher_is_better_metric": True,
            "max_epochs": 100,
            "num_pruning_rounds": 2,
            "window_size": 10,
            "mab_prior_mean": 0.0,
            "mab_prior_precision": 0.0,
            "mab_num_explorations": 2,
            "mab_seed": seed,
            "max_power": MAX_POWER_W,
            "number_of_gpus": 1,
            "gpu_model": "bench",
        }

    def _call(self, method: str, path: str, body: object | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if data is not None else {}
        for attempt in (1, 2):
            try:
                self.conn.request(method, path, body=data, headers=headers)
                response = self.conn.getresponse()
                text = response.read()
                break
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                # An idle keep-alive connection the server closed: reconnect once.
                self.conn.close()
                if attempt == 2:
                    raise
        if response.status not in (200, 201):
            raise RuntimeError(f"zeus {method} {path}: HTTP {response.status} {text[:300]!r}")
        return json.loads(text) if text else None

    def register(self) -> None:
        self._call("POST", "/jobs", self.spec)

    def next_trial(self) -> tuple[int, int]:
        trial = self._call("GET", f"/jobs/batch_size?job_id={self.job_id}")
        return int(trial["trial_number"]), int(trial["batch_size"])

    def report(self, trial: tuple[int, int], epoch: int) -> bool:
        time_s, energy_j, metric = epoch_totals(epoch, self.epochs)
        result = {
            "job_id": self.job_id,
            "batch_size": trial[1],
            "trial_number": trial[0],
            "time": time_s,
            "energy": energy_j,
            "metric": metric,
            "current_epoch": epoch,
        }
        return bool(self._call("POST", "/report", result)["stop_train"])

    def end(self, trial: tuple[int, int]) -> None:
        body = {"job_id": self.job_id, "batch_size": trial[1], "trial_number": trial[0]}
        self._call("PATCH", "/trials", body)

    def close(self) -> None:
        self.conn.close()


# -- one load phase ----------------------------------------------------------------------


@dataclass
class Phase:
    """What one (system, workers, C) run measured."""

    system: str
    workers: int | None
    concurrency: int
    rounds: int
    epochs: int
    latencies_ms: dict[str, list[float]] = field(default_factory=lambda: {k: [] for k in KINDS})
    wall_s: float = 0.0
    errors: list[str] = field(default_factory=list)
    early_stops: int = 0
    truncated: bool = False
    worker_ms: dict[str, list[float]] = field(default_factory=dict)
    load: tuple[float, float] = (0.0, 0.0)
    cpu_s: dict[str, float] = field(default_factory=dict)
    """CPU seconds each group of our processes used during the phase."""
    machine_jiffies: tuple[float, float] = (0.0, 0.0)
    """(busy, total) CPU time of the whole machine (anyone's) during the phase."""

    @property
    def machine_busy(self) -> float:
        busy, total = self.machine_jiffies
        return busy / total if total > 0 else math.nan

    @property
    def label(self) -> str:
        if self.workers is None:
            return self.system
        return f"{self.system} {self.workers}w"

    @property
    def epoch_reports(self) -> int:
        return len(self.latencies_ms["epoch"])

    @property
    def events(self) -> int:
        return sum(len(v) for v in self.latencies_ms.values())

    @property
    def epochs_per_s(self) -> float:
        return self.epoch_reports / self.wall_s if self.wall_s > 0 else 0.0


def percentiles(values: Sequence[float]) -> tuple[float, float, float]:
    if not values:
        return (math.nan, math.nan, math.nan)
    p50, p95, p99 = np.percentile(np.asarray(values), [50, 95, 99])
    return float(p50), float(p95), float(p99)


Timed = Callable[[str, Callable[[], Any]], Any]
"""``timed(kind, call)``: make the call, record its latency under ``kind``, return its result."""
Loop = Callable[[Timed, threading.Event], int]
"""One closed-loop caller: makes its calls through ``timed`` until done or the event
(halt) is set; returns how many of its trials were stopped early."""


def run_phase(
    phase: Phase,
    jobs: Sequence[JobDriver],
    timeout_s: float,
    cpu_groups: dict[str, list[int]] | None = None,
    rounds: int | None = None,
) -> Phase:
    """Run every job for ``rounds`` (default ``phase.rounds``) rounds at once, timing each call.

    Adds to ``phase`` (latencies, wall time, CPU), so that a phase can be run in
    blocks.  Past ``timeout_s`` the jobs stop after their current call and the
    phase is marked truncated; an interrupt (Ctrl-C) stops them the same way and
    propagates.  ``cpu_groups`` names the server processes whose CPU time is
    accounted (this process always is, as ``client``).
    """

    def job_loop(job: JobDriver, timed: Timed, halt: threading.Event) -> int:
        early = 0
        for _ in range(phase.rounds if rounds is None else rounds):
            if halt.is_set():
                break
            timed("register", job.register)
            trial = timed("next_trial", job.next_trial)
            for epoch in range(1, phase.epochs + 1):
                if halt.is_set():
                    break
                if timed("epoch", partial(job.report, trial, epoch)):
                    if epoch < phase.epochs:
                        early += 1
                    break
            timed("end", partial(job.end, trial))
        return early

    return run_loops(phase, [partial(job_loop, job) for job in jobs], timeout_s, cpu_groups)


def run_loops(
    phase: Phase,
    loops: Sequence[Loop],
    timeout_s: float,
    cpu_groups: dict[str, list[int]] | None = None,
) -> Phase:
    """Run the ``loops`` at once, one thread each, started together; see :func:`run_phase`."""
    groups = {"client": [os.getpid()], **(cpu_groups or {})}
    lock = threading.Lock()
    halt = threading.Event()
    barrier = threading.Barrier(len(loops) + 1)
    finished: list[float] = []

    def one_loop(loop: Loop) -> None:
        mine: list[tuple[str, float]] = []
        early = 0

        def timed(kind: str, call: Callable[[], Any]) -> Any:
            started = time.perf_counter()
            result = call()
            mine.append((kind, (time.perf_counter() - started) * 1000))
            return result

        try:
            barrier.wait()
            early = loop(timed, halt)
        except Exception as exc:
            with lock:
                phase.errors.append(f"{type(exc).__name__}: {exc}")
        finally:
            with lock:
                finished.append(time.perf_counter())
                for kind, ms in mine:
                    phase.latencies_ms[kind].append(ms)
                phase.early_stops += early

    threads = [
        threading.Thread(target=one_loop, args=(loop,), daemon=True, name=f"job{i}")
        for i, loop in enumerate(loops)
    ]
    load_before = os.getloadavg()[0]
    try:
        for thread in threads:
            thread.start()
        barrier.wait()
        started = time.perf_counter()
        cpu_before, machine_before = cpu_snapshot(groups), machine_cpu()
        deadline = started + timeout_s
        for thread in threads:
            while thread.is_alive():
                thread.join(0.2)
                if time.perf_counter() > deadline and not halt.is_set():
                    phase.truncated = True
                    halt.set()
        phase.wall_s += max(finished, default=time.perf_counter()) - started
        cpu_after, machine_after = cpu_snapshot(groups), machine_cpu()
    except BaseException:
        halt.set()
        barrier.abort()
        raise
    for g in groups:
        phase.cpu_s[g] = phase.cpu_s.get(g, 0.0) + cpu_after[g] - cpu_before[g]
    phase.machine_jiffies = (
        phase.machine_jiffies[0] + machine_after[0] - machine_before[0],
        phase.machine_jiffies[1] + machine_after[1] - machine_before[1],
    )
    first_block = phase.load == (0.0, 0.0)
    phase.load = (load_before if first_block else phase.load[0], os.getloadavg()[0])
    return phase


# -- CPU accounting (Linux /proc; zeros elsewhere) -------------------------------------

_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` (all its threads), 0 when unreadable."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


def children_of(pid: int) -> list[int]:
    """Direct children of ``pid`` (e.g. a Celery node's pool processes)."""
    found = []
    for entry in Path("/proc").glob("[0-9]*/stat"):
        try:
            stat = entry.read_text()
        except OSError:
            continue
        if int(stat[stat.rindex(")") + 2 :].split()[1]) == pid:
            found.append(int(entry.parent.name))
    return found


def cpu_snapshot(groups: dict[str, list[int]]) -> dict[str, float]:
    return {name: sum(process_cpu_s(pid) for pid in pids) for name, pids in groups.items()}


def machine_cpu() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine since boot, from /proc/stat."""
    try:
        first = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except OSError:
        return (0.0, 0.0)
    values = [float(v) for v in first[:8]]
    idle = values[3] + values[4]  # idle + iowait
    return (sum(values) - idle, sum(values))


def stack_cpu_groups(stack: Stack) -> dict[str, list[int]]:
    """Redis, the Celery node processes, and their pool processes."""
    nodes = [p.pid for p in stack.processes if p.name.startswith("worker")]
    return {
        "redis": [p.pid for p in stack.processes if p.name == "redis"],
        "nodes": nodes,
        "pool": [child for node in nodes for child in children_of(node)],
    }


# -- worker-side timings from the bso worker logs ---------------------------------------

_HANDLED = re.compile(r'msg="event handled".*?\bkind=(\w+).*?\bms=([\d.]+)')


def log_offsets(paths: Sequence[Path]) -> dict[Path, int]:
    return {p: p.stat().st_size if p.exists() else 0 for p in paths}


def worker_times(offsets: dict[Path, int]) -> dict[str, list[float]]:
    """``ms`` of every "event handled" line written since ``offsets``, per event kind."""
    times: dict[str, list[float]] = {}
    for path, offset in offsets.items():
        with path.open("rb") as log:
            log.seek(offset)
            for line in log.read().decode(errors="replace").splitlines():
                if match := _HANDLED.search(line):
                    times.setdefault(match.group(1), []).append(float(match.group(2)))
    return times


# -- the bare-task baseline --------------------------------------------------------------


def start_bare_workers(
    stack: Stack, data_dir: Path, count: int, pool: WorkerPool
) -> list[ManagedProcess]:
    """``count`` Celery nodes (bare1..N) running only the bare task, as bso's nodes run:
    the stack's settings, ``pool``, one task at a time each, one SQLite file shared by all."""
    env = {
        **os.environ,
        **stack.settings.to_env(),
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(SCRIPTS), os.environ.get("PYTHONPATH")])),
        DB_ENV: str(data_dir / "bare.sqlite3"),
    }
    processes: list[ManagedProcess] = []
    try:
        for i in range(1, count + 1):
            name = f"bare{i}"
            argv = [
                sys.executable, "-m", "celery", "-A", "bench_baseline_task", "worker",
                "--queues", BENCH_QUEUE,
                "--concurrency", "1",
                "--pool", pool,
                "--hostname", f"{name}@%h",
                "--without-gossip",
                "--without-mingle",
                "--loglevel", stack.settings.log_level,
            ]  # fmt: skip
            processes.append(spawn(name, argv, data_dir / "logs", env, data_dir))
        wait_for_workers(stack.settings, [node_name(p.name) for p in processes], processes)
    except BaseException:
        stop_together(processes)
        raise
    return processes


class BareClient:
    """Publishes the bare task and waits for its reply exactly as ``ServiceClient`` does:
    subscribed to the reply's announcement first, the event's JSON in a Celery
    message LPUSHed onto the task's queue, pipelined with the first GETDEL of its
    reply key, then woken by the announcement (``RedisPublisher``,
    ``RedisReplyBackend.watch``)."""

    def __init__(self, broker_url: str) -> None:
        self.replies = RedisReplyBackend(broker_url)
        self.publisher = RedisPublisher(broker_url, client=self.replies.redis, queue=BENCH_QUEUE)

    def round_trip_ms(self, number: int) -> float:
        event = EpochReport(
            job_id="bare-job", trial_number=1, epoch=number, time_s=1.0, energy_j=1.0, metric=0.5
        )
        started = time.perf_counter()
        raw = event.model_dump(mode="json")
        key = keys.reply_key_for(raw)
        assert key is not None
        payload = json.dumps(raw, separators=(",", ":"))
        with self.replies.watch(key) as watch:
            text = self.publisher.publish_and_pop(
                TASK_NAME,
                payload,
                f"{event.event_id}.1",
                replies=self.replies,
                key=key,
                timeout_s=CALL_TIMEOUT_S,
                watch=watch,
            )
        if text is None:
            raise TimeoutError(f"no reply from the bare task in {CALL_TIMEOUT_S:g} s")
        json.loads(text)
        return (time.perf_counter() - started) * 1000

    def latencies(self, calls: int) -> list[float]:
        return [self.round_trip_ms(i + 1) for i in range(calls)]

    def loop(self, calls: int, timed: Timed, halt: threading.Event) -> int:
        """``calls`` round trips back to back, each timed as an ``epoch`` call (a :data:`Loop`)."""
        for i in range(calls):
            if halt.is_set():
                break
            timed("epoch", partial(self.round_trip_ms, i + 1))
        return 0

    def close(self) -> None:
        self.publisher.close()
        self.replies.close()


@dataclass
class BareNodes:
    """The bare-task baseline beside one bso stack: as many nodes, same broker, same pool."""

    broker_url: str
    processes: list[ManagedProcess]
    client: BareClient
    """For the C=1 blocks interleaved with bso's rounds."""
    redis_pids: list[int]

    def cpu_groups(self) -> dict[str, list[int]]:
        nodes = [p.pid for p in self.processes]
        return {
            "redis": self.redis_pids,
            "nodes": nodes,
            "pool": [child for node in nodes for child in children_of(node)],
        }


# -- systems -----------------------------------------------------------------------------


@dataclass
class Plan:
    workers: list[int]
    concurrency: list[int]
    rounds: int
    min_trials: int
    epochs: int
    bare_calls: int
    phase_timeout_s: float
    task_events: bool
    policy: PolicyName
    pool: WorkerPool = "solo"

    def rounds_for(self, concurrency: int) -> int:
        """At least ``rounds``, and at least ``min_trials`` trials in all (more samples at C=1)."""
        return max(self.rounds, math.ceil(self.min_trials / concurrency))

    def bare_calls_per_thread(self, concurrency: int) -> int:
        """Round trips per thread in the bare phase at ``concurrency``: as many as each bso
        job sends epoch reports at that C when no trial stops early (rounds x epochs)."""
        return self.rounds_for(concurrency) * self.epochs


@dataclass
class System:
    """One running system under test."""

    name: str
    workers: int | None
    new_job: Callable[[str, int, int], JobDriver]
    """(job tag, seed, epochs) -> a job with its own connections."""
    cpu_groups: Callable[[], dict[str, list[int]]]
    logs: list[Path] = field(default_factory=list)
    """bso worker logs, for the time spent inside the tasks."""
    bare: BareNodes | None = None
    """The bare-task baseline on this system's broker (bso only)."""


def start_bso(plan: Plan, workers: int, work_dir: Path, run_id: str, cleanup: ExitStack) -> System:
    """A bso stack (and as many bare-task nodes on its broker); ``cleanup`` stops them."""
    data_dir = work_dir / f"bso-{workers}w"
    settings = WorkerSettings(task_events=plan.task_events)
    config = StackConfig(
        data_dir=data_dir,
        workers=workers,
        pool=plan.pool,
        flower=False,
        beat=False,
        settings=settings,
        default_tenant_limits=LOAD_GENERATOR_LIMITS,
    )
    print(
        f"starting bso: {workers} worker node(s), {plan.pool} pool, 1 task at a time each, "
        f"SQLite{' (and as many bare-task nodes)' if plan.bare_calls else ''} ...",
        flush=True,
    )
    stack = Stack(config).start()
    cleanup.callback(stack.stop)
    broker = stack.settings.broker_url
    bare = None
    if plan.bare_calls:
        bare_workers = start_bare_workers(stack, data_dir, workers, plan.pool)
        cleanup.callback(stop_together, bare_workers)
        client = BareClient(broker)
        cleanup.callback(client.close)
        redis_pids = [p.pid for p in stack.processes if p.name == "redis"]
        bare = BareNodes(broker, bare_workers, client, redis_pids)

    def new_job(tag: str, seed: int, epochs: int) -> JobDriver:
        return BsoJob(
            broker, stack.api_key, f"{run_id}-{tag}", seed=seed, epochs=epochs, policy=plan.policy
        )

    return System(
        "bso",
        workers,
        new_job,
        lambda: stack_cpu_groups(stack),
        [data_dir / "logs" / f"worker{i}.log" for i in range(1, workers + 1)],
        bare,
    )


ZEUS_SERVER = """
import sys
host, port, db = sys.argv[1], int(sys.argv[2]), sys.argv[3]
from sqlalchemy import create_engine
from zeus.optimizer.batch_size.server.database.schema import Base
engine = create_engine("sqlite:///" + db)
Base.metadata.create_all(engine)  # Zeus ships no migrations for its tables
engine.dispose()
import uvicorn
uvicorn.run("zeus.optimizer.batch_size.server.router:app", host=host, port=port)
"""
"""Run in the Zeus venv: create Zeus's tables in a fresh SQLite file, then serve its app
the way its docs do (uvicorn defaults: one process, access log on)."""


def start_zeus(zeus_python: Path, work_dir: Path, run_id: str, cleanup: ExitStack) -> System:
    print("starting Zeus 0.16.0 BSO server (uvicorn, 1 process, SQLite/aiosqlite) ...", flush=True)
    zeus_dir = work_dir / "zeus"
    zeus_dir.mkdir(parents=True, exist_ok=True)
    db = zeus_dir / "zeus.sqlite3"
    port = free_port(HOST)
    env = {
        **os.environ,
        "ZEUS_BSO_DATABASE_URL": f"sqlite+aiosqlite:///{db}",
        "ZEUS_BSO_LOG_LEVEL": "INFO",
        "ZEUS_BSO_ECHO_SQL": "false",
    }
    argv = [str(zeus_python), "-c", ZEUS_SERVER, HOST, str(port), str(db)]
    process = spawn("zeus", argv, zeus_dir / "logs", env, zeus_dir)
    cleanup.callback(stop_together, [process])
    url = f"http://{HOST}:{port}/openapi.json"
    wait_until(lambda: http_ok(url), f"zeus server at {url}", 120.0, [process])

    def new_job(tag: str, seed: int, epochs: int) -> JobDriver:
        # One id prefix per job, as separate recurring jobs have: Zeus serializes
        # registrations per prefix.
        prefix = f"{run_id}-zeus-{tag}"
        return ZeusJob(port, f"{prefix}-job", prefix, seed=seed, epochs=epochs)

    return System("zeus", None, new_job, lambda: {"server": [process.pid]})


def warm_up(system: System) -> None:
    """One short unmeasured round: imports, connections, statement caches of every process."""
    phase = Phase("warmup", None, 4, 1, 3)
    jobs = [system.new_job(f"warm-{i}", i, 3) for i in range(4)]
    try:
        run_phase(phase, jobs, 60.0)
    finally:
        for job in jobs:
            job.close()
    if phase.errors:
        raise RuntimeError(f"{system.name} warm-up failed: {phase.errors[0]}")
    if system.bare is not None:
        # Enough callers at once that every bare node gets tasks, then the C=1 client.
        warm = Phase("warmup", None, 4, 5, 1)
        run_bare(warm, system.bare, max(4, 2 * len(system.bare.processes)), 5, 60.0)
        if warm.errors:
            raise RuntimeError(f"bare-task warm-up failed: {warm.errors[0]}")
        system.bare.client.latencies(10)


def run_bare(phase: Phase, nodes: BareNodes, threads: int, calls: int, timeout_s: float) -> Phase:
    """``threads`` callers at once, each with its own ``BareClient``, ``calls`` round trips each."""
    clients = [BareClient(nodes.broker_url) for _ in range(threads)]
    try:
        loops = [partial(client.loop, calls) for client in clients]
        return run_loops(phase, loops, timeout_s, nodes.cpu_groups())
    finally:
        for client in clients:
            with contextlib.suppress(Exception):
                client.close()


def measure_bare(system: System, plan: Plan, c: int) -> Phase | None:
    """The bare task as its own closed-loop load at ``c``, right after bso's phase at ``c``.

    ``c`` callers, each doing :meth:`Plan.bare_calls_per_thread` round trips back
    to back; recorded as ``epoch`` calls, so the phase's "epoch reports/s" is its
    round trips per second.
    """
    if system.bare is None:
        return None
    calls = plan.bare_calls_per_thread(c)
    phase = Phase("bare", system.workers, c, calls, 1)
    return run_bare(phase, system.bare, c, calls, plan.phase_timeout_s)


def measure(system: System, plan: Plan, c: int, bare: dict[int, list[float]]) -> Phase:
    """One phase of ``c`` jobs on ``system``.

    At C=1 on bso, the bare-task baseline runs in blocks between the rounds, so
    that both see the same machine (whose load, when shared, drifts by the minute).
    """
    phase = Phase(system.name, system.workers, c, plan.rounds_for(c), plan.epochs)
    jobs = [system.new_job(f"c{c}-{i}", i, plan.epochs) for i in range(c)]
    offsets = log_offsets(system.logs)
    try:
        if c == 1 and system.bare is not None and system.workers is not None:
            per_block = math.ceil(plan.bare_calls / phase.rounds)
            samples = bare.setdefault(system.workers, [])
            for _ in range(phase.rounds):
                samples += system.bare.client.latencies(per_block)
                left = plan.phase_timeout_s - phase.wall_s
                run_phase(phase, jobs, left, system.cpu_groups(), rounds=1)
                if phase.truncated or phase.errors:
                    break
        else:
            run_phase(phase, jobs, plan.phase_timeout_s, system.cpu_groups())
    finally:
        for job in jobs:
            with contextlib.suppress(Exception):
                job.close()
    if system.logs:
        time.sleep(0.2)  # let the last log lines land
        phase.worker_ms = worker_times(offsets)
    return phase


def check_zeus_python(zeus_python: Path) -> str | None:
    """Why the Zeus server cannot run from ``zeus_python``, or None when it can."""
    if not zeus_python.exists():
        return f"{zeus_python} does not exist; run scripts/setup_zeus_venv.sh"
    probe = subprocess.run(
        [str(zeus_python), "-c", "import uvicorn, fastapi, aiosqlite, greenlet, zeus"],
        capture_output=True,
        text=True,
        check=False,
    )
    if probe.returncode != 0:
        return (
            f"{zeus_python} cannot import the Zeus server's packages "
            f"({probe.stderr.strip().splitlines()[-1:]}); run scripts/setup_zeus_venv.sh"
        )
    return None


# -- printing ----------------------------------------------------------------------------


def fmt_ms(value: float) -> str:
    if math.isnan(value):
        return "-"
    return f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def print_phase(phase: Phase) -> None:
    status = " TRUNCATED (phase timeout)" if phase.truncated else ""
    p50, _, p99 = percentiles(phase.latencies_ms["epoch"])
    if phase.system == "bare":
        what = f"{phase.rounds} calls each"
        rate, latency = "calls/s", "p50/p99"
    else:
        what = f"{phase.rounds} rounds"
        rate, latency = "epoch reports/s", "epoch p50/p99"
    print(
        f"  {phase.label:<8} C={phase.concurrency:<3} {what}: {phase.events} calls in "
        f"{phase.wall_s:.1f} s, {phase.epochs_per_s:.1f} {rate}, {latency} {fmt_ms(p50)}/"
        f"{fmt_ms(p99)} ms, load {phase.load[0]:.1f}->{phase.load[1]:.1f}{status}",
        flush=True,
    )
    if phase.events and phase.cpu_s:
        ours = sum(phase.cpu_s.values())
        parts = ", ".join(f"{g} {s * 1000 / phase.events:.2f}" for g, s in phase.cpu_s.items())
        cpus = os.cpu_count() or 1
        print(
            f"    CPU ms per call: {parts}; ours use {ours / phase.wall_s / cpus:.0%} of "
            f"{cpus} CPUs, the machine was {phase.machine_busy:.0%} busy",
            flush=True,
        )
    for error in phase.errors[:3]:
        print(f"    error: {error}", flush=True)


def triple(values: Sequence[float]) -> str:
    return " / ".join(fmt_ms(v) for v in percentiles(values))


def print_table(phases: Sequence[Phase]) -> None:
    print(
        "\nLatency per event type, ms (p50 / p95 / p99), measured by the caller; "
        "worker ms: time inside the bso task (decode, store transaction, reply push), p50.\n"
        "bare Nw: the bare Celery task (one SQLite commit + one reply) on as many nodes as "
        "bso Nw, same broker and pool, C callers doing round trips back to back; its rounds "
        "are round trips per caller, its round trips/s are under epoch reports/s and its "
        "latency under epoch:\n"
    )
    print(
        "| system | C | rounds | epoch reports/s | register | next_trial | epoch | end "
        "| worker ms (epoch) |"
    )
    print("|---|--:|--:|--:|---|---|---|---|--:|")
    for p in phases:
        worker = percentiles(p.worker_ms.get("epoch", []))[0]
        flag = " (truncated)" if p.truncated else ""
        errors = f" ({len(p.errors)} errors)" if p.errors else ""
        print(
            f"| {p.label}{flag}{errors} | {p.concurrency} | {p.rounds} | {p.epochs_per_s:.1f} | "
            + " | ".join(triple(p.latencies_ms[k]) for k in KINDS)
            + f" | {fmt_ms(worker)} |"
        )
    if not any(p.cpu_s for p in phases):
        return
    groups = ["client", "redis", "nodes", "pool", "server"]
    print(
        "\nCPU ms per call, by process group (client: this process, all jobs; nodes: Celery "
        "node processes, bso's or the bare task's; pool: their prefork pool processes; "
        "server: uvicorn), and how busy the machine was:\n"
    )
    print("| system | C | " + " | ".join(groups) + " | total | ours / machine busy |")
    print("|---|--:|" + "--:|" * (len(groups) + 2))
    cpus = os.cpu_count() or 1
    for p in phases:
        if not p.events or not p.cpu_s:
            continue
        per_call = {g: v * 1000 / p.events for g, v in p.cpu_s.items()}
        ours = sum(p.cpu_s.values()) / p.wall_s / cpus if p.wall_s else math.nan
        print(
            f"| {p.label} | {p.concurrency} | "
            + " | ".join(f"{per_call[g]:.2f}" if g in per_call else "-" for g in groups)
            + f" | {sum(per_call.values()):.2f} | {ours:.0%} / {p.machine_busy:.0%} |"
        )


def verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def print_targets(phases: Sequence[Phase], bare: dict[int, list[float]]) -> None:
    print("\nTargets (printed, not asserted):")

    def find(system: str, workers: int | None, c: int) -> Phase | None:
        return next(
            (
                p
                for p in phases
                if p.system == system and p.workers == workers and p.concurrency == c
            ),
            None,
        )

    zeus = find("zeus", None, 32)
    bso2 = find("bso", 2, 32)
    if zeus is not None and bso2 is not None:
        ratio = bso2.epochs_per_s / zeus.epochs_per_s if zeus.epochs_per_s else math.nan
        print(
            f"  C=32, 2 workers: epoch reports/s  bso {bso2.epochs_per_s:.1f} vs Zeus "
            f"{zeus.epochs_per_s:.1f} = {ratio:.2f}x (target >= {TARGET_THROUGHPUT_RATIO:g}x): "
            f"{verdict(ratio >= TARGET_THROUGHPUT_RATIO)}"
        )
        b99 = percentiles(bso2.latencies_ms["epoch"])[2]
        z99 = percentiles(zeus.latencies_ms["epoch"])[2]
        print(
            f"  C=32, 2 workers: epoch p99  bso {fmt_ms(b99)} ms vs Zeus {fmt_ms(z99)} ms = "
            f"{b99 / z99:.2f} (target <= {TARGET_P99_RATIO:g}): "
            f"{verdict(b99 / z99 <= TARGET_P99_RATIO)}"
        )
    else:
        print("  C=32 vs Zeus: n/a (this run has no C=32 phase for both bso 2w and Zeus)")
    print_floor(find("bare", 2, 32), bso2, zeus)
    for workers, samples in sorted(bare.items()):
        phase = find("bso", workers, 1)
        if phase is None or not samples:
            continue
        b50 = percentiles(phase.latencies_ms["epoch"])[0]
        all50 = percentiles([ms for k in KINDS for ms in phase.latencies_ms[k]])[0]
        t50 = percentiles(samples)[0]
        print(
            f"  C=1, {workers} worker(s): bso epoch p50 {fmt_ms(b50)} ms / bare task p50 "
            f"{fmt_ms(t50)} ms = {b50 / t50:.2f}x (all events: {all50 / t50:.2f}x) "
            f"(target <= {TARGET_BARE_RATIO:g}x): {verdict(b50 / t50 <= TARGET_BARE_RATIO)}"
        )
    zeus1 = find("zeus", None, 1)
    if zeus1 is not None:
        print(f"  (Zeus C=1 epoch p50: {fmt_ms(percentiles(zeus1.latencies_ms['epoch'])[0])} ms)")


def print_floor(bare: Phase | None, bso: Phase | None, zeus: Phase | None) -> None:
    """The bare task at the p99 target's point (C=32, 2 workers): the floor under that target."""
    where = "C=32, 2 workers"
    if bare is None or not bare.latencies_ms["epoch"]:
        print(f"  {where}: bare-task floor n/a (this run has no C=32 phase of bare 2w)")
        return
    r99 = percentiles(bare.latencies_ms["epoch"])[2]
    line = (
        f"  {where}: bare Celery task (one commit + one reply, same broker and pool): "
        f"{bare.epochs_per_s:.1f} calls/s, p99 {fmt_ms(r99)} ms"
    )
    if zeus is not None and zeus.latencies_ms["epoch"]:
        z99 = percentiles(zeus.latencies_ms["epoch"])[2]
        limit = z99 * TARGET_P99_RATIO
        # Closed loop (Little's law): mean latency = C / throughput.
        needed = bare.concurrency / (limit / 1000) if limit > 0 else math.inf
        line += (
            f"; the p99 target for bso is <= {fmt_ms(limit)} ms (Zeus p99 {fmt_ms(z99)} ms x "
            f"{TARGET_P99_RATIO:g}), which at C={bare.concurrency} closed-loop takes at least "
            f"~{needed:.0f} calls/s (mean latency = C / throughput): "
        )
        if r99 <= limit:
            line += "the bare task meets it, so the target is above this floor"
        else:
            line += (
                "even the bare task MISSES it, so no pipeline of one Celery task per event "
                "can meet it with 2 nodes of this pool and broker on this machine"
            )
    else:
        line += "; no Zeus run, so no p99 target to hold it against"
    print(line)
    if bso is not None and bso.latencies_ms["epoch"] and bare.epochs_per_s:
        b99 = percentiles(bso.latencies_ms["epoch"])[2]
        print(
            f"    (bso 2w there: {bso.epochs_per_s:.1f} epoch reports/s = "
            f"{bso.epochs_per_s / bare.epochs_per_s:.2f}x the bare task's calls/s; epoch p99 "
            f"{fmt_ms(b99)} ms = {b99 / r99:.2f}x the bare task's)"
        )


# -- main --------------------------------------------------------------------------------


def parse_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"need positive integers, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0] if __doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="short smoke run (C=1,4; 1 worker)")
    parser.add_argument("--workers", type=parse_list, help="bso worker counts (default 1,2)")
    parser.add_argument("--concurrency", type=parse_list, help="C values (default 1,8,32)")
    parser.add_argument("--rounds", type=int, help="rounds per job (default 3)")
    parser.add_argument(
        "--min-trials", type=int, help="at least this many trials per phase (default 8)"
    )
    parser.add_argument("--epochs", type=int, help="epoch reports per trial (default 20)")
    parser.add_argument(
        "--bare-calls",
        type=int,
        help="bare-task round trips interleaved with bso's C=1 rounds (default 200); "
        "0: no bare-task baseline at all",
    )
    parser.add_argument(
        "--phase-timeout", type=float, default=120.0, help="seconds before a phase is cut short"
    )
    parser.add_argument(
        "--task-events",
        action="store_true",
        help="workers publish Celery task events (for Flower; off by default here)",
    )
    parser.add_argument(
        "--policy",
        choices=["zeus", "bso"],
        default="zeus",
        help="bso's decision policy: 'zeus' takes Zeus's decisions, so both services get "
        "the same calls; 'bso' stops some explorations early (fewer epochs per trial)",
    )
    parser.add_argument(
        "--pool",
        choices=WORKER_POOLS,
        default="solo",
        help="Celery pool of bso's worker nodes and of the bare-task nodes (one task at a "
        "time per node either way)",
    )
    parser.add_argument("--no-zeus", action="store_true", help="skip the Zeus reference")
    parser.add_argument("--zeus-python", type=Path, default=ZEUS_PYTHON)
    parser.add_argument(
        "--work-dir", type=Path, help="where databases and logs go (default: a temp dir, removed)"
    )
    return parser


def make_plan(args: argparse.Namespace) -> Plan:
    quick = args.quick

    def pick(value: Any, full: Any, smoke: Any) -> Any:
        return value if value is not None else (smoke if quick else full)

    return Plan(
        workers=pick(args.workers, [1, 2], [1]),
        concurrency=pick(args.concurrency, [1, 8, 32], [1, 4]),
        rounds=pick(args.rounds, 3, 1),
        min_trials=pick(args.min_trials, 8, 2),
        epochs=pick(args.epochs, 20, 5),
        bare_calls=pick(args.bare_calls, 200, 30),
        phase_timeout_s=args.phase_timeout,
        task_events=args.task_events,
        policy=args.policy,
        pool=args.pool,
    )


class _RetryCounter(logging.Handler):
    """Counts ServiceClient's "sending the same event again" warnings (should stay 0)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1


def _raise_interrupt(_signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def work_directory(path: Path | None) -> Iterator[Path]:
    if path is not None:
        path.mkdir(parents=True, exist_ok=True)
        yield path.resolve()
        return
    temp = Path(tempfile.mkdtemp(prefix="bso-bench-"))
    try:
        yield temp
    finally:
        shutil.rmtree(temp, ignore_errors=True)


def code_line() -> str:
    """The commit measured, and whether the service's code differs from it (a dirty tree)."""
    try:
        head = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain", "--", "bso", "client", "workers"],
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return "code: not a git checkout"
    state = f"{len(dirty)} uncommitted files in bso/ client/ workers/" if dirty else "clean"
    return f"code: commit {head}, {state}"


def machine_line() -> str:
    load = ", ".join(f"{v:.2f}" for v in os.getloadavg())
    return f"{socket.gethostname()}: {os.cpu_count()} CPUs, load average {load}"


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    plan = make_plan(args)
    zeus_problem = None if args.no_zeus else check_zeus_python(args.zeus_python)
    if zeus_problem is not None:
        print(f"bench_pipeline: {zeus_problem} (or pass --no-zeus)", file=sys.stderr)
        return 2
    retries = _RetryCounter()
    logging.getLogger("bso_client.transport").addHandler(retries)
    # SIGINT explicitly too: a shell starts background jobs with SIGINT ignored.
    previous = {s: signal.signal(s, _raise_interrupt) for s in (signal.SIGINT, signal.SIGTERM)}
    run_id = f"b{os.getpid()}"
    started = time.monotonic()
    phases: list[Phase] = []
    bare: dict[int, list[float]] = {}
    print(
        f"bench_pipeline: {machine_line()}\n  {code_line()}\n"
        f"  workers {plan.workers}, C {plan.concurrency}, {plan.epochs} epochs per trial, "
        f"rounds per job: "
        + ", ".join(f"C={c}: {plan.rounds_for(c)}" for c in plan.concurrency)
        + f"; bso policy {plan.policy}; {plan.pool} pool; "
        f"task events {'on' if plan.task_events else 'off'}",
        flush=True,
    )
    interrupted = False
    try:
        with work_directory(args.work_dir) as work_dir, ExitStack() as cleanup:
            systems = [
                start_bso(plan, workers, work_dir, run_id, cleanup) for workers in plan.workers
            ]
            if not args.no_zeus:
                systems.append(start_zeus(args.zeus_python, work_dir, run_id, cleanup))
            for system in systems:
                warm_up(system)
            for c in plan.concurrency:
                print(f"\nC={c}: {plan.rounds_for(c)} rounds per job", flush=True)
                for system in systems:
                    phase = measure(system, plan, c, bare)
                    phases.append(phase)
                    print_phase(phase)
                    if c == 1 and system.workers in bare:
                        samples = bare[system.workers]
                        print(
                            f"  bare task, interleaved with those rounds: {len(samples)} calls, "
                            f"p50 / p95 / p99 {triple(samples)} ms",
                            flush=True,
                        )
                    if (bare_phase := measure_bare(system, plan, c)) is not None:
                        phases.append(bare_phase)
                        print_phase(bare_phase)
            print("\nstopping ...", flush=True)
    except KeyboardInterrupt:
        interrupted = True
        print("\nbench_pipeline: interrupted; everything it started is stopped", file=sys.stderr)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        logging.getLogger("bso_client.transport").removeHandler(retries)
    print_table(phases)
    print(
        "\n(bare Celery task, C=1, one SQLite commit + one SET EX reply, in blocks "
        "between bso's C=1 rounds: p50 / p95 / p99 "
        + "; ".join(f"{w}w stack: {triple(s)} ms" for w, s in sorted(bare.items()))
        + ")"
    )
    print_targets(phases, bare)
    errors = sum(len(p.errors) for p in phases)
    early = sum(p.early_stops for p in phases)
    print(
        f"\nclient retries {retries.count}, errors {errors}, trials stopped early {early}; "
        f"total {time.monotonic() - started:.0f} s; {machine_line()}"
    )
    if interrupted:
        return 130
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
