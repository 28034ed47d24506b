"""RunStatus: how a run ended, in a file and a last line a launcher does not rewrite.

In process against the in-process service for each outcome; once under a real
``torchrun --nproc_per_node 2`` (gloo, CPU) with the plain example against the
live service, where torchrun exits 1 whatever the ranks' codes were.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from bso.service import BsoService
from bso.storage.memory import MemoryStore
from bso.storage.sql.engine import upgrade
from bso_client.energy.time_only import TimeOnlyMonitor
from bso_client.errors import TrainFailError
from bso_client.optimizer import BatchSizeOptimizer
from bso_client.run_status import EXIT_RELAUNCH, STATUS_FILE_ENV, RunStatus
from tests.fixtures.celery_workers import WorkerCluster

ROOT = Path(__file__).resolve().parents[1]
JOB: dict[str, Any] = {
    "job_id": "status",
    "batch_sizes": [16, 32],
    "default_batch_size": 16,
    "target_metric": 0.9,
    "max_epochs": 2,
}


def optimizer(service: BsoService) -> BatchSizeOptimizer:
    return BatchSizeOptimizer(JOB, service=service, monitor=TimeOnlyMonitor())


def run(
    path: Path, body: Callable[[BatchSizeOptimizer], None], status: RunStatus | None = None
) -> RunStatus:
    """One run under a RunStatus writing ``path``; exceptions are the caller's to expect."""
    status = status or RunStatus(environ={STATUS_FILE_ENV: str(path)})
    with status, optimizer(BsoService(MemoryStore())) as bso:
        status.watch(bso)
        assert json.loads(path.read_text())["outcome"] == "running"  # killed: still this
        body(bso)
    return status


def test_a_run_stopped_unconverged_says_relaunch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "status.json"

    def two_poor_epochs(bso: BatchSizeOptimizer) -> None:
        bso.on_train_begin()
        bso.on_evaluate(0.1)
        bso.on_evaluate(0.2)  # max_epochs: the service stops it unconverged

    status = RunStatus(environ={STATUS_FILE_ENV: str(path)})
    with pytest.raises(TrainFailError):
        run(path, two_poor_epochs, status)
    written = json.loads(path.read_text())
    assert written["outcome"] == "relaunch"
    assert (written["exit_code"], status.exit_code) == (EXIT_RELAUNCH, EXIT_RELAUNCH)
    assert (written["job_id"], written["trial_number"], written["batch_size"]) == ("status", 1, 16)
    assert written["reason"] == "max_epochs"
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == "bso: RELAUNCH job=status trial=1 batch_size=16 reason=max_epochs"


def test_a_script_that_catches_train_fail_error_still_reads_relaunch(tmp_path: Path) -> None:
    def caught(bso: BatchSizeOptimizer) -> None:
        bso.on_train_begin()
        bso.on_evaluate(0.1)
        with pytest.raises(TrainFailError):
            bso.on_evaluate(0.2)

    assert run(tmp_path / "s.json", caught).outcome == "relaunch"


def test_converged_and_finished_exit_zero(tmp_path: Path) -> None:
    def converges(bso: BatchSizeOptimizer) -> None:
        bso.on_train_begin()
        bso.on_evaluate(0.95)

    converged = run(tmp_path / "c.json", converges)
    assert (converged.outcome, converged.exit_code) == ("converged", 0)
    finished = run(tmp_path / "f.json", lambda bso: None)  # ended before bso stopped it
    assert (finished.outcome, finished.exit_code) == ("finished", 0)
    assert json.loads((tmp_path / "f.json").read_text())["outcome"] == "finished"


def test_a_crash_and_an_interrupt_are_told_apart(tmp_path: Path) -> None:
    def crash(bso: BatchSizeOptimizer) -> None:
        raise RuntimeError("a bug in the script")

    with pytest.raises(RuntimeError):
        run(tmp_path / "crash.json", crash)
    written = json.loads((tmp_path / "crash.json").read_text())
    assert (written["outcome"], written["exit_code"]) == ("crashed", 1)
    assert written["error"] == "RuntimeError: a bug in the script"

    def ctrl_c(bso: BatchSizeOptimizer) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "int.json", ctrl_c)
    assert json.loads((tmp_path / "int.json").read_text())["outcome"] == "interrupted"


def test_no_file_unless_asked_and_none_from_other_ranks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    with RunStatus(environ={}):
        pass
    with RunStatus(tmp_path / "rank1.json", environ={"RANK": "1"}):
        pass
    assert list(tmp_path.iterdir()) == []
    assert capsys.readouterr().err.count("bso: FINISHED") == 1  # rank 0's line only


def test_an_unwritable_file_costs_a_warning_not_the_run(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    status = RunStatus(blocker / "status.json", environ={})
    with status:
        pass
    assert status.outcome == "finished"
    assert "could not write the run status file" in caplog.text


@pytest.mark.integration
@pytest.mark.skipif(
    shutil.which("torchrun", path=str(Path(sys.executable).parent)) is None,
    reason="torchrun is not installed",
)
def test_relaunch_is_visible_under_torchrun(
    worker_cluster_factory: Callable[..., WorkerCluster], tmp_path: Path
) -> None:
    database_url = f"sqlite:///{tmp_path / 'bso.sqlite3'}"
    upgrade(database_url)
    cluster = worker_cluster_factory(database_url)
    path = tmp_path / "run-status.json"
    torchrun = str(Path(sys.executable).parent / "torchrun")
    launched = subprocess.run(
        [
            torchrun,
            "--nproc_per_node",
            "2",
            str(ROOT / "examples" / "train_mnist_like.py"),
            "--broker-url",
            cluster.settings.broker_url,
            "--job-id",
            "ddp-relaunch",
            "--target",
            "0.999",
            "--max-epochs",
            "1",
            "--timeout-s",
            "30",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
        env={
            **os.environ,
            "BSO_API_KEY": cluster.api_key,
            STATUS_FILE_ENV: str(path),
            "OMP_NUM_THREADS": "1",
        },
        check=False,
    )
    assert launched.returncode == 1  # torchrun's own code: a rank exited 3
    written = json.loads(path.read_text())
    assert written["outcome"] == "relaunch", launched.stderr + cluster.logs()
    assert (written["job_id"], written["trial_number"], written["world_size"]) == (
        "ddp-relaunch",
        1,
        2,
    )
    lines = [line for line in launched.stderr.splitlines() if line.startswith("bso: ")]
    assert lines[-1] == (
        f"bso: RELAUNCH job=ddp-relaunch trial=1 batch_size={written['batch_size']} "
        "reason=max_epochs"
    )
    summary = json.loads(launched.stdout.strip().splitlines()[-1])  # rank 0's only
    assert summary["per_device_batch_size"] * 2 == summary["batch_size"] == 64
    (lane,) = cluster.client().status("ddp-relaunch").lanes
    assert lane.hardware.key == "cpu-time-only x1 dp2"


SIGTERMED = """
import os, signal, sys
from bso.service import BsoService
from bso.storage.memory import MemoryStore
from bso_client.energy.time_only import TimeOnlyMonitor
from bso_client.optimizer import BatchSizeOptimizer
from bso_client.run_status import RunStatus

job = {"job_id": "status", "batch_sizes": [16, 32], "default_batch_size": 16,
       "target_metric": 0.9, "max_epochs": 2}
status = RunStatus()
with status, BatchSizeOptimizer(
    job, service=BsoService(MemoryStore()), monitor=TimeOnlyMonitor()
) as bso:
    status.watch(bso)
    bso.on_train_begin()
    os.kill(os.getpid(), signal.SIGTERM)  # a preemption: the process dies of it
print("not reached")
"""


def test_a_run_killed_by_sigterm_says_interrupted_not_running(tmp_path: Path) -> None:
    """The process dies of the signal before the with block ends; a file left at
    "running" reads as a crash (SIGKILL) to a scheduler, so it says interrupted."""
    path = tmp_path / "run-status.json"
    child = subprocess.run(
        [sys.executable, "-c", SIGTERMED],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, STATUS_FILE_ENV: str(path)},
        check=False,
    )
    assert child.returncode == -15, child.stderr  # died of SIGTERM, as without bso
    assert "not reached" not in child.stdout
    written = json.loads(path.read_text())
    assert (written["outcome"], written["exit_code"], written["reason"]) == (
        "interrupted",
        130,
        "SIGTERM",
    )
    assert (
        child.stderr.splitlines()[-1]
        == "bso: INTERRUPTED job=status trial=1 batch_size=16 reason=SIGTERM"
    )
