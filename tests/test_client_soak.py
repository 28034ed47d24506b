"""scripts/client_soak.py works at tiny scale and meets its goals.

The full run (50 runs over 10 jobs, the service down for 10 minutes) is run by
hand; this runs the same script with 12 runs over 3 jobs, epochs of a tenth of
a second, and an outage of a few seconds that outlasts a client bound of 1 s,
so that runs really go on without the service: some lose it mid-run, some
start while it is down.  One client is killed with SIGKILL and one run raises
before its first epoch.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "client_soak.py"


def test_a_tiny_client_soak_loses_no_run_no_job_and_no_epoch(tmp_path: Path) -> None:
    argv = [
        sys.executable, str(SCRIPT),
        "--runs", "12", "--jobs", "3", "--concurrency", "3",
        "--max-epochs", "5", "--epoch-s", "0.1",
        "--outage-s", "4", "--outage-after", "0.3", "--bound-s", "1",
        "--data-dir", str(tmp_path / "soak"),
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=180, check=False)
    output = done.stdout + done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["runs"] == 12, output
    assert result["killed"] == 1, output  # the faults happened...
    assert result["script_bugs"] == 1, output
    assert result["detached_runs"] >= 1, output  # ...and the outage outlasted the bound
    assert result["unfinished_runs"] == 0, output  # the goals
    assert result["jobs_without_size"] == 0, output
    assert result["delivered"] == result["detached_runs"], output
    assert result["delivered_twice"] == 0, output
    assert result["audit_ok"], output
    assert result["audit_replayed"] > 0, output
    assert result["pass"], output
    assert done.returncode == 0, output
