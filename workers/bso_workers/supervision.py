"""Child processes supervised as a group: started in their own session, stopped together.

Every child runs in its own session (so a terminal's Ctrl-C reaches only the
supervisor, which then stops the children in order) and, on Linux, is told by
the kernel to exit should the supervisor die without cleaning up.  Kept by hand
rather than taken from a process manager: see the plumbing table in
docs/architecture.md.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

READY_TIMEOUT_S = 60.0

STOP_TIMEOUT_S = 15.0

_PR_SET_PDEATHSIG = 1


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        port: int = probe.getsockname()[1]
        return port


def _child_setup() -> None:
    """Run in each child before exec: own session, files for the owner alone (Redis
    rewrites its ACL file on ``ACL SAVE``, and its append-only file holds every
    queued event), and die with the supervisor: with the *thread* that started it,
    as Linux sends the parent-death signal when that thread ends, so a child meant
    to outlive a helper thread must be started from one that lives as long."""
    os.setsid()
    os.umask(0o077)
    if sys.platform == "linux":
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass
class ManagedProcess:
    """A child started in its own process group, stopped as a group."""

    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal_group(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signum)

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM the group, wait, SIGKILL what is left; returns the exit code."""
        stop_together([self], timeout_s)
        return self.popen.returncode

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


MAX_WORKER_RESTARTS = 5
"""Worker nodes that exit on their own are started again, up to this many times
within :data:`RESTART_WINDOW_S`; past that something is wrong that a restart
will not fix, and the stack stops."""
RESTART_WINDOW_S = 300.0


@dataclass
class Restarts:
    """When each child was started again, so that one that keeps dying is not: past
    ``limit`` restarts within ``window_s`` a restart will not fix what kills it."""

    limit: int = MAX_WORKER_RESTARTS
    window_s: float = RESTART_WINDOW_S
    _times: dict[str, list[float]] = field(default_factory=dict)

    def left(self, name: str, now: float) -> bool:
        recent = [t for t in self._times.get(name, []) if now - t < self.window_s]
        self._times[name] = recent
        return len(recent) < self.limit

    def note(self, name: str, now: float) -> None:
        self._times.setdefault(name, []).append(now)


def stop_together(processes: Sequence[ManagedProcess], timeout_s: float = STOP_TIMEOUT_S) -> None:
    """Stop several children at once: SIGTERM each, one shared wait, then SIGKILL.

    SIGTERM goes to the child alone, not its group: a Celery node turns it into
    a warm shutdown (its pool processes finish their running events first),
    while a pool process that got SIGTERM itself would die mid-event.  What is
    left of the group afterwards is killed.  Celery's warm shutdown takes a
    second or two per node; in parallel, a stack stops in the time of its
    slowest member.
    """
    for process in processes:
        if process.alive():
            process.popen.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for process in processes:
        try:
            process.popen.wait(max(deadline - time.monotonic(), 0))
        except subprocess.TimeoutExpired:
            process.signal_group(signal.SIGKILL)
            process.popen.wait()
        process.signal_group(signal.SIGKILL)


def spawn(
    name: str, argv: Sequence[str], log_dir: Path, env: dict[str, str], cwd: Path
) -> ManagedProcess:
    """Start ``argv`` with stdout and stderr appended to ``log_dir/<name>.log``."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    with log_path.open("ab") as log:
        popen = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=cwd,
            preexec_fn=_child_setup,  # noqa: PLW1509 (no threads run at this point)
        )
    return ManagedProcess(name, popen, log_path)


def wait_until(
    ready: Callable[[], bool], what: str, timeout_s: float, watch: Sequence[ManagedProcess] = ()
) -> None:
    """Poll ``ready`` until true; fail early, with its log, if a watched child dies."""
    deadline = time.monotonic() + timeout_s
    while True:
        for process in watch:
            if not process.alive():
                raise RuntimeError(
                    f"{process.name} exited ({process.popen.returncode}) while waiting for "
                    f"{what}; last lines of {process.log_path}:\n{process.log_tail()}"
                )
        if ready():
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not ready after {timeout_s:g} s")
        time.sleep(0.1)


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


class Stopper:
    """What SIGINT and SIGTERM do while installed by :func:`stop_signals`.

    They set :attr:`requested`, which a supervising loop polls.  While starting
    (inside :meth:`interruptible`) the first one also raises KeyboardInterrupt,
    so that a start-up that may take a minute stops at once; the caller then
    stops what was already started (:meth:`Stack.stop` is idempotent).
    """

    def __init__(self) -> None:
        self.requested = threading.Event()
        self._raise = False

    def handle(self, _signum: int, _frame: FrameType | None) -> None:
        self.requested.set()
        if self._raise:
            self._raise = False
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def interruptible(self) -> Iterator[None]:
        """Raise KeyboardInterrupt for a stop requested before or during the block,
        even if a library swallowed the one raised by the signal handler."""
        self._raise = True
        try:
            yield
        finally:
            self._raise = False
        if self.requested.is_set():
            raise KeyboardInterrupt


@contextlib.contextmanager
def stop_signals() -> Iterator[Stopper]:
    """Route SIGINT and SIGTERM to a :class:`Stopper` inside the block."""
    stopper = Stopper()
    previous = {s: signal.signal(s, stopper.handle) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stopper
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)
