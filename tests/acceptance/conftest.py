"""The acceptance suite's world: one live ``bso up`` and the commands a user types around it.

Everything here goes through the user's own doors: ``bso up`` started as a
subprocess on a free port with its own data folder (never Redis's 6379: this
machine runs a Redis of its own there), the credentials it writes
(``credentials.env``), the trainer scripts under ``trainers/`` run as
subprocesses with ``BSO_BROKER_URL`` and ``BSO_API_KEY`` in their environment
(what ``set -a; . credentials.env`` gives a shell), ``torchrun`` for the
data-parallel script, and ``bso status JOB --json`` to read what bso recorded.
Nothing is imported from the service or the client: a test sees exit codes,
stdout, stderr and the CLI's JSON, as a user does.

One service per test process (starting it costs seconds on 2 cores): the
session's, or each pytest-xdist worker's that runs acceptance tests; the outage
test stops it and starts it again on the same port and data folder, as an
operator restarting ``bso up`` would.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.trainer_runs import TRAINER_RUN

ROOT = Path(__file__).resolve().parents[2]
TRAINERS = Path(__file__).resolve().parent / "trainers"
BIN = Path(sys.executable).parent
"""The virtual environment's scripts: ``bso``, ``torchrun``, ``python``."""

START_TIMEOUT_S = 120.0
RUN_TIMEOUT_S = 120.0
"""A hang guard for one trainer run, far above what a run takes (seconds)."""
EXIT_RELAUNCH = 3
"""What the trainers exit with when bso stopped the run unconverged (as the examples do)."""

BSO_LOG_LINE = re.compile(r"^(DEBUG|INFO|WARNING|ERROR|CRITICAL) (bso\S*): (.*)$")
"""How the trainers configure logging (``%(levelname)s %(name)s: %(message)s``),
so that bso's own lines can be told from a framework's."""


def free_port() -> int:
    """A TCP port nobody listens on right now (the OS picks it; never 6379)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def read_env_file(path: Path) -> dict[str, str]:
    """``NAME=value`` lines, as ``set -a; . credentials.env`` would read them."""
    values = {}
    for line in path.read_text().splitlines():
        name, sep, value = line.partition("=")
        if sep and not line.startswith("#"):
            value = value.strip()  # single-quoted where the shell would act on it
            values[name.strip()] = shlex.split(value)[0] if value.startswith("'") else value
    return values


@dataclass
class LiveService:
    """``bso up --data-dir DIR --redis-port PORT``, started and stopped as a user does."""

    data_dir: Path
    home: Path
    """HOME of the trainers: a fresh user's machine (bso's cache and journal live under it)."""
    port: int = field(default_factory=free_port)
    popen: subprocess.Popen[str] | None = None
    output: list[str] = field(default_factory=list)
    starts: int = 0

    def start(self) -> None:
        assert self.popen is None, "already running"
        argv = [
            str(BIN / "bso"), "up",
            "--data-dir", str(self.data_dir),
            "--redis-port", str(self.port),
            "--no-flower",
            "--workers", "1",  # 2 cores: one node is plenty for a handful of trainers
        ]  # fmt: skip
        self.popen = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, args=(self.popen, lines), daemon=True).start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                line = lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                line = None
            if line is None:
                self.kill()
                pytest.fail(f"bso up did not come up:\n{self.log()}")
            if "Ctrl-C stops everything" in line:
                break
        self.starts += 1

    def _pump(self, popen: subprocess.Popen[str], lines: queue.Queue[str | None]) -> None:
        assert popen.stdout is not None
        for line in popen.stdout:
            self.output.append(line)
            lines.put(line)
        lines.put(None)

    def stop(self) -> None:
        """Ctrl-C, as a user stops ``bso up``; it must exit 0 and say it is down."""
        assert self.popen is not None
        self.popen.send_signal(signal.SIGINT)
        code = self.popen.wait(60)
        self.popen = None
        assert code == 0, self.log()

    def kill(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(30)
        self.popen = None

    def log(self) -> str:
        return "".join(self.output)

    @property
    def credentials(self) -> dict[str, str]:
        return read_env_file(self.data_dir / "credentials.env")

    @property
    def broker_url(self) -> str:
        return self.credentials["BSO_BROKER_URL"]

    @property
    def password(self) -> str:
        return self.credentials["BSO_REDIS_CLIENT_PASSWORD"]

    def env(self, **extra: str) -> dict[str, str]:
        """A trainer's environment: the user's, plus what ``credentials.env`` exports."""
        credentials = self.credentials
        user = {k: v for k, v in os.environ.items() if k not in ("XDG_CACHE_HOME", "BSO_CACHE_DIR")}
        return {
            **user,
            "HOME": str(self.home),
            "BSO_BROKER_URL": credentials["BSO_BROKER_URL"],
            "BSO_API_KEY": credentials["BSO_API_KEY"],
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1",
            **extra,
        }

    def status(self, job_id: str) -> dict[str, Any]:
        """``bso status JOB --json --data-dir DIR``, as the user runs it; exit 0 required."""
        (status,) = json.loads(self.status_text(job_id, "--json"))
        assert isinstance(status, dict)
        return status

    def status_text(self, job_id: str, *options: str) -> str:
        """What ``bso status JOB --data-dir DIR`` prints; exit 0 required."""
        done = subprocess.run(
            [str(BIN / "bso"), "status", job_id, *options, "--data-dir", str(self.data_dir)],
            capture_output=True,
            text=True,
            timeout=60,
            env={k: v for k, v in os.environ.items() if not k.startswith("BSO_")},
            check=False,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout


@dataclass
class TrainerRun:
    """One finished run of a trainer script: what the user's terminal showed."""

    argv: Sequence[str]
    returncode: int
    stdout: str
    stderr: str
    wall_s: float
    status_file: Path | None = None
    """``BSO_RUN_STATUS_FILE``: where ``bso_client.RunStatus`` writes the run's outcome."""

    def __str__(self) -> str:
        return (
            f"$ {' '.join(self.argv)}\nexit {self.returncode} after {self.wall_s:.1f} s\n"
            f"--- stdout\n{self.stdout}--- stderr\n{self.stderr}"
        )

    @property
    def epochs(self) -> list[int]:
        """The epochs the training loop says it trained (``epoch N ...`` lines)."""
        return [int(m.group(1)) for m in re.finditer(r"^epoch (\d+)\b", self.stdout, re.M)]

    @property
    def summary(self) -> dict[str, Any]:
        """The trainer's last stdout line: its JSON summary."""
        lines = self.stdout.strip().splitlines()
        assert lines, str(self)
        summary = json.loads(lines[-1])
        assert isinstance(summary, dict)
        return summary

    @property
    def run_status(self) -> dict[str, Any]:
        """What ``RunStatus`` wrote: the outcome a scheduler reads (torchrun hides exit codes)."""
        assert self.status_file is not None
        assert self.status_file.exists(), str(self)
        status = json.loads(self.status_file.read_text())
        assert isinstance(status, dict)
        return status

    @property
    def last_bso_line(self) -> str:
        """The ``bso: OUTCOME ...`` line RunStatus prints last."""
        lines = [line for line in self.stderr.splitlines() if line.startswith("bso: ")]
        assert lines, str(self)
        return lines[-1]

    def bso_lines(self, level: str) -> list[str]:
        """bso's log lines at ``level`` (its loggers are all under ``bso``)."""
        return [
            line
            for line in self.stderr.splitlines()
            if (m := BSO_LOG_LINE.match(line)) and m.group(1) == level
        ]


def trainer_argv(name: str, *args: str) -> list[str]:
    return [sys.executable, str(TRAINERS / f"{name}.py"), *args]


def torchrun_argv(processes: int, name: str, *args: str) -> list[str]:
    return [
        str(BIN / "torchrun"),
        "--nproc_per_node", str(processes),
        "--master_port", str(free_port()),
        str(TRAINERS / f"{name}.py"),
        *args,
    ]  # fmt: skip


def status_file_env(env: dict[str, str]) -> tuple[dict[str, str], Path]:
    """``env`` with ``BSO_RUN_STATUS_FILE`` naming a fresh path, as a scheduler sets it."""
    path = Path(tempfile.mkdtemp(prefix="bso-run-status-")) / "status.json"
    return {**env, "BSO_RUN_STATUS_FILE": str(path)}, path


RUNS_OF_THIS_TEST: list[tuple[str, float]] = []
"""(trainer and job, seconds) of the current test's runs: the test's report carries
them (``user_properties``) to the session's end, where tests/conftest.py prints them,
in whichever pytest-xdist worker the test ran."""


@pytest.fixture(autouse=True)
def _report_trainer_runs(request: pytest.FixtureRequest) -> Iterator[None]:
    RUNS_OF_THIS_TEST.clear()
    yield
    request.node.user_properties.extend((TRAINER_RUN, run) for run in RUNS_OF_THIS_TEST)


def run_trainer(
    argv: Sequence[str], env: dict[str, str], timeout_s: float = RUN_TIMEOUT_S
) -> TrainerRun:
    env, status_file = status_file_env(env)
    started = time.monotonic()
    done = subprocess.run(
        argv, capture_output=True, text=True, timeout=timeout_s, env=env, cwd=ROOT, check=False
    )
    wall_s = time.monotonic() - started
    run = TrainerRun(argv, done.returncode, done.stdout, done.stderr, wall_s, status_file)
    record_time(run)
    return run


def record_time(run: TrainerRun) -> None:
    script = next((Path(a).stem for a in run.argv if a.endswith(".py")), run.argv[0])
    job = run.argv[run.argv.index("--job-id") + 1] if "--job-id" in run.argv else "?"
    RUNS_OF_THIS_TEST.append((f"{script} {job}", run.wall_s))


def trials_of(status: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """Every trial ``bso status`` lists, over all lanes, by trial number."""
    return {
        point["trial_number"]: {**point, "lane": lane["hardware"]}
        for lane in status["lanes"]
        for point in lane["history"]
    }


@pytest.fixture(scope="package")  # stopped once this process's acceptance tests are done
def live_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveService]:
    folder = tmp_path_factory.mktemp("acceptance")
    home = folder / "home"
    home.mkdir()
    service = LiveService(data_dir=folder / "bso-data", home=home)
    service.start()
    try:
        yield service
    finally:
        service.kill()


@pytest.fixture
def service(live_service: LiveService) -> LiveService:
    """The session's service, running (a test that stopped it must have restarted it)."""
    if live_service.popen is None or live_service.popen.poll() is not None:
        live_service.popen = None
        live_service.start()
    return live_service
