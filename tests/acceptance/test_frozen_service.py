"""A service that hangs rather than goes away, against a live ``bso up``: its Redis or
its Celery workers stopped (``SIGSTOP``) mid-run, then let go on (``SIGCONT``).

Unlike a stopped ``bso up`` (test_faults.py), nothing refuses a connection: Redis
accepts and never answers, or takes events that no worker takes.  From the
trainer's seat: no epoch waits on bso longer than the client's bound
(``unavailable_bound_s``, 5 s by default), the run trains every epoch with one
warning, and once the service goes on its epochs reach ``bso status`` exactly
once, with no trial left running.
"""

from __future__ import annotations

import itertools
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from tests.acceptance.conftest import (
    EXIT_RELAUNCH,
    RUN_TIMEOUT_S,
    LiveService,
    TrainerRun,
    record_time,
    run_trainer,
    trainer_argv,
    trials_of,
)
from tests.acceptance.test_faults import is_detached, start_trainer

pytestmark = pytest.mark.integration

BOUND_S = 5.0
"""The client's default ``unavailable_bound_s``."""
EPOCH_S = 1.5
FROZEN_S = 12.0
"""Longer than the bound, so that the run must detach rather than wait."""


def children(pid: int) -> dict[int, str]:
    """``pid``'s child processes and their command lines (from /proc)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            argv = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid:
            found[int(entry.name)] = argv
    return found


def frozen_pids(service: LiveService, part: str) -> list[int]:
    assert service.popen is not None
    mine = children(service.popen.pid)
    if part == "redis":
        pids = [p for p, argv in mine.items() if "redis-server" in argv]
    else:
        pids = [p for p, argv in mine.items() if "bso_workers.app worker" in argv]
    assert pids, mine
    return pids


def freeze(pids: list[int], seconds: float) -> threading.Timer:
    """``SIGSTOP`` ``pids`` now and ``SIGCONT`` them after ``seconds`` (or at ``cancel``
    and ``thaw``: a test that fails still lets them go on)."""
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    timer = threading.Timer(seconds, thaw, args=(pids,))
    timer.start()
    return timer


def thaw(pids: list[int]) -> None:
    for pid in pids:
        os.kill(pid, signal.SIGCONT)


def run_frozen_after_epoch_1(
    service: LiveService,
    argv: list[str],
    env: dict[str, str],
    part: str,
    *,
    frozen_s: float,
    at: str = "epoch 1 ",
) -> tuple[TrainerRun, list[float]]:
    """Run the trainer; once it prints a line that starts with ``at`` (by default: it
    trained epoch 1, whose report comes next), freeze ``part`` of the service for
    ``frozen_s``.  Returns the run and when each epoch line came."""
    t0 = time.monotonic()
    popen, status_file = start_trainer(argv, env)
    assert popen.stdout is not None
    pids = frozen_pids(service, part)
    read, arrivals, timer = [], [], None
    try:
        for line in popen.stdout:
            read.append(line)
            if line.startswith("epoch "):
                arrivals.append(time.monotonic())
            if timer is None and line.startswith(at):
                timer = freeze(pids, frozen_s)
        stdout, stderr = popen.communicate(timeout=RUN_TIMEOUT_S)
    finally:
        if timer is not None:
            timer.cancel()
        thaw(pids)
    run = TrainerRun(argv, popen.returncode, "".join(read) + stdout, stderr, time.monotonic() - t0)
    run.status_file = status_file
    record_time(run)
    assert timer is not None, str(run)
    return run, arrivals


@pytest.mark.parametrize("part", ["redis", "workers"])
def test_a_service_frozen_mid_run_stalls_no_epoch_past_the_bound(
    service: LiveService, part: str
) -> None:
    job = f"acceptance-frozen-{part}"

    def argv_of(epoch_s: float) -> list[str]:
        return trainer_argv(
            "mnist_loop", "--job-id", job, "--target", "0.999", "--max-epochs", "8",
            "--epoch-seconds", str(epoch_s),
        )  # fmt: skip

    argv = argv_of(EPOCH_S)
    # Frozen after epoch 1, whose report comes next.
    run, arrivals = run_frozen_after_epoch_1(service, argv, service.env(), part, frozen_s=FROZEN_S)
    assert run.returncode in (0, EXIT_RELAUNCH), str(run)
    assert run.epochs == list(range(1, 9)), str(run)  # every epoch trained
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    assert max(gaps) < EPOCH_S + BOUND_S + 3.0, (gaps, str(run))  # 3 s: 2 busy cores
    assert run.summary["detached"], str(run)
    (warning,) = run.bso_lines("WARNING")
    assert "unavailable within 5 s (unavailable_bound_s)" in warning, warning
    assert service.password not in run.stderr

    # The next recurrence delivers the journal, if the exit did not (its epochs need
    # not wait: nothing is frozen now).
    after = run_trainer(argv_of(0.2), service.env())
    assert after.returncode == EXIT_RELAUNCH, str(after)
    status = service.status(job)
    trials = trials_of(status)
    assert len(trials) == 2, trials
    (detached,) = [t for t in trials.values() if t.get("detached")]
    assert detached["epochs"] == 8, detached  # each epoch delivered exactly once
    assert all(lane["running_trials"] == 0 for lane in status["lanes"]), status


def test_workers_frozen_between_two_reports_cost_the_run_nothing(service: LiveService) -> None:
    """The workers freeze for 2.5 bounds while an epoch trains (a node restarting, a
    database holding its lock), and go on before the epoch's report: the heartbeats
    sent meanwhile go unanswered, but the lease (20 misses of 1 s) outlasts the
    freeze.  The run stays attached, with no warning, and every epoch is the trial's.
    One unanswered heartbeat used to mark the service down for the rest of the run,
    which then trained detached: bso could no longer stop it early."""
    job = "acceptance-frozen-between-reports"
    bound_s, epoch_s = 2.0, 8.0
    argv = trainer_argv(
        "mnist_loop", "--job-id", job, "--target", "0.999", "--max-epochs", "2",
        "--epoch-seconds", str(epoch_s), "--heartbeat-interval", str(bound_s / 2),
        "--heartbeat-misses", "20",
    )  # fmt: skip
    env = service.env(BSO_UNAVAILABLE_BOUND_S=str(bound_s))
    # Epoch 1's report answered: frozen in epoch 2's padding, no report due.
    run, _ = run_frozen_after_epoch_1(
        service, argv, env, "workers", frozen_s=2.5 * bound_s, at="reported epoch 1"
    )
    assert run.returncode == EXIT_RELAUNCH, str(run)  # max_epochs: bso's own verdict
    assert run.epochs == [1, 2], str(run)
    assert not run.summary["detached"], str(run)
    assert run.bso_lines("WARNING") == [], str(run)
    [trial] = trials_of(service.status(job)).values()
    assert trial["epochs"] == 2, trial
    assert not is_detached(trial), trial
