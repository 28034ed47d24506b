"""A job that moves to another GPU, run as a user runs it against a live ``bso up``.

The same training script trains on this machine's lane for a few recurrences,
then on a GPU of another model (NVML reports it: the fake NVML of
``bso_client.testing`` stands in for the driver, installed in the script's own
``pynvml`` by a ``sitecustomize`` on its path; everything else is real).  The
new lane starts from what the first lane learned, and ``bso status`` says so
for that lane alone, in the table and in the JSON.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bso.spec import Hardware
from tests.acceptance.conftest import LiveService, run_trainer, trainer_argv, trials_of

pytestmark = pytest.mark.integration

FAKE_GPU = "Fake GPU of bso's acceptance tests"

SITECUSTOMIZE = '''
"""Puts a fake GPU of model $BSO_TEST_FAKE_GPU behind pynvml (tests only)."""
import os

if os.environ.get("BSO_TEST_FAKE_GPU"):
    import pynvml

    from bso_client.testing.fake_nvml import FakeGpu, FakeNvml

    _fake = FakeNvml([FakeGpu(name=os.environ["BSO_TEST_FAKE_GPU"])])
    for _name in dir(_fake):
        if _name.startswith("nvml"):
            setattr(pynvml, _name, getattr(_fake, _name))
'''


def on_fake_gpu(service: LiveService, folder: Path) -> dict[str, str]:
    """A trainer's environment on a machine whose NVML shows one ``FAKE_GPU``."""
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = service.env(BSO_TEST_FAKE_GPU=FAKE_GPU)
    env["PYTHONPATH"] = str(folder) + (f":{env['PYTHONPATH']}" if env.get("PYTHONPATH") else "")
    return env


def lane_key(lane: dict[str, Any]) -> str:
    """The lane's hardware key, as ``bso status``'s table names it."""
    return Hardware(**lane["hardware"]).key


def test_a_job_moved_to_another_gpu_starts_that_lane_from_the_first_and_bso_status_says_so(
    service: LiveService, tmp_path: Path
) -> None:
    job = "acceptance-lanes"
    argv = trainer_argv("mnist_loop", "--job-id", job)
    here = [run_trainer(argv, service.env()) for _ in range(3)]
    for run in here:
        assert run.run_status["outcome"] in ("converged", "relaunch"), str(run)
    (first_lane,) = service.status(job)["lanes"]
    first_key = lane_key(first_lane)
    assert FAKE_GPU not in first_key, first_lane

    moved = run_trainer(argv, on_fake_gpu(service, tmp_path))
    assert moved.run_status["outcome"] in ("converged", "relaunch"), str(moved)
    assert not moved.bso_lines("ERROR"), str(moved)

    status = service.status(job)
    lanes = {lane_key(lane): lane for lane in status["lanes"]}
    assert set(lanes) - {first_key}, status
    (new_key,) = set(lanes) - {first_key}
    assert FAKE_GPU in new_key
    assert lanes[first_key]["started_from"] is None
    start = lanes[new_key]["started_from"]
    assert start is not None, lanes[new_key]
    assert start["from_lane"] == first_key
    trials = trials_of(status).values()
    first_trials = [t for t in trials if Hardware(**t["lane"]).key == first_key]
    converged_here = [t for t in first_trials if t["outcome"] == "converged"]
    assert start["converged_runs"] == len(converged_here)
    assert start["recommended"] in {t["batch_size"] for t in converged_here}
    # The new lane's first run is where it started.
    (new_trial,) = [t for t in trials if Hardware(**t["lane"]).key == new_key]
    assert new_trial["batch_size"] == start["batch_size"]

    text = service.status_text(job)
    starts = [row for row in text.splitlines() if row.startswith("  started ")]
    assert len(starts) == 1, text
    assert f"lane {first_key}'s recommendation {start['recommended']}" in starts[0], text
    assert f"({len(converged_here)} converged runs)" in starts[0], text
