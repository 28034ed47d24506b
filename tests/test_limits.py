"""bso's own task time limits: the soft one interrupts, the hard one kills the process."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from billiard.exceptions import SoftTimeLimitExceeded

from bso_workers.limits import HARD_LIMIT_EXIT_CODE, TimeLimits


def test_a_block_past_the_soft_limit_is_interrupted() -> None:
    limits = TimeLimits(soft_s=0.1, hard_s=30)
    started = time.monotonic()
    with (
        pytest.raises(SoftTimeLimitExceeded, match=r"soft time limit \(0.1 s\)"),
        limits.enforce("slow"),
    ):
        time.sleep(5)
    assert time.monotonic() - started < 2


def test_a_block_within_the_limit_leaves_no_timer_behind() -> None:
    limits = TimeLimits(soft_s=0.2, hard_s=30)
    with limits.enforce("quick"):
        pass
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    limits._on_alarm(signal.SIGALRM, None)  # a timer that raced the block's end does not raise


def test_a_timer_firing_as_the_block_ends_neither_escapes_nor_keeps_the_hard_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    limits = TimeLimits(soft_s=5, hard_s=30)
    real_setitimer = signal.setitimer
    fired: list[bool] = []

    def setitimer(which: int, seconds: float, interval: float = 0.0) -> tuple[float, float]:
        if seconds == 0 and not fired:  # the handler runs just as the block is left
            fired.append(True)
            limits._soft_armed = True
            limits._on_alarm(signal.SIGALRM, None)
        return real_setitimer(which, seconds, interval)

    monkeypatch.setattr(signal, "setitimer", setitimer)
    with limits.enforce("finishing"):
        pass
    assert fired == [True]
    assert limits._deadline is None  # the watchdog will not end this process later
    assert real_setitimer(signal.ITIMER_REAL, 0) == (0.0, 0.0)


def test_a_task_on_another_thread_gets_no_soft_limit() -> None:
    limits = TimeLimits(soft_s=0.05, hard_s=30)
    failures: list[BaseException] = []

    def task() -> None:
        try:
            with limits.enforce("threaded"):
                time.sleep(0.3)
        except BaseException as exc:
            failures.append(exc)

    thread = threading.Thread(target=task)
    thread.start()
    thread.join()
    assert failures == []


def test_limits_must_be_ordered() -> None:
    with pytest.raises(ValueError, match="soft limit"):
        TimeLimits(soft_s=5, hard_s=5)


HARD_LIMIT_SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    from billiard.exceptions import SoftTimeLimitExceeded
    from bso_workers.limits import TimeLimits

    limits = TimeLimits(soft_s=0.1, hard_s=0.5)
    with limits.enforce("warm-up"):
        pass
    if sys.argv[1] == "fork":  # a prefork child: its own watchdog, not the parent's
        pid = os.fork()
        if pid:
            _, status = os.waitpid(pid, 0)
            print("child exited with", os.WEXITSTATUS(status) if os.WIFEXITED(status) else None)
            sys.exit(0)
    with limits.enforce("stuck"):
        try:
            time.sleep(30)
        except SoftTimeLimitExceeded:
            print("soft limit seen", flush=True)
            time.sleep(30)  # ignores it, as code stuck in a C call would
    print("survived")
    """
)


def run_hard_limit_script(mode: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", HARD_LIMIT_SCRIPT, mode],
        capture_output=True,
        text=True,
        timeout=20,
        check=False,
    )


def test_a_task_past_the_hard_limit_ends_its_process() -> None:
    started = time.monotonic()
    result = run_hard_limit_script("inline")
    assert result.returncode == HARD_LIMIT_EXIT_CODE, result
    assert time.monotonic() - started < 10
    assert "soft limit seen" in result.stdout
    assert "survived" not in result.stdout
    assert "hard time limit (0.5 s) exceeded by stuck" in result.stderr


def test_a_forked_process_enforces_its_own_hard_limit() -> None:
    result = run_hard_limit_script("fork")
    assert result.returncode == 0, result
    assert f"child exited with {HARD_LIMIT_EXIT_CODE}" in result.stdout
