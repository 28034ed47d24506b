"""A trainer's own machine odd, against a live ``bso up``: bso's client keeps a cache
folder (journals, the last recommendation), and no state of that folder may end a run.

* no home at all (``HOME`` unset, and a user id with no entry in the passwd
  database, as a container started with an arbitrary uid has; the entry's absence is
  simulated by a ``pwd.getpwuid`` that raises, as Python sees it then): the run is
  bso's as ever with the service up, and trains detached after one warning naming
  ``BSO_CACHE_DIR`` with the service down;
* a cache folder that cannot be written while the service is down: one warning that
  says why nothing is journaled and names ``BSO_CACHE_DIR``, and the run trains on;
* no energy measurable (no NVML, no readable RAPL: a container given the GPU's compute
  capability without NVML's library) under a job that optimizes energy alone
  (``eta_knob=1``): one ERROR naming the cause, and the run trains to its target
  without bso, which registers nothing.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from bso_client.energy.detect import detect_monitor
from tests.acceptance.conftest import (
    EXIT_RELAUNCH,
    LiveService,
    free_port,
    run_trainer,
    trainer_argv,
    trials_of,
)
from tests.acceptance.test_job_admin import bso_jobs

pytestmark = pytest.mark.integration

NO_PASSWD_ENTRY = (
    "import pwd, runpy, sys\n"
    "def no_entry(uid): raise KeyError(f'getpwuid(): uid not found: {uid}')\n"
    "pwd.getpwuid = no_entry\n"
    "sys.argv = sys.argv[1:]\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
)
"""Runs the trainer given after it as a user with no passwd entry."""


def homeless(service: LiveService) -> dict[str, str]:
    """The trainer's environment without ``HOME`` (``env()`` drops the cache variables)."""
    env = service.env()
    del env["HOME"]
    return env


def test_a_run_with_no_home_at_all_trains_with_bso_and_without_it(service: LiveService) -> None:
    job = "acceptance-no-home"
    argv = trainer_argv("mnist_loop", "--job-id", job)
    argv[1:1] = ["-c", NO_PASSWD_ENTRY]
    run = run_trainer(argv, homeless(service))
    assert run.returncode in (0, EXIT_RELAUNCH), str(run)
    assert not run.summary["detached"], str(run)
    assert run.bso_lines("WARNING") == [], str(run)
    (trial,) = trials_of(service.status(job)).values()
    assert trial["outcome"] != "running", trial  # ended by the run, as ever

    wrong = service.broker_url.replace(f":{service.port}/", f":{free_port()}/")
    down = [*argv, "--broker-url", wrong]
    detached = run_trainer(down, homeless(service))
    assert detached.returncode in (0, EXIT_RELAUNCH), str(detached)
    assert detached.summary["detached"], str(detached)
    (warning,) = detached.bso_lines("WARNING")
    assert "not journaled (cannot write the journal" in warning, warning
    assert "set BSO_CACHE_DIR" in warning, warning


def test_an_unwritable_cache_while_the_service_is_down_costs_one_line(
    service: LiveService, tmp_path: Path
) -> None:
    not_a_folder = tmp_path / "cache"
    not_a_folder.write_text("")  # read-only for root too: no folder can be made under it
    wrong = service.broker_url.replace(f":{service.port}/", f":{free_port()}/")
    argv = trainer_argv("mnist_loop", "--job-id", "acceptance-unwritable", "--broker-url", wrong)
    run = run_trainer(argv, service.env(BSO_CACHE_DIR=str(not_a_folder)))
    assert run.returncode in (0, EXIT_RELAUNCH), str(run)
    assert run.summary["detached"], str(run)
    assert run.epochs == list(range(1, len(run.epochs) + 1)), str(run)
    (warning,) = run.bso_lines("WARNING")
    assert "not journaled (cannot write the journal: [Errno 20] Not a directory" in warning
    assert "set BSO_CACHE_DIR to a writable folder" in warning, warning


def test_energy_only_where_no_energy_is_measured_trains_without_bso(service: LiveService) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback's EnergyFallbackWarning
        if detect_monitor().measures_energy:
            pytest.skip("this machine measures energy (NVML or RAPL)")
    job = "acceptance-energy-only"
    run = run_trainer(trainer_argv("mnist_loop", "--job-id", job, "--eta", "1"), service.env())
    assert run.returncode == 0, str(run)  # the run's own outcome, not a crash
    assert (run.summary["trial_number"], run.summary["detached"]) == (None, True), str(run)
    assert run.epochs == list(range(1, len(run.epochs) + 1)), str(run)
    (error,) = run.bso_lines("ERROR")
    assert "eta_knob=1 optimizes energy alone, but no energy can be measured" in error, error
    assert "training goes on at the job's default batch size 32 without bso" in error, error
    assert run.bso_lines("WARNING") == [], str(run)
    listed = bso_jobs(service, "list", "--json")
    assert listed.returncode == 0, listed.stdout + listed.stderr
    assert job not in listed.stdout, "nothing is registered"
