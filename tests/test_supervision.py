"""Children started in their own session, watched, and stopped together."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from bso_workers.supervision import (
    Stopper,
    free_port,
    spawn,
    stop_signals,
    stop_together,
    wait_until,
)

SLEEPER = [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"]


def test_a_child_runs_in_its_own_session_and_logs_to_its_file(tmp_path: Path) -> None:
    child = spawn("sleeper", SLEEPER, tmp_path / "logs", dict(os.environ), tmp_path)
    try:
        assert os.getsid(child.pid) == child.pid != os.getsid(0)
        wait_until(lambda: "up" in child.log_tail(), "the child's first line", 10, [child])
        assert child.log_path == tmp_path / "logs" / "sleeper.log"
    finally:
        child.stop()
    assert not child.alive()


def test_stop_together_ends_every_child_in_one_shared_wait(tmp_path: Path) -> None:
    children = [
        spawn(f"s{i}", SLEEPER, tmp_path / "logs", dict(os.environ), tmp_path) for i in range(3)
    ]
    started = time.monotonic()
    stop_together(children, timeout_s=10)
    assert time.monotonic() - started < 10
    assert [c.popen.returncode for c in children] == [-signal.SIGTERM] * 3


def test_a_child_that_ignores_sigterm_is_killed_after_the_timeout(tmp_path: Path) -> None:
    stubborn = [
        sys.executable,
        "-c",
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print('up', flush=True); time.sleep(60)",
    ]
    child = spawn("stubborn", stubborn, tmp_path / "logs", dict(os.environ), tmp_path)
    wait_until(lambda: "up" in child.log_tail(), "the child's first line", 10, [child])
    stop_together([child], timeout_s=0.5)
    assert child.popen.returncode == -signal.SIGKILL


def test_waiting_fails_at_once_with_the_log_when_a_watched_child_dies(tmp_path: Path) -> None:
    dying = [sys.executable, "-c", "print('cannot bind'); raise SystemExit(3)"]
    child = spawn("dying", dying, tmp_path / "logs", dict(os.environ), tmp_path)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"(?s)dying exited \(3\).*cannot bind"):
        wait_until(lambda: False, "something", 30, [child])
    assert time.monotonic() - started < 10


def test_waiting_times_out_naming_what_it_waited_for() -> None:
    with pytest.raises(TimeoutError, match=r"the moon not ready after 0\.2 s"):
        wait_until(lambda: False, "the moon", 0.2)


def test_a_stop_requested_while_starting_interrupts_the_start() -> None:
    stopper = Stopper()
    stopper.requested.set()  # the signal came, and a library swallowed its exception
    with pytest.raises(KeyboardInterrupt), stopper.interruptible():
        pass


def test_stop_signals_route_sigterm_to_the_stopper_and_restore_the_handler() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with stop_signals() as stopper:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stopper.requested.wait(5)
    assert signal.getsignal(signal.SIGTERM) == before


def test_free_port_is_bindable() -> None:
    import socket

    port = free_port()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", port))
