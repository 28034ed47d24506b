"""One tenant floods its queue; how long do another tenant's calls take meanwhile?

    .venv/bin/python scripts/bench_flood.py                 # 200,000 items, 2 workers
    .venv/bin/python scripts/bench_flood.py --items 2000 --seconds 5 --json out.json

Starts the service as ``bso up`` does (its own Redis, SQLite, solo worker nodes),
makes two tenants as ``bso keys create`` does, and then, as a careless or hostile
team would, pushes ``--items`` well-formed status reads onto the flooding tenant's
own queue with its own Redis user and key, pipelined (all that user may do: it
goes around its door, so the workers refuse what lies past its queue's bound).
The quiet tenant's status reads go through the real client, ``--rate`` a second
(within its own admission limits): ``--calls`` while idle, then for
``--seconds`` while the backlog drains.  Printed:
the quiet tenant's p50 / p99 / max latency idle and under the flood, the backlog
left when the measurement ended, and the flooder's throughput.

The target (issue 27): under the flood, p99 <= 1 s and p50 within 3x idle, on 2
workers on a 2-core machine.  docs/benchmarks.md, "A tenant's flood", has the
figures and the command that made them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import redis

from bso.errors import UnknownJob
from bso.storage.sql import SqlStore
from bso.wire import keys
from bso.wire.message import celery_message
from bso.wire.status_query import StatusQuery
from bso_client.transport import ServiceClient
from bso_workers.credentials import ADMIN_URL_NAME, read_env_file
from bso_workers.settings import WorkerSettings
from bso_workers.stack import Stack, StackConfig
from bso_workers.tenant_keys import create_key
from bso_workers.tenant_users import TenantUsers, as_tenant_url

PUSH_CHUNK = 5000
"""Items per pipelined round trip of the flood."""


def make_tenant(stack: Stack, name: str) -> tuple[str, str]:
    """A key of ``name`` and its URL; its Redis user made as ``bso keys create`` does."""
    assert stack.credentials_file is not None
    admin_url = read_env_file(stack.credentials_file)[ADMIN_URL_NAME]
    store = SqlStore(stack.settings.database_url)
    try:
        key = create_key(store, name)
        with redis.Redis.from_url(admin_url) as admin:
            TenantUsers(admin).apply(name, store.api_keys())
    finally:
        store.close()
    return key, as_tenant_url(stack.settings.broker_url, name, key)


def flood(url: str, key: str, namespace: keys.Namespace, items: int) -> float:
    """Push ``items`` status reads onto ``namespace``'s queue; seconds it took."""
    started = time.perf_counter()
    with redis.Redis.from_url(url) as client:
        left = items
        while left:
            chunk = min(left, PUSH_CHUNK)
            with client.pipeline(transaction=False) as pipe:
                for _ in range(chunk):
                    message = celery_message(
                        keys.TASK_STATUS,
                        StatusQuery(job_id="flooded").model_dump_json(),
                        str(uuid.uuid4()),
                        namespace.queue,
                        api_key=key,
                    )
                    pipe.lpush(namespace.queue_key, message)
                pipe.execute()
            left -= chunk
    return time.perf_counter() - started


def one_call_ms(client: ServiceClient, rate: float) -> float:
    """One status read's latency; then the rest of its ``1 / rate`` second."""
    started = time.perf_counter()
    with contextlib.suppress(UnknownJob):  # expected: the read went through a worker
        client.status("quiet-job")
    took = time.perf_counter() - started
    time.sleep(max(0.0, 1 / rate - took))
    return took * 1000


def summary(latencies_ms: list[float]) -> dict[str, float]:
    ordered = sorted(latencies_ms)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {
        "calls": len(ordered),
        "p50_ms": statistics.median(ordered),
        "p99_ms": p99,
        "max_ms": ordered[-1],
    }


def run(args: argparse.Namespace, data_dir: Path) -> dict[str, object]:
    config = StackConfig(
        data_dir=data_dir,
        workers=args.workers,
        beat=False,
        flower=False,
        metrics=False,
        settings=WorkerSettings(_env_file=None),
    )
    stack = Stack(config).start()
    try:
        loud_key, loud_url = make_tenant(stack, "loud")
        quiet_key, quiet_url = make_tenant(stack, "quiet")
        loud = keys.tenant_namespace("loud")
        worker = redis.Redis.from_url(stack.settings.broker_url)
        with ServiceClient.connect(quiet_url, api_key=quiet_key, timeout_s=30) as quiet:
            for _ in range(5):
                one_call_ms(quiet, args.rate)  # connections, subscription, workers' caches
            idle = [one_call_ms(quiet, args.rate) for _ in range(args.calls)]
            push_s = flood(loud_url, loud_key, loud, args.items)
            queued = int(worker.llen(loud.queue_key))
            flooded: list[float] = []
            started = time.monotonic()
            while time.monotonic() - started < args.seconds and worker.llen(loud.queue_key):
                flooded.append(one_call_ms(quiet, args.rate))
            elapsed = time.monotonic() - started
            left = int(worker.llen(loud.queue_key))
            worker_refused = int(worker.hget(keys.TENANT_REFUSED_KEY, "loud") or 0)
        worker.close()
    finally:
        stack.stop()
    drained = queued - left
    return {
        "workers": args.workers,
        "items": args.items,
        "push_s": push_s,
        "idle": summary(idle),
        "flooded": summary(flooded),
        "backlog_at_start": queued,
        "backlog_at_end": left,
        "refused": int(worker_refused),
        "flood_items_per_s": drained / elapsed if elapsed else 0.0,
        "measured_s": elapsed,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=200_000, help="the flood's size")
    parser.add_argument("--workers", type=int, default=2, help="worker nodes (solo pool)")
    parser.add_argument("--calls", type=int, default=200, help="the quiet tenant's idle calls")
    parser.add_argument(
        "--rate", type=float, default=10.0, help="the quiet tenant's calls per second"
    )
    parser.add_argument(
        "--seconds", type=float, default=60.0, help="how long to measure under the flood"
    )
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bso-flood-") as tmp:
        found = run(args, Path(tmp) / "data")
    idle, flooded = found["idle"], found["flooded"]
    assert isinstance(idle, dict)
    assert isinstance(flooded, dict)
    print(
        f"{found['workers']} worker nodes; the loud tenant pushed {args.items} status reads "
        f"onto its own queue in {found['push_s']:.1f} s"
    )
    for name, row in (("idle", idle), ("under the flood", flooded)):
        print(
            f"quiet tenant, {name}: {row['calls']} calls, p50 {row['p50_ms']:.1f} ms, "
            f"p99 {row['p99_ms']:.1f} ms, max {row['max_ms']:.1f} ms"
        )
    print(
        f"backlog {found['backlog_at_start']} -> {found['backlog_at_end']} in "
        f"{found['measured_s']:.0f} s ({found['flood_items_per_s']:.0f} flood items/s, "
        f"{found['refused']} refused past the bound); "
        f"p50 under the flood is {flooded['p50_ms'] / idle['p50_ms']:.2f}x idle"
    )
    if args.json is not None:
        args.json.write_text(json.dumps(found, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
