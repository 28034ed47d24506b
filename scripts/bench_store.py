"""Cost of each event type through BsoService on every store, in µs per event.

Usage: ``python scripts/bench_store.py [--jobs 20] [--rounds 3] [--epochs 20]
[--repeat 3] [--clock wall|cpu] [--no-postgres]``

Every backend replays the same events (per job: register, then ``rounds`` times
next trial, ``epochs`` epoch reports, end trial) one at a time in this process,
so the numbers are CPU cost plus the database's own latency, with no queue, no
Redis and no contention.  The memory store is the service's own cost; what a
SQL backend adds on top of it is the store's share (the ``+store`` columns).
Each figure is the best of ``repeat`` runs (the machine may be shared: note
``uptime``); a fresh database per run.  ``--clock cpu`` counts this process's
CPU time instead of wall time: steadier on a loaded machine, but blind to the
PostgreSQL server's own work and to waiting on it.

PostgreSQL is a throwaway cluster started from the server binaries the way the
test fixtures start it (fsync off, so the figures are CPU and round trips, not
disk); without the binaries the script says so and measures the others.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # the PostgreSQL server of the test fixtures
    sys.path.insert(0, str(ROOT))

from bso.service import BsoService  # noqa: E402
from bso.spec import JobSpec  # noqa: E402
from bso.storage import MemoryStore, Store  # noqa: E402
from bso.storage.sql import SqlStore  # noqa: E402
from bso.storage.sql.engine import upgrade  # noqa: E402
from bso.wire.events import (  # noqa: E402
    EndTrial,
    EpochDecision,
    EpochReport,
    Event,
    NextTrial,
    RegisterJob,
    TrialAssigned,
)

KINDS = ("register", "next_trial", "epoch", "end_trial")
StoreFactory = Callable[[], AbstractContextManager[Store]]


def spec(job_id: str) -> JobSpec:
    # A target no trial reaches, so that every trial sends all its epochs.
    return JobSpec(
        job_id=job_id,
        batch_sizes=[16, 32, 64, 128],
        default_batch_size=32,
        target_metric=2.0,
        max_epochs=10_000,
        mab_seed=1,
    )


CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}


@dataclass(frozen=True)
class Plan:
    jobs: int
    rounds: int
    """Trials per job."""
    epochs: int
    """Epoch reports per trial."""
    repeat: int
    clock: str


def replay(store: Store, plan: Plan) -> dict[str, list[float]]:
    """Seconds each event took, by kind."""
    clock = CLOCKS[plan.clock]
    service = BsoService(store)
    took: dict[str, list[float]] = defaultdict(list)

    def send(kind: str, event: Event) -> object:
        start = clock()
        reply = service.handle(event)
        took[kind].append(clock() - start)
        if reply.kind == "error":
            raise RuntimeError(f"{event!r} got {reply!r}")
        return reply

    for j in range(plan.jobs):
        job_id = f"job-{j}"
        send("register", RegisterJob(spec=spec(job_id)))
        for _ in range(plan.rounds):
            trial = send("next_trial", NextTrial(job_id=job_id))
            assert isinstance(trial, TrialAssigned)
            for epoch in range(1, plan.epochs + 1):
                decision = send(
                    "epoch",
                    EpochReport(
                        job_id=job_id,
                        trial_number=trial.trial_number,
                        epoch=epoch,
                        time_s=epoch * 10.0,
                        energy_j=epoch * 1000.0,
                        metric=0.01 * epoch,
                    ),
                )
                assert isinstance(decision, EpochDecision)
                if decision.stop:
                    break
            send("end_trial", EndTrial(job_id=job_id, trial_number=trial.trial_number))
    return took


@contextmanager
def memory_store() -> Iterator[Store]:
    yield MemoryStore()


@contextmanager
def sql_store(url: str) -> Iterator[Store]:
    store = SqlStore(url)
    try:
        yield store
    finally:
        store.close()


def sqlite_stores(folder: Path) -> StoreFactory:
    runs = iter(range(10**6))

    @contextmanager
    def make() -> Iterator[Store]:
        url = f"sqlite:///{folder / f'bench-{next(runs)}.db'}"
        upgrade(url)
        with sql_store(url) as store:
            yield store

    return make


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@contextmanager
def postgres_stores() -> Iterator[StoreFactory | None]:
    """Fresh migrated databases of a throwaway cluster; None without server binaries."""
    import pytest  # the fixtures report a missing server with pytest.fail
    from psycopg import sql

    from tests.fixtures.postgres import TEMPLATE_DATABASE, PostgresServer, find_bindir

    try:
        bindir = find_bindir()
    except pytest.fail.Exception as missing:
        print(f"PostgreSQL skipped: {missing}", file=sys.stderr)
        yield None
        return
    root = Path(tempfile.mkdtemp(prefix="bso-bench-postgres-"))
    server = PostgresServer(bindir=bindir, root=root, port=_free_port())
    try:
        server.start()
        server.admin(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(TEMPLATE_DATABASE)))
        upgrade(server.url(TEMPLATE_DATABASE))

        @contextmanager
        def make() -> Iterator[Store]:
            name = server.create_database(migrated=True)
            try:
                with sql_store(server.url(name)) as store:
                    yield store
            finally:
                server.drop_database(name)

        yield make
    finally:
        if (server.data_dir / "postmaster.pid").exists():
            server.stop()
        shutil.rmtree(root, ignore_errors=True)


def best_means(make: StoreFactory, plan: Plan) -> dict[str, float]:
    """Lowest mean µs per event of each kind over ``plan.repeat`` fresh runs."""
    best = {kind: float("inf") for kind in KINDS}
    for _ in range(plan.repeat):
        with make() as store:
            took = replay(store, plan)
        for kind in KINDS:
            best[kind] = min(best[kind], 1e6 * sum(took[kind]) / len(took[kind]))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    parser.add_argument("--no-postgres", action="store_true")
    args = parser.parse_args()
    plan = Plan(args.jobs, args.rounds, args.epochs, args.repeat, args.clock)

    print(f"load average before: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    results = {"memory": best_means(memory_store, plan)}
    with tempfile.TemporaryDirectory(prefix="bso-bench-sqlite-") as folder:
        results["sqlite"] = best_means(sqlite_stores(Path(folder)), plan)
    if not args.no_postgres:
        with postgres_stores() as make:
            if make is not None:
                results["postgresql"] = best_means(make, plan)
    print(f"load average after:  {', '.join(f'{x:.2f}' for x in os.getloadavg())}")

    header = f"{'event':<12}" + "".join(f"{name:>12}" for name in results)
    header += "".join(f"{'+store ' + name:>20}" for name in results if name != "memory")
    print(
        f"µs ({args.clock}) per event, best of {args.repeat} runs of {args.jobs} jobs "
        f"x {args.rounds} trials x {args.epochs} epochs"
    )
    print(header)
    for kind in KINDS:
        memory = results["memory"][kind]
        row = f"{kind:<12}" + "".join(f"{r[kind]:>12.0f}" for r in results.values())
        row += "".join(f"{r[kind] - memory:>20.0f}" for n, r in results.items() if n != "memory")
        print(row)


if __name__ == "__main__":
    main()
