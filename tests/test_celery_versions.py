"""The queue message the client builds without Celery, against real workers of the
lowest and the highest Celery the project allows.

The client enqueues an event with one ``LPUSH`` of a message it builds itself
(:mod:`bso.wire.message`): its Redis user may run nothing else, which Celery's
``send_task`` would need.  So nothing but this test ties that message to what
Celery's workers accept.  It runs a worker node on Celery as installed (the
newest the project allows, the one a fresh install gets) and on the lowest
version ``pyproject.toml`` allows, installed with its own lowest kombu into a
folder of its own (``.celery-versions/``, made on first use) that the worker
finds first on its ``PYTHONPATH``; the client then drives a job through it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path

import pytest

from bso.spec import JobSpec
from bso.wire.events import TrialAssigned
from tests.fixtures.celery_workers import WorkerCluster

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".celery-versions"


def lowest_allowed(package: str) -> str:
    """The lowest version of ``package`` the server extra allows (``>=X.Y`` -> ``X.Y.0``)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for requirement in project["optional-dependencies"]["server"]:
        found = re.fullmatch(rf"{package}(\[[^\]]*\])?>=([0-9.]+)", requirement.strip())
        if found:
            parts = found.group(2).split(".")
            return ".".join([*parts, "0", "0"][:3])
    raise AssertionError(f"pyproject.toml's server extra has no lower bound for {package}")


def lowest_kombu(celery: str) -> str:
    """The lowest kombu that Celery ``celery`` declares it works with."""
    with tempfile.TemporaryDirectory() as probe:
        install(Path(probe), "--no-deps", f"celery=={celery}")
        metadata = next(Path(probe).glob(f"celery-{celery}.dist-info")) / "METADATA"
        for line in metadata.read_text().splitlines():
            found = re.fullmatch(r"Requires-Dist: kombu\s*\(?<?[^>\[]*>=([0-9.]+).*", line)
            if found:
                return found.group(1)
    raise AssertionError(f"celery {celery} declares no kombu lower bound")


def install(folder: Path, *requirements: str) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--target", str(folder), *requirements],
        check=True,
        timeout=300,
    )


def version_under(folder: Path, package: str) -> str:
    """``package``'s version as a worker whose PYTHONPATH starts with ``folder`` imports it."""
    return subprocess.run(
        [sys.executable, "-c", f"import {package}; print({package}.__version__)"],
        env={**os.environ, "PYTHONPATH": str(folder)},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()


@pytest.fixture(scope="module")
def lowest_celery() -> tuple[str, str, Path]:
    """(celery version, its lowest kombu, the folder holding both, for a PYTHONPATH).

    Built once (the package index is needed then only); the folder's
    ``.complete`` records the kombu version it was built with.
    """
    celery = lowest_allowed("celery")
    folder = CACHE / f"celery-{celery}"
    complete = folder / ".complete"
    if not complete.exists():
        shutil.rmtree(folder, ignore_errors=True)
        kombu = lowest_kombu(celery)
        install(folder, f"celery=={celery}", f"kombu=={kombu}")
        complete.write_text(kombu)
    return celery, complete.read_text().strip(), folder


def drive_one_job(cluster: WorkerCluster) -> TrialAssigned:
    """Register a job and ask for its first trial through the client."""
    client = cluster.client()
    spec = JobSpec(
        job_id="contract", batch_sizes=[16, 32, 64], default_batch_size=32, target_metric=0.5
    )
    client.register(spec)
    return client.next_trial("contract")


def banner_version(cluster: WorkerCluster) -> str:
    found = re.search(r"\S+@\S+ v(\d+\.\d+\.\d+) \(", cluster.logs())
    assert found, f"no Celery banner in the worker's log:\n{cluster.logs()}"
    return found.group(1)


def test_the_lowest_bound_is_the_one_pyproject_states() -> None:
    assert lowest_allowed("celery") == "5.4.0"


@pytest.mark.parametrize("which", ["installed", "lowest"])
def test_a_client_built_message_is_handled_by_a_real_worker(
    which: str,
    worker_cluster_factory: Callable[..., WorkerCluster],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    expected = version("celery")
    if which == "lowest":
        expected, kombu, folder = request.getfixturevalue("lowest_celery")
        assert version_under(folder, "kombu") == kombu
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(folder), str(ROOT)]))
    cluster = worker_cluster_factory(f"sqlite:///{tmp_path / 'bso.sqlite3'}")
    try:
        assert banner_version(cluster) == expected
        trial = drive_one_job(cluster)
        assert (trial.trial_number, trial.batch_size) == (1, 32)
    finally:
        cluster.stop()
