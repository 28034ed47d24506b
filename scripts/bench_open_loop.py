"""Latency under an open-loop load: Poisson arrivals at fixed offered rates, bso against Zeus.

``scripts/bench_pipeline.py`` is closed-loop: each job sends its next event when
the last one is answered, so a slow service slows its own load down and the
latency it reports is mostly queue length (C / throughput).  Here the load does
not wait: epoch reports arrive at times drawn in advance (exponential gaps at
rate lambda, a Poisson process), and each one's latency is measured from its
*scheduled* arrival to its reply, so time spent waiting behind a slow call
counts (no coordinated omission).

The arrivals are spread round-robin over ``--jobs`` pre-registered jobs (32),
each with a running trial.  A job is one thread with its own connections, as a
training process is, and it cannot have two reports of one trial in flight: a
report due while its job still waits for the previous reply waits too, and that
wait is part of its latency.  So at most ``--jobs`` calls are ever in flight
and a system past saturation shows it as growing latency, not as a lower
offered rate.  A report still not sent ``--max-lag`` seconds after its
scheduled time is dropped and counts as an infinitely slow call.  Each report
advances its trial's epoch; after the ``--epochs``-th (50) the trial has met
its target, and the job ends it and asks for the next one (two more calls,
timed apart, that delay that job's next report if it is already due).

Per rate: ``--warmup`` seconds (1) of arrivals that are not measured, then
``--duration`` seconds (8) that are.  Offered: reports scheduled in the measured
window per second; achieved: reports answered inside it per second.  A system
*keeps up* at a rate when achieved >= 95% of offered, with nothing dropped and
no errors; it *holds* a rate when it keeps up with p99 <= 50 ms.  A system's
ladder stops after the first rate it does not keep up with (``--keep-going``
runs it to the end).  Percentiles are nearest-rank: on fewer than 1000 calls
the p99.9 is the slowest call.

Systems, all started first, then measured rate by rate, one after the other at
each rate (the same arrival times for all, seeded per rate):

* bso through ``bso_workers.stack.Stack`` (as ``bso up``: its own Redis, N solo
  worker nodes, migrations; no Flower, no beat) for each ``--workers`` count
  (1, 2, 4) and ``--databases`` (SQLite file; PostgreSQL: a private throwaway
  cluster started with initdb / pg_ctl as ``scripts/soak.py`` does, or
  databases created on the server ``--postgres-url`` names); the jobs use
  ``ServiceClient`` on the client's Redis URL, bso's policy ``zeus``;
* Zeus 0.16.0's FastAPI server (uvicorn, SQLite via aiosqlite) from
  ``.venv-zeus``, as in bench_pipeline, over one keep-alive connection per job.

Zeus's saturation rate is the highest rate it keeps up with; once known, twice
it is added to the ladder, and the goal line prints bso's p99 there.  Scale-out
is the highest achieved rate of 4 workers over that of 1, on PostgreSQL.

    .venv/bin/python scripts/bench_open_loop.py                 # full run, ~10 min
    .venv/bin/python scripts/bench_open_loop.py --quick         # smoke run, ~1.5 min
    .venv/bin/python scripts/bench_open_loop.py --rates 50,100 --workers 2 --no-zeus

Ctrl-C or SIGTERM stops the run and everything it started (the private
PostgreSQL cluster included); its other children die with it even if it is
killed outright (``PR_SET_PDEATHSIG``).  No figure is asserted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field, replace
from fractions import Fraction
from functools import partial
from pathlib import Path
from typing import Any, Literal

import numpy as np

SCRIPTS = Path(__file__).resolve().parent
if str(SCRIPTS) not in sys.path:  # bench_pipeline and soak_service, also from the tests
    sys.path.insert(0, str(SCRIPTS))

import bench_pipeline as bp  # noqa: E402

from bso_workers.settings import WorkerSettings  # noqa: E402
from bso_workers.stack import Stack, StackConfig  # noqa: E402
from bso_workers.tenant_keys import LOAD_GENERATOR_LIMITS  # noqa: E402

Database = Literal["sqlite", "postgres"]
DATABASES: tuple[Database, ...] = ("sqlite", "postgres")
HELD_P99_MS = 50.0
"""A system holds a rate when it keeps up with a p99 at most this."""
GOAL_P99_MS = 20.0
"""The issue's goal: bso's p99 at twice Zeus's saturation rate."""
GOAL_FACTOR = 2.0
KEEP_UP = 0.95
"""Keeping up: achieved >= this share of offered (and nothing dropped, no error)."""
DEFAULT_RATES = (50, 100, 150, 200, 300, 400, 600, 800, 1000)
QUICK_RATES = (20, 100, 300)


# -- pure parts: schedule, percentiles, summaries, selections ------------------------------


def poisson_schedule(rate: float, duration_s: float, rng: np.random.Generator) -> list[float]:
    """Arrival times in [0, duration_s) of a Poisson process of ``rate`` per second."""
    if rate <= 0 or duration_s <= 0:
        return []
    times: list[float] = []
    now = 0.0
    batch = max(16, math.ceil(rate * duration_s * 1.2))
    while True:
        for gap in rng.exponential(1.0 / rate, batch):
            now += float(gap)
            if now >= duration_s:
                return times
            times.append(now)


def schedule_rng(seed: int, rate: float) -> np.random.Generator:
    """The arrivals' RNG at ``rate``: the same for every system, so all get the same times."""
    return np.random.default_rng([seed, round(rate * 1000)])


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank ``q``-th percentile: the smallest value with at least q% of the values
    at or below it (NaN for no values).  On n values, p99.9 is the maximum while n < 1000."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = math.ceil(Fraction(str(q)) / 100 * len(ordered))  # exact: no 999.0000000001
    return ordered[min(max(rank, 1), len(ordered)) - 1]


Outcome = Literal["ok", "dropped", "error"]


@dataclass(frozen=True)
class Call:
    """One scheduled epoch report; times in seconds from the step's start."""

    scheduled: float
    started: float
    ended: float
    outcome: Outcome
    idle: bool
    """The job was idle at the scheduled time (so ``started - scheduled`` is the client's lag)."""


@dataclass
class Step:
    """What one (system, rate) measured; latencies in ms, dropped and failed calls as inf."""

    system: str
    rate: float
    offered_per_s: float
    achieved_per_s: float
    calls: int
    p50_ms: float
    p99_ms: float
    p999_ms: float
    dropped: int
    errors: int
    client_lag_p99_ms: float
    machine_busy: float = math.nan
    client_cpu: float = math.nan
    """CPU of this process (all jobs) as a share of one CPU."""
    other_p50_ms: dict[str, float] = field(default_factory=dict)
    error_samples: list[str] = field(default_factory=list)

    @property
    def kept_up(self) -> bool:
        return (
            self.calls > 0
            and self.dropped == 0
            and self.errors == 0
            and self.achieved_per_s >= KEEP_UP * self.offered_per_s
        )

    def held(self, limit_ms: float = HELD_P99_MS) -> bool:
        return self.kept_up and self.p99_ms <= limit_ms


def summarize(
    system: str, rate: float, calls: Sequence[Call], warmup_s: float, duration_s: float
) -> Step:
    """The step's figures over the calls scheduled in [warmup_s, warmup_s + duration_s)."""
    end = warmup_s + duration_s
    measured = [c for c in calls if warmup_s <= c.scheduled < end]
    answered = [c for c in calls if c.outcome == "ok" and warmup_s <= c.ended < end]
    latencies = [
        (c.ended - c.scheduled) * 1000 if c.outcome == "ok" else math.inf for c in measured
    ]
    lags = [(c.started - c.scheduled) * 1000 for c in measured if c.idle and c.outcome != "dropped"]
    return Step(
        system=system,
        rate=rate,
        offered_per_s=len(measured) / duration_s,
        achieved_per_s=len(answered) / duration_s,
        calls=len(measured),
        p50_ms=percentile(latencies, 50),
        p99_ms=percentile(latencies, 99),
        p999_ms=percentile(latencies, 99.9),
        dropped=sum(c.outcome == "dropped" for c in measured),
        errors=sum(c.outcome == "error" for c in measured),
        client_lag_p99_ms=percentile(lags, 99),
    )


def steps_of(steps: Sequence[Step], system: str) -> list[Step]:
    return [s for s in steps if s.system == system]


def highest_held(steps: Sequence[Step], limit_ms: float = HELD_P99_MS) -> float | None:
    """The highest rate held (kept up with p99 <= ``limit_ms``); None if none was."""
    return max((s.rate for s in steps if s.held(limit_ms)), default=None)


def saturation_rate(steps: Sequence[Step]) -> float | None:
    """The highest rate kept up with, when some higher rate was not; else None (unknown:
    it kept up with every rate measured, or with none)."""
    kept = [s.rate for s in steps if s.kept_up]
    failed = [s.rate for s in steps if not s.kept_up]
    if not kept or not failed or max(failed) < max(kept):
        return None
    return max(kept)


def first_failure(steps: Sequence[Step]) -> float | None:
    """The lowest rate not kept up with, None if every rate was."""
    return min((s.rate for s in steps if not s.kept_up), default=None)


def runs_at(steps: Sequence[Step], system: str, rate: float) -> bool:
    """Whether ``system`` is measured at ``rate``: only below the first rate it failed at."""
    failed = first_failure(steps_of(steps, system))
    return failed is None or rate < failed


def capacity(steps: Sequence[Step]) -> tuple[float, bool]:
    """(highest achieved rate, whether it is only a lower bound: the system kept up throughout)."""
    best = max((s.achieved_per_s for s in steps), default=math.nan)
    return best, bool(steps) and all(s.kept_up for s in steps)


def find_step(steps: Sequence[Step], system: str, rate: float) -> Step | None:
    return next((s for s in steps if s.system == system and math.isclose(s.rate, rate)), None)


# -- arguments -----------------------------------------------------------------------------


def parse_rates(text: str) -> list[float]:
    try:
        values = sorted({float(v) for v in text.split(",") if v.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"need rates like 50,100,200, got {text!r}") from None
    if not values or values[0] <= 0 or not all(math.isfinite(v) for v in values):
        raise argparse.ArgumentTypeError(f"need positive rates, got {text!r}")
    return values


def parse_databases(text: str) -> list[Database]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    found: list[Database] = [d for d in DATABASES if d in names]
    if not names or len(found) != len(set(names)):
        raise argparse.ArgumentTypeError(f"need some of {','.join(DATABASES)}, got {text!r}")
    return found


def positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"need a positive number, got {text!r}")
    return value


@dataclass
class Plan:
    rates: list[float]
    duration_s: float
    warmup_s: float
    workers: list[int]
    databases: list[Database]
    zeus: bool
    jobs: int
    epochs: int
    max_lag_s: float
    seed: int
    keep_going: bool

    def systems(self) -> list[str]:
        bso = [f"bso {d} {w}w" for d in self.databases for w in self.workers]
        return bso + (["zeus sqlite"] if self.zeus else [])

    def longest_s(self) -> float:
        """Upper bound of the measuring time: every system at every rate (startup apart)."""
        per_step = self.warmup_s + self.duration_s + 1.0
        return per_step * len(self.rates) * len(self.systems())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0] if __doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke run: rates {','.join(map(str, QUICK_RATES))}, 3 s each after 1 s of "
        "warm-up, 1 worker, 8 jobs",
    )
    parser.add_argument(
        "--rates", type=parse_rates, help=f"offered rates /s (default {DEFAULT_RATES})"
    )
    parser.add_argument("--duration", type=positive, help="measured seconds per rate (8)")
    parser.add_argument("--warmup", type=float, help="unmeasured seconds before each rate (1)")
    parser.add_argument("--workers", type=bp.parse_list, help="bso worker counts (1,2,4)")
    parser.add_argument(
        "--databases", type=parse_databases, default=list(DATABASES), help="bso's stores"
    )
    parser.add_argument("--no-zeus", action="store_true", help="skip the Zeus reference")
    parser.add_argument("--jobs", type=int, help="jobs the arrivals are spread over (32)")
    parser.add_argument("--epochs", type=int, default=50, help="epoch reports per trial")
    parser.add_argument(
        "--max-lag",
        type=positive,
        default=2.0,
        help="seconds after its scheduled time past which an unsent report is dropped",
    )
    parser.add_argument("--seed", type=int, default=1, help="seed of the arrival times")
    parser.add_argument(
        "--keep-going",
        action="store_true",
        help="measure every rate, also past the first one a system does not keep up with",
    )
    parser.add_argument(
        "--postgres-url",
        help="a PostgreSQL server to create the benchmark's databases on (e.g. "
        "postgresql+psycopg://postgres@127.0.0.1:5432/postgres) instead of a private cluster",
    )
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    parser.add_argument("--zeus-python", type=Path, default=bp.ZEUS_PYTHON)
    parser.add_argument(
        "--work-dir", type=Path, help="where databases and logs go (default: a temp dir, removed)"
    )
    return parser


def make_plan(args: argparse.Namespace) -> Plan:
    quick: bool = args.quick

    def pick(value: Any, full: Any, smoke: Any) -> Any:
        return value if value is not None else (smoke if quick else full)

    plan = Plan(
        rates=pick(args.rates, [float(r) for r in DEFAULT_RATES], [float(r) for r in QUICK_RATES]),
        duration_s=pick(args.duration, 8.0, 3.0),
        warmup_s=pick(args.warmup, 1.0, 1.0),
        workers=pick(args.workers, [1, 2, 4], [1]),
        databases=args.databases,
        zeus=not args.no_zeus,
        jobs=pick(args.jobs, 32, 8),
        epochs=args.epochs,
        max_lag_s=args.max_lag,
        seed=args.seed,
        keep_going=args.keep_going,
    )
    if plan.warmup_s < 0 or plan.jobs < 1 or plan.epochs < 1:
        raise SystemExit("bench_open_loop: --warmup >= 0, --jobs >= 1 and --epochs >= 1, please")
    return plan


# -- the load: one thread per job ----------------------------------------------------------


class Lane:
    """One job and its running trial; sends the reports scheduled for it, in order."""

    def __init__(self, job: bp.JobDriver, epochs: int) -> None:
        self.job = job
        self.epochs = epochs
        self.trial: tuple[int, int] | None = None
        self.epoch = 0

    def start(self) -> None:
        self.job.register()
        self.trial = self.job.next_trial()
        self.epoch = 0

    def _reset_connection(self) -> None:
        if isinstance(self.job, bp.ZeusJob):
            self.job.conn.close()  # http.client reconnects on the next request

    def _next_trial(self, timed: Callable[[str, Callable[[], Any]], Any]) -> None:
        """End the running trial (if any) and start the next one."""
        trial, self.trial = self.trial, None
        if trial is not None:
            timed("end", partial(self.job.end, trial))
        self.trial = timed("next_trial", self.job.next_trial)
        self.epoch = 0

    def run(
        self,
        times: Sequence[float],
        t0: float,
        max_lag_s: float,
        halt: threading.Event,
    ) -> tuple[list[Call], dict[str, list[float]], list[str]]:
        """Send a report at each of ``times`` (seconds after ``t0``, a ``perf_counter``)."""
        calls: list[Call] = []
        other: dict[str, list[float]] = {}
        errors: list[str] = []

        def timed(kind: str, call: Callable[[], Any]) -> Any:
            started = time.perf_counter()
            try:
                return call()
            finally:
                other.setdefault(kind, []).append((time.perf_counter() - started) * 1000)

        free_at = -math.inf  # when this job's previous call (or roll-over) ended
        for scheduled in times:
            if halt.is_set():
                break
            wait = t0 + scheduled - time.perf_counter()
            if wait > 0:
                halt.wait(wait)
            started = time.perf_counter() - t0
            idle = free_at <= scheduled
            if started - scheduled > max_lag_s:
                calls.append(Call(scheduled, started, started, "dropped", idle))
                free_at = started
                continue
            outcome: Outcome = "ok"
            stop = False
            try:
                if self.trial is None:
                    self._next_trial(timed)
                assert self.trial is not None
                self.epoch += 1
                stop = self.job.report(self.trial, self.epoch)
            except Exception as exc:
                outcome = "error"
                errors.append(f"{type(exc).__name__}: {exc}")
                self._reset_connection()
            calls.append(Call(scheduled, started, time.perf_counter() - t0, outcome, idle))
            if stop or outcome == "error" or self.epoch >= self.epochs:
                try:
                    self._next_trial(timed)
                except Exception as exc:
                    errors.append(f"rolling over the trial: {type(exc).__name__}: {exc}")
                    self._reset_connection()
                    self.trial = None
            free_at = time.perf_counter() - t0
        return calls, other, errors


def run_step(system: str, lanes: Sequence[Lane], rate: float, plan: Plan) -> Step:
    """Offer ``rate`` reports per second to ``lanes`` for warm-up + duration; see the docstring."""
    times = poisson_schedule(rate, plan.warmup_s + plan.duration_s, schedule_rng(plan.seed, rate))
    halt = threading.Event()
    results: list[tuple[list[Call], dict[str, list[float]], list[str]]] = []
    lock = threading.Lock()
    ready = threading.Barrier(len(lanes) + 1)
    t0_box: list[float] = []

    def lane_main(index: int) -> None:
        ready.wait()
        out = lanes[index].run(times[index :: len(lanes)], t0_box[0], plan.max_lag_s, halt)
        with lock:
            results.append(out)

    threads = [
        threading.Thread(target=lane_main, args=(i,), daemon=True, name=f"lane{i}")
        for i in range(len(lanes))
    ]
    groups = {"client": [os.getpid()]}
    try:
        for thread in threads:
            thread.start()
        t0_box.append(time.perf_counter() + 0.05)
        cpu_before, machine_before = bp.cpu_snapshot(groups), bp.machine_cpu()
        ready.wait()
        for thread in threads:
            while thread.is_alive():
                thread.join(0.2)
        wall = time.perf_counter() - t0_box[0]
        cpu_after, machine_after = bp.cpu_snapshot(groups), bp.machine_cpu()
    except BaseException:
        halt.set()
        ready.abort()
        raise
    calls = [c for r in results for c in r[0]]
    step = summarize(system, rate, calls, plan.warmup_s, plan.duration_s)
    busy = machine_after[0] - machine_before[0]
    total = machine_after[1] - machine_before[1]
    step.machine_busy = busy / total if total > 0 else math.nan
    step.client_cpu = (cpu_after["client"] - cpu_before["client"]) / wall if wall > 0 else math.nan
    other: dict[str, list[float]] = {}
    for _, kinds, _ in results:
        for kind, values in kinds.items():
            other.setdefault(kind, []).extend(values)
    step.other_p50_ms = {kind: percentile(values, 50) for kind, values in sorted(other.items())}
    step.error_samples = [e for r in results for e in r[2]][:3]
    return step


# -- systems -------------------------------------------------------------------------------


@dataclass
class Target:
    label: str
    lanes: list[Lane]


class BenchCluster:
    """Databases for the bso stacks: on a private throwaway cluster (``soak_service``'s,
    started the way tests/fixtures/postgres.py starts one) or on the server of ``url``."""

    def __init__(self, url: str | None, cleanup: ExitStack) -> None:
        import psycopg
        from soak_service import PrivateCluster, libpq_url

        self._psycopg = psycopg
        if url is None:
            cluster = PrivateCluster()  # raises SystemExit without server binaries
            cleanup.callback(cluster.stop)
            print(
                f"starting a private PostgreSQL cluster ({cluster.bindir.parent.name}, "
                f"fsync off) on 127.0.0.1:{cluster.port} ...",
                flush=True,
            )
            url = cluster.start()
        self.url = url
        self.libpq = libpq_url(url)
        self.created: list[str] = []
        cleanup.callback(self.drop_all)

    def database(self, name: str) -> str:
        """A new empty database ``name`` on the server (the stack migrates it)."""
        from sqlalchemy.engine import make_url

        with self._psycopg.connect(self.libpq, autocommit=True) as connection:
            connection.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            connection.execute(f'CREATE DATABASE "{name}"')
        self.created.append(name)
        return make_url(self.url).set(database=name).render_as_string(hide_password=False)

    def drop_all(self) -> None:
        with (
            contextlib.suppress(Exception),
            self._psycopg.connect(self.libpq, autocommit=True) as connection,
        ):
            for name in self.created:
                connection.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def start_bso(
    *,
    workers: int,
    database: Database,
    database_url: str | None,
    work_dir: Path,
    run_id: str,
    cleanup: ExitStack,
) -> Callable[[str, int, int], bp.JobDriver]:
    """A bso stack as bench_pipeline starts it, on ``database_url`` (None: SQLite)."""
    print(f"starting bso: {workers} solo worker node(s) on {database} ...", flush=True)
    config = StackConfig(
        data_dir=work_dir / f"bso-{database}-{workers}w",
        workers=workers,
        pool="solo",
        flower=False,
        beat=False,
        database_url=database_url,
        settings=WorkerSettings(task_events=False),
        default_tenant_limits=LOAD_GENERATOR_LIMITS,
    )
    stack = Stack(config).start()
    cleanup.callback(stack.stop)
    assert stack.client_url is not None

    def new_job(tag: str, seed: int, epochs: int) -> bp.JobDriver:
        url = stack.client_url or ""
        return bp.BsoJob(url, stack.api_key, f"{run_id}-{tag}", seed=seed, epochs=epochs,
                         policy="zeus")  # fmt: skip

    return new_job


def make_target(
    label: str, new_job: Callable[[str, int, int], bp.JobDriver], plan: Plan, cleanup: ExitStack
) -> Target:
    """``plan.jobs`` jobs on one system, registered, each with a running trial, warmed up."""
    lanes = []
    for i in range(plan.jobs):
        job = new_job(f"{label.replace(' ', '-')}-{i}", i, plan.epochs)
        cleanup.callback(job.close)
        lanes.append(Lane(job, plan.epochs))
    for lane in lanes:
        lane.start()
    # Unmeasured: connections, imports and statement caches of every process.
    warm = run_step(label, lanes, 50.0, replace(plan, warmup_s=0.0, duration_s=2.0))
    if warm.errors:
        raise RuntimeError(f"{label} warm-up failed: {warm.error_samples[:1]}")
    return Target(label, lanes)


def start_targets(
    plan: Plan, args: argparse.Namespace, work_dir: Path, cleanup: ExitStack
) -> list[Target]:
    run_id = f"o{os.getpid()}"
    targets: list[Target] = []
    cluster: BenchCluster | None = None
    for database in plan.databases:
        if database == "postgres":
            cluster = BenchCluster(args.postgres_url, cleanup)
        for workers in plan.workers:
            url = None
            if cluster is not None and database == "postgres":
                url = cluster.database(f"bso_bench_{run_id}_{workers}w")
            new_job = start_bso(
                workers=workers,
                database=database,
                database_url=url,
                work_dir=work_dir,
                run_id=run_id,
                cleanup=cleanup,
            )
            label = f"bso {database} {workers}w"
            targets.append(make_target(label, new_job, plan, cleanup))
    if plan.zeus:
        zeus = bp.start_zeus(args.zeus_python, work_dir, run_id, cleanup)
        targets.append(make_target("zeus sqlite", zeus.new_job, plan, cleanup))
    return targets


def run_ladder(targets: Sequence[Target], plan: Plan, steps: list[Step]) -> None:
    """Every rate, lowest first, on every system still keeping up below it; adds each
    step to ``steps`` as it ends.  Once Zeus stops keeping up, twice its saturation rate
    joins the ladder for bso (also below the current rate: systems that kept up below it
    run it)."""
    pending = sorted(plan.rates)
    done: list[float] = []
    zeus = next((t.label for t in targets if t.label.startswith("zeus")), None)
    goal_added = False
    while pending:
        rate = pending.pop(0)
        done.append(rate)
        runners = [
            t
            for t in targets
            if (plan.keep_going or runs_at(steps, t.label, rate))
            # Zeus's saturation is what it was before the goal rate (added to the ladder).
            and not (t.label == zeus and goal_added and rate not in plan.rates)
        ]
        if runners:
            print(f"\nrate {rate:g}/s", flush=True)
        for target in runners:
            step = run_step(target.label, target.lanes, rate, plan)
            steps.append(step)
            print(step_line(step), flush=True)
        if zeus is None or goal_added or first_failure(steps_of(steps, zeus)) is None:
            continue
        goal_added = True
        if (sat := saturation_rate(steps_of(steps, zeus))) is not None:
            goal = GOAL_FACTOR * sat
            if not any(math.isclose(goal, r) for r in done + pending):
                print(f"  (adding 2 x Zeus's saturation rate: {goal:g}/s)", flush=True)
                pending = sorted([*pending, goal])


# -- printing ------------------------------------------------------------------------------


def fmt(value: float) -> str:
    if math.isinf(value):
        return "inf"
    return bp.fmt_ms(value)


def step_line(s: Step) -> str:
    verdict = "held" if s.held() else ("kept up" if s.kept_up else "NOT KEPT UP")
    line = (
        f"  {s.system:<18} {s.rate:>6g}/s: offered {s.offered_per_s:.1f}, achieved "
        f"{s.achieved_per_s:.1f}/s, p50/p99/p99.9 {fmt(s.p50_ms)}/{fmt(s.p99_ms)}/"
        f"{fmt(s.p999_ms)} ms (n={s.calls}), dropped {s.dropped}, errors {s.errors}, "
        f"client lag p99 {fmt(s.client_lag_p99_ms)} ms, client CPU {s.client_cpu:.0%}, "
        f"machine {s.machine_busy:.0%} busy: {verdict}"
    )
    return line + "".join(f"\n    error: {e}" for e in s.error_samples)


def print_report(steps: Sequence[Step], systems: Sequence[str]) -> dict[str, Any]:
    """The tables and the target lines; returns them for ``--json``."""
    print(
        "\nOpen loop: epoch reports, latency from the scheduled arrival to the reply (ms, "
        "nearest-rank; dropped calls count as inf):\n"
    )
    print(
        "| system | rate /s | offered /s | achieved /s | p50 | p99 | p99.9 | calls | dropped "
        "| errors | client lag p99 | machine busy |"
    )
    print("|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
    for system in systems:
        for s in sorted(steps_of(steps, system), key=lambda s: s.rate):
            print(
                f"| {s.system} | {s.rate:g} | {s.offered_per_s:.1f} | {s.achieved_per_s:.1f} | "
                f"{fmt(s.p50_ms)} | {fmt(s.p99_ms)} | {fmt(s.p999_ms)} | {s.calls} | "
                f"{s.dropped} | {s.errors} | {fmt(s.client_lag_p99_ms)} | "
                f"{s.machine_busy:.0%} |"
            )
    summary: dict[str, Any] = {"systems": {}}
    print(
        f"\n| system | highest rate held (p99 <= {HELD_P99_MS:g} ms) | highest rate kept up "
        "with | highest achieved /s |"
    )
    print("|---|--:|--:|--:|")
    for system in systems:
        mine = steps_of(steps, system)
        held, sat = highest_held(mine), saturation_rate(mine)
        kept = max((s.rate for s in mine if s.kept_up), default=None)
        best, lower_bound = capacity(mine)
        print(
            f"| {system} | {'-' if held is None else f'{held:g}'} | "
            f"{'-' if kept is None else f'{kept:g}'}{' (every rate)' if lower_bound else ''} | "
            + ("-" if math.isnan(best) else f"{'>= ' if lower_bound else ''}{best:.1f}")
            + " |"
        )
        summary["systems"][system] = {
            "highest_held": held,
            "saturation": sat,
            "highest_achieved": best,
            "achieved_is_lower_bound": lower_bound,
        }
    print("\nTargets (printed, not asserted):")
    zeus = [s for s in systems if s.startswith("zeus")]
    bso = [s for s in systems if s.startswith("bso")]
    zeus_sat = saturation_rate(steps_of(steps, zeus[0])) if zeus else None
    goal_p99: dict[str, float | None] = {}
    summary["goal"] = {"zeus_saturation": zeus_sat, "rate": None, "bso_p99_ms": goal_p99}
    if zeus_sat is None:
        why = "no Zeus run" if not zeus else "Zeus kept up with every rate measured, or none"
        print(f"  goal at 2 x Zeus's saturation rate: n/a ({why})")
    else:
        rate = GOAL_FACTOR * zeus_sat
        summary["goal"]["rate"] = rate
        for system in bso:
            step = find_step(steps, system, rate)
            if step is None:
                failed = first_failure(steps_of(steps, system))
                where = (
                    "was not measured" if failed is None else f"stopped keeping up at {failed:g}/s"
                )
                print(f"  at {rate:g}/s: {system} {where}: {bp.verdict(False)}")
                goal_p99[system] = None
                continue
            ok = step.kept_up and step.p99_ms <= GOAL_P99_MS
            print(
                f"  at 2 x Zeus's saturation rate ({zeus_sat:g}/s, the highest it kept up "
                f"with) = {rate:g}/s: {system} p99 = {fmt(step.p99_ms)} ms "
                f"(goal <= {GOAL_P99_MS:g} ms): {bp.verdict(ok)}"
            )
            goal_p99[system] = step.p99_ms
    one = steps_of(steps, "bso postgres 1w")
    four = steps_of(steps, "bso postgres 4w")
    summary["scale_out"] = None
    if one and four:
        (c1, lb1), (c4, lb4) = capacity(one), capacity(four)
        ratio = c4 / c1 if c1 else math.nan
        caveat = ""
        if lb1 or lb4:
            caveat = " (a system that kept up with every rate gives a lower bound only)"
        print(
            f"  scale-out, PostgreSQL: 4 workers / 1 worker highest achieved rate = "
            f"{c4:.1f} / {c1:.1f} = {ratio:.2f}x on {os.cpu_count()} CPUs{caveat}"
        )
        summary["scale_out"] = {"1w": c1, "4w": c4, "ratio": ratio}
    else:
        print("  scale-out, PostgreSQL 4w / 1w: n/a (this run lacks one of them)")
    if zeus and bso:
        zbest = capacity(steps_of(steps, zeus[0]))[0]
        for system in bso:
            best = capacity(steps_of(steps, system))[0]
            if math.isnan(best) or math.isnan(zbest):
                continue
            print(
                f"  highest achieved rate, {system} / Zeus: {best:.1f} / {zbest:.1f} = "
                f"{best / zbest:.2f}x"
            )
    print(
        "  (the closed-loop 32-jobs epoch reports/s against Zeus (target >= 3x) comes from "
        "scripts/bench_pipeline.py)"
    )
    return summary


def jsonable(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return value


# -- main ----------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    plan = make_plan(args)
    if plan.zeus and (problem := bp.check_zeus_python(args.zeus_python)) is not None:
        print(f"bench_open_loop: {problem} (or pass --no-zeus)", file=sys.stderr)
        return 2
    previous = {s: signal.signal(s, bp._raise_interrupt) for s in (signal.SIGINT, signal.SIGTERM)}
    started = time.monotonic()
    print(
        f"bench_open_loop: {bp.machine_line()}\n  {bp.code_line()}\n"
        f"  rates {', '.join(f'{r:g}' for r in plan.rates)}/s; {plan.warmup_s:g} s warm-up + "
        f"{plan.duration_s:g} s measured per rate; {plan.jobs} jobs, {plan.epochs} epochs per "
        f"trial, max lag {plan.max_lag_s:g} s, seed {plan.seed}; systems: "
        f"{', '.join(plan.systems())}; at most ~{plan.longest_s() / 60:.0f} min of load",
        flush=True,
    )
    steps: list[Step] = []
    systems: list[str] = []
    interrupted = False
    try:
        with bp.work_directory(args.work_dir) as work_dir, ExitStack() as cleanup:
            targets = start_targets(plan, args, work_dir, cleanup)
            systems = [t.label for t in targets]
            run_ladder(targets, plan, steps)
            print("\nstopping ...", flush=True)
    except KeyboardInterrupt:
        interrupted = True
        print("\nbench_open_loop: interrupted; everything it started is stopped", file=sys.stderr)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    summary = print_report(steps, systems)
    errors = sum(s.errors for s in steps)
    print(f"\nerrors {errors}; total {time.monotonic() - started:.0f} s; {bp.machine_line()}")
    if args.json is not None:
        document = {
            "command": [sys.executable, *sys.argv],
            "machine": bp.machine_line(),
            "code": bp.code_line(),
            "plan": asdict(plan),
            "steps": [asdict(s) | {"kept_up": s.kept_up, "held": s.held()} for s in steps],
            **summary,
        }
        args.json.write_text(json.dumps(jsonable(document), indent=1) + "\n")
        print(f"results written to {args.json}")
    if interrupted:
        return 130
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
