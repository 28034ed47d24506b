"""The examples, run as users run them.

The plain PyTorch example runs end to end against the live service: a real
Redis, real Celery worker processes and a SQLite store, started exactly as
``bso up`` starts them (tests/fixtures), with the example as a subprocess,
several times in a row like a recurring job.  The Lightning and Hugging Face
examples run once each, in process, against the in-process service.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

from bso.core.vocabulary import TrialStatus
from bso.service import BsoService
from bso.storage.memory import MemoryStore
from bso.storage.sql.engine import upgrade
from tests.fixtures.celery_workers import WorkerCluster

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
RECURRENCES = 4
EXIT_RELAUNCH = 3


@pytest.fixture
def one_thread() -> Iterator[None]:
    """What the examples' main() does: tiny models only lose time to threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def load_example(name: str) -> ModuleType:
    """Import ``examples/<name>.py`` (examples are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.integration
def test_the_plain_example_recurs_against_the_live_service(
    worker_cluster_factory: Callable[..., WorkerCluster], tmp_path: Path
) -> None:
    database_url = f"sqlite:///{tmp_path / 'bso.sqlite3'}"
    upgrade(database_url)
    cluster = worker_cluster_factory(database_url, nodes=2)
    runs = []
    for _ in range(RECURRENCES):
        run = subprocess.run(
            [
                sys.executable,
                str(EXAMPLES / "train_mnist_like.py"),
                "--broker-url",
                cluster.settings.broker_url,
                "--job-id",
                "mnist-like-e2e",
                "--timeout-s",
                "30",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
            env={**os.environ, "BSO_API_KEY": cluster.api_key},  # as a user sets it
            check=False,
        )
        assert run.returncode in (0, EXIT_RELAUNCH), run.stderr + cluster.logs()
        summary = json.loads(run.stdout.strip().splitlines()[-1])
        runs.append(summary)
        if run.returncode == EXIT_RELAUNCH:
            assert "launch the job again" in run.stderr
        else:
            assert summary["converged"], summary
            assert summary["accuracy"] >= 0.78  # it learned, up to the target
        assert "measuring time only" in run.stderr  # no GPU here: said out loud
    assert [r["trial_number"] for r in runs] == list(range(1, RECURRENCES + 1))
    assert runs[0]["batch_size"] == 64  # the default is explored first
    assert runs[0]["converged"]
    assert len({r["batch_size"] for r in runs}) > 1  # and then other sizes

    status = cluster.client().status("mnist-like-e2e")
    (lane,) = status.lanes
    assert lane.hardware.gpu_model == "cpu-time-only"
    assert lane.trials == RECURRENCES
    assert lane.running_trials == 0  # every run ended its trial
    assert sum(s.converged for s in lane.sizes) == sum(r["converged"] for r in runs)
    assert lane.recommended_batch_size in {r["batch_size"] for r in runs if r["converged"]}


@pytest.mark.usefixtures("one_thread")
def test_the_lightning_example_runs() -> None:
    example = load_example("lightning_example")
    service = BsoService(MemoryStore())
    summary = example.run(service=service, max_epochs=3, target=0.3)
    assert summary["converged"]
    assert summary["trial_number"] == 1
    with service.store.transaction("mnist-like-lightning") as tx:
        trial = tx.get_trial(1)
    assert trial is not None
    assert trial.status is TrialStatus.CONVERGED


@pytest.mark.usefixtures("one_thread")
def test_the_hf_example_runs() -> None:
    example = load_example("hf_example")
    service = BsoService(MemoryStore())
    summary = example.run(service=service, max_epochs=2, target=0.0)
    assert summary["converged"]
    with service.store.transaction("tiny-bert-hf") as tx:
        trial = tx.get_trial(1)
    assert trial is not None
    assert trial.status is TrialStatus.CONVERGED


def test_an_example_started_without_the_broker_url_says_where_it_is() -> None:
    """A shell that never sourced credentials.env: the example used to fall back to
    redis://127.0.0.1:6379/0, another Redis on this machine, train without bso and
    leave its register event queued there.  It stops at once, naming the file."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BSO_")}
    run = subprocess.run(
        [sys.executable, str(EXAMPLES / "train_mnist_like.py")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=env,
        check=False,
    )
    assert run.returncode != 0
    assert "BSO_BROKER_URL is not set" in run.stderr
    assert "credentials.env" in run.stderr
