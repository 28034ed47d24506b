"""scripts/soak.py's service side: the stack under test, its PostgreSQL, the faults
that hit it and the fault log (see soak.py's docstring)."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import pickle
import pwd
import random
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import TextIO

import psycopg
import redis
from sqlalchemy.engine import make_url

from bso.wire import keys
from bso.wire.message import celery_message
from bso_client.transport import ServiceClient
from bso_workers.settings import WorkerSettings
from bso_workers.stack import Stack, StackConfig
from bso_workers.supervision import ManagedProcess, free_port, spawn
from bso_workers.tenant_keys import LOAD_GENERATOR_LIMITS

FAULT_KINDS = ("worker_kill", "redis_restart", "db_drop", "duplicate", "reorder", "garbage")
SIZES = (16, 32, 64, 128)
MAX_EPOCHS = 8
PROGRESS_EVERY_S = 10.0
RELAUNCH_S = 1.0
"""How long a runner whose call gave up (its training job crashed) waits before the next one."""
BROADCAST_SHARE = 0.1
"""Share of garbage items PUBLISHed on Celery's remote-control channel instead of queued."""


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
                default_tenant_limits=LOAD_GENERATOR_LIMITS,
            )
        )
        self._stop = threading.Event()
        self._supervisor = threading.Thread(target=self._supervise, name="supervisor", daemon=True)
        self._spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spawner")
        """Starts Redis again after a restart fault.  A child dies with the *thread*
        that started it (``spawn`` sets the parent-death signal, and Linux sends it
        when the starting thread ends), so Redis must not be started from the fault
        injector's thread, which ends before the soak reads its last counts: that
        Redis got SIGTERM then, and the reads found it gone.  This thread lives
        until :meth:`stop` has stopped the stack."""

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
        self._spawner.shutdown()

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
            new = self._spawner.submit(self._respawn, old).result()
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

    def dead_letter_counts(self, within_s: float = 60.0) -> dict[str, int]:
        """What the workers refused before decoding, per reason (and ``total``).

        Read like any client reads: through a Redis the soak may have just
        restarted, so a reset or refused connection is tried again for ``within_s``.
        A refusal can reach us as the socket's own ``ConnectionRefusedError`` (an
        ``OSError``) rather than redis-py's wrapper: a busy CI machine hit that once.
        """
        deadline = time.monotonic() + within_s
        while True:
            client = redis.Redis.from_url(self.worker_url, decode_responses=True, socket_timeout=5)
            try:
                counts = client.hgetall(keys.DEADLETTER_COUNTS_KEY)
                return {str(reason): int(n) for reason, n in sorted(counts.items())}
            except (redis.ConnectionError, redis.TimeoutError, OSError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
            finally:
                client.close()

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
