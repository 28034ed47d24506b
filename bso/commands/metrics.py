"""``bso metrics``: the Prometheus endpoint of a deployment, behind the monitoring login.

Reads the workers' multiprocess files (``PROMETHEUS_MULTIPROC_DIR``), Redis
(``BSO_BROKER_URL``, the worker user) and the database (``BSO_DATABASE_URL``),
as :mod:`bso_workers.metrics_export` describes.  The login is
``BSO_METRICS_BASIC_AUTH=user:password`` (``bso up`` and compose pass the
monitoring user's, Flower's); without one it refuses to start: an endpoint
that shows every job's id must not be open.
"""

from __future__ import annotations

import argparse
import os
import sys

from bso.commands.arguments import count, port_number
from bso_workers.metrics import MULTIPROC_DIR_ENV
from bso_workers.metrics_export import (
    DEFAULT_MAX_JOBS,
    LOGIN_ENV,
    BsoCollector,
    metrics_registry,
    serve,
)

DEFAULT_PORT = 9808


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to bind")
    parser.add_argument("--port", type=port_number, default=DEFAULT_PORT, help="port to serve on")
    parser.add_argument(
        "--max-jobs",
        type=count,
        default=DEFAULT_MAX_JOBS,
        help="jobs whose recommendations are exported (the most recently active)",
    )


def run(args: argparse.Namespace) -> int:
    from bso.storage.sql import SqlStore
    from bso.wire.connection import redis_client
    from bso_workers.settings import WorkerSettings

    user, _, password = os.environ.get(LOGIN_ENV, "").partition(":")
    if not user or not password:
        print(
            f"bso metrics: set {LOGIN_ENV}=user:password (the monitoring login); the "
            "endpoint does not run open",
            file=sys.stderr,
        )
        return 2
    settings = WorkerSettings()
    collector = BsoCollector(
        redis_client(settings.broker_url), SqlStore(settings.database_url), max_jobs=args.max_jobs
    )
    registry = metrics_registry(collector, os.environ.get(MULTIPROC_DIR_ENV))
    server = serve(registry, args.host, args.port, user, password)
    print(f"bso metrics on http://{args.host}:{server.server_port}/metrics", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        return 0
    finally:
        server.server_close()
    return 0
