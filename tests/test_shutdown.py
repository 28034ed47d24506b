"""A trial still ends when its process is stopped: SIGTERM and atexit (bso_client.shutdown).

The subprocess tests cover what only a real process shows: SIGTERM with the
default handler, and the atexit hook.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from pathlib import Path

import pytest

from bso.core.vocabulary import StopReason, TrialStatus
from bso.storage.sql import SqlStore
from bso.storage.sql.engine import upgrade
from bso_client.shutdown import SigtermHandler
from tests.test_optimizer import ROOT, RecordingService, make


def test_sigterm_ends_the_trial_then_calls_the_previous_handler() -> None:
    service = RecordingService()
    seen: list[tuple[int, bool]] = []

    def previous(signum: int, frame: object) -> None:
        seen.append((signum, "end_trial" in service.methods()))

    original = signal.signal(signal.SIGTERM, previous)
    try:
        with make(service) as bso:
            assert signal.getsignal(signal.SIGTERM) == bso._sigterm.handle
            bso.get_batch_size()
            bso.on_train_begin()
            os.kill(os.getpid(), signal.SIGTERM)
            # Python runs the handler between bytecodes of the main thread.
            assert seen == [(signal.SIGTERM, True)]
            assert signal.getsignal(signal.SIGTERM) is previous
        assert signal.getsignal(signal.SIGTERM) is previous
    finally:
        signal.signal(signal.SIGTERM, original)
    assert service.methods().count("end_trial") == 1
    assert service.trial(1).stop_reason is StopReason.INTERRUPTED


def test_a_handler_installed_after_ours_is_left_in_place() -> None:
    """A framework that replaced our handler (Lightning, for ``fit``) restores its own."""
    original = signal.getsignal(signal.SIGTERM)

    def framework(signum: int, frame: object) -> None:
        """Stands in for a framework's own SIGTERM handler."""

    try:
        handler = SigtermHandler(lambda: None)
        handler.install()
        assert signal.getsignal(signal.SIGTERM) == handler.handle
        signal.signal(signal.SIGTERM, framework)
        handler.restore()
        assert signal.getsignal(signal.SIGTERM) is framework
    finally:
        signal.signal(signal.SIGTERM, original)


CHILD = """
import os, signal, sys, time
from bso.service import BsoService
from bso.spec import JobSpec
from bso.storage.sql import SqlStore
from bso_client.energy.time_only import TimeOnlyMonitor
from bso_client.optimizer import BatchSizeOptimizer

spec = JobSpec(job_id="job", batch_sizes=[8, 16], default_batch_size=16, target_metric=0.9)
service = BsoService(SqlStore(sys.argv[1]))
mode = sys.argv[2]
bso = BatchSizeOptimizer(spec, service=service, monitor=TimeOnlyMonitor(), environ={})
if mode == "sigterm":
    bso.__enter__()
bso.get_batch_size()
bso.on_train_begin()
bso.on_evaluate(0.1)
if mode == "sigterm":
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)  # not reached: the default action kills the process
if mode == "oom":
    raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")  # never caught
print("exiting")
"""


@pytest.mark.parametrize(
    ("mode", "returncode"), [("sigterm", -signal.SIGTERM), ("atexit", 0), ("oom", 1)]
)
def test_a_dying_process_ends_its_trial(tmp_path: Path, mode: str, returncode: int) -> None:
    url = f"sqlite:///{tmp_path / 'bso.sqlite3'}"
    upgrade(url)
    child = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CHILD), url, mode],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        check=False,
    )
    assert child.returncode == returncode, child.stderr
    assert ("exiting" in child.stdout) == (mode == "atexit")
    store = SqlStore(url)
    with store.transaction("job") as tx:
        trial = tx.get_trial(1)
    assert trial is not None
    expected = {
        "sigterm": (TrialStatus.INTERRUPTED, StopReason.INTERRUPTED),  # not the size's fault
        "atexit": (TrialStatus.FAILED, StopReason.ABANDONED),  # the script never closed it
        # Died of an exception it never caught: ended with it, as a with block would.
        "oom": (TrialStatus.FAILED, StopReason.OUT_OF_MEMORY),
    }
    assert (trial.status, trial.stop_reason) == expected[mode]
    assert trial.epochs == 1
    # Only the loop that ended on its own, short of the target, is told so.
    assert ("training ended after 1 epoch(s) without an error" in child.stderr) == (
        mode == "atexit"
    ), child.stderr


def test_an_optimizer_dropped_unclosed_stops_its_heartbeats() -> None:
    """A notebook that drops an optimizer it never closed (a cell stopped by Ctrl-C, then
    ``del bso`` or another job) lives on: the heartbeats stop with the object, so the
    lease ends the trial, rather than keeping it running as long as the kernel lives."""
    service = RecordingService()

    def cell() -> weakref.ref[object]:
        bso = make(service, heartbeat_interval_s=0.05)
        bso.get_batch_size()
        bso.on_train_begin()
        return weakref.ref(bso)

    def heartbeat_threads() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name.startswith("bso-heartbeat")}

    others = heartbeat_threads()  # of earlier tests in this process, if any
    dropped = cell()
    gc.collect()
    assert dropped() is None
    time.sleep(0.3)
    beats = service.methods().count("heartbeat")
    time.sleep(0.3)
    assert service.methods().count("heartbeat") == beats
    assert heartbeat_threads() <= others


def test_blocks_closed_out_of_order_put_the_first_handler_back() -> None:
    """Two runs entered A then B and closed A then B (two generators or asyncio tasks
    training side by side): B's restore used to put back A's handler, whose block was
    over, and each such pair left one more closed run behind it, for good."""
    original = signal.getsignal(signal.SIGTERM)
    try:
        first, second = SigtermHandler(lambda: None), SigtermHandler(lambda: None)
        first.install()
        second.install()
        first.restore()
        assert signal.getsignal(signal.SIGTERM) == second.handle
        second.restore()
        assert signal.getsignal(signal.SIGTERM) == original
    finally:
        signal.signal(signal.SIGTERM, original)


STALE_CHILD = """
import os, signal, sys, time
from bso_client.shutdown import SigtermHandler

first = SigtermHandler(lambda: print("ended first", flush=True))
first.install()
if sys.argv[1] == "out-of-order":  # A, B entered; A closed, B still in its block
    second = SigtermHandler(lambda: print("ended second", flush=True))
    second.install()
    first.restore()
else:  # a framework's handler, installed in the block, put ours back after it
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    first.restore()
    signal.signal(signal.SIGTERM, first.handle)
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(30)  # not reached: the process dies of the signal
print("alive")
"""


@pytest.mark.parametrize(
    ("how", "ended"), [("out-of-order", ["ended second"]), ("put-back-by-a-framework", [])]
)
def test_a_handler_whose_block_is_over_lets_sigterm_kill_the_process(
    how: str, ended: list[str]
) -> None:
    """A handler whose block was over but that SIGTERM still reached (chained behind
    a later run's, or put back by a framework's restore) used to end its closed run
    again ("SIGTERM: ending bso trial N" for a trial long over), then hand the signal
    to the default by sending it again while it was itself still installed: the
    signal came back to it, again and again, until a RecursionError surfaced in the
    training code instead of the process dying of SIGTERM.  It now only hands the
    signal on, and only the open run's trial is ended."""
    child = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(STALE_CHILD), how],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        check=False,
    )
    assert child.returncode == -signal.SIGTERM, child.stdout + child.stderr[-2000:]
    assert child.stdout.splitlines() == ended, child.stdout


FORKING_CHILD = """
import multiprocessing, os, sys, time
from bso.service import BsoService
from bso.spec import JobSpec
from bso.storage.sql import SqlStore
from bso_client.energy.time_only import TimeOnlyMonitor
from bso_client.optimizer import BatchSizeOptimizer

def nap(seconds):
    time.sleep(seconds)

spec = JobSpec(job_id="job", batch_sizes=[8, 16], default_batch_size=16, target_metric=0.9)
service = BsoService(SqlStore(sys.argv[1]))
bso = BatchSizeOptimizer(spec, service=service, monitor=TimeOnlyMonitor(), environ={})
if sys.argv[2] == "pool":
    bso.__enter__()
bso.get_batch_size()
bso.on_train_begin()
bso.on_evaluate(0.1)
if sys.argv[2] == "pool":  # Pool.__exit__ terminates its workers: SIGTERM to each
    pool = multiprocessing.get_context("fork").Pool(2)
    pool.map_async(nap, [30, 30])
    time.sleep(0.5)
    pool.terminate()
    pool.join()
else:  # a forked child that exits through sys.exit runs the atexit hooks it inherited
    pid = os.fork()
    if pid == 0:
        sys.exit(0)
    os.waitpid(pid, 0)
print(bso.on_evaluate(0.95).reason.value, flush=True)
bso.close()
"""


@pytest.mark.parametrize("how", ["pool", "forked-exit"])
def test_a_forked_child_never_ends_its_parents_trial(tmp_path: Path, how: str) -> None:
    """A ``multiprocessing`` pool forked inside the block (the default start method on
    Linux) and terminated, as ``with Pool()`` does at its end, sent SIGTERM to workers
    that had inherited bso's handler: each ended the parent's trial as interrupted, the
    parent's next report was refused, and its converged run was never learned.  A
    forked child that exits through ``sys.exit`` did the same through the atexit hook."""
    url = f"sqlite:///{tmp_path / 'bso.sqlite3'}"
    upgrade(url)
    child = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(FORKING_CHILD), url, how],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        check=False,
    )
    assert child.returncode == 0, child.stderr
    assert child.stdout.split() == ["target_reached"], child.stdout + child.stderr[-2000:]
    assert "SIGTERM: ending bso trial" not in child.stderr
    with SqlStore(url).transaction("job") as tx:
        trial = tx.get_trial(1)
    assert trial is not None
    assert (trial.status, trial.stop_reason) == (TrialStatus.CONVERGED, StopReason.TARGET_REACHED)
