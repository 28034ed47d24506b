"""Memory of one idle Celery worker node, solo pool against prefork (concurrency 1).

Starts a Redis server and, in turn, one node of each pool exactly as ``bso up``
starts them (:mod:`bso_workers.stack`), waits until it answers a ping, and
prints the proportional set size (PSS: shared pages split between the
processes sharing them, so a forked child is not counted twice) summed over the
node's processes.  Why it matters: ``docker compose up --scale worker=N`` pays
it N times.

    .venv/bin/python scripts/measure_worker_memory.py --rounds 2
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from bso.storage.sql import upgrade
from bso_workers.settings import WorkerSettings
from bso_workers.stack import node_name, start_redis, start_worker, wait_for_workers
from bso_workers.supervision import free_port, stop_together


def node_pss_mb(pid: int) -> tuple[float, int]:
    """PSS of ``pid`` and its children in MB, and how many processes that is."""
    pids = [pid, *(int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split())]
    kilobytes = 0
    for process in pids:
        for line in Path(f"/proc/{process}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                kilobytes += int(line.split()[1])
    return kilobytes / 1024, len(pids)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="nodes of each pool, alternated")
    parser.add_argument("--settle-s", type=float, default=2.0, help="wait after the first ping")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        data = Path(work)
        port = free_port()
        redis = start_redis(data, "127.0.0.1", port)
        database_url = f"sqlite:///{data / 'bso.sqlite3'}"
        upgrade(database_url)
        settings = WorkerSettings(
            _env_file=None, broker_url=f"redis://127.0.0.1:{port}/0", database_url=database_url
        )
        try:
            for _ in range(args.rounds):
                for pool in ("solo", "prefork"):
                    node = start_worker(settings, data, f"mem-{pool}", 1, pool)
                    try:
                        wait_for_workers(settings, [node_name(node.name)], [node])
                        time.sleep(args.settle_s)
                        pss, processes = node_pss_mb(node.pid)
                        print(f"{pool:<8} {processes} process(es)  PSS {pss:.0f} MB", flush=True)
                    finally:
                        stop_together([node])
        finally:
            stop_together([redis])
    return 0


if __name__ == "__main__":
    sys.exit(main())
