"""``set -a; . .bso/credentials.env; set +a`` as docs/security.md says, from a data dir
a user really has: ``/home/me/my runs/.bso``.  The file names the database by its
path, and written raw, sourcing it ran ``runs/.bso/bso.sqlite3`` as a command and
exported ``BSO_DATABASE_URL=sqlite:////home/me/my``, which every ``bso`` command of
that shell then used over the data dir's (``bso keys list``: a new empty SQLite file
``my``, "not at the current bso schema").  Now the shell reads it as written: the
trainer run from that shell is bso's, and ``bso keys list`` finds the service's keys.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.acceptance.conftest import BIN, ROOT, LiveService, trainer_argv

pytestmark = pytest.mark.integration

SOURCED = 'set -a; . "$0"; set +a; "$@"'
"""bash: source the file given first, then run the rest as a command from that shell."""


NO_URL_SCRIPT = """
import logging
from bso_client import BatchSizeOptimizer, JobSpec
logging.basicConfig(level=logging.INFO)
job = JobSpec(job_id="no-url", batch_sizes=[8, 16], default_batch_size=8, target_metric=0.5)
with BatchSizeOptimizer(job, heartbeat_interval_s=None) as bso:  # no broker_url: the env's
    bso.get_batch_size()
    bso.on_train_begin()
    for metric in (0.2, 0.4, 0.6):
        decision = bso.on_evaluate(metric)
print("detached" if bso.detached else "attached", decision.stop)
"""
"""A script that leaves the URL, like the key, to the sourced ``credentials.env``."""


def from_sourced_shell(
    credentials: Path, argv: list[str], home: Path
) -> subprocess.CompletedProcess[str]:
    keep = ("BSO_BROKER_URL", "BSO_API_KEY", "BSO_DATABASE_URL", "BSO_CACHE_DIR")
    env = {k: v for k, v in os.environ.items() if k not in keep}
    return subprocess.run(
        ["bash", "-c", SOURCED, str(credentials), *argv],
        capture_output=True,
        text=True,
        timeout=180,
        env={**env, "HOME": str(home), "OMP_NUM_THREADS": "1"},
        cwd=ROOT,
        check=False,
    )


def test_a_data_dir_with_a_space_sources_and_trains(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    service = LiveService(data_dir=tmp_path / "my runs" / ".bso", home=home)
    service.start()
    try:
        credentials = service.data_dir / "credentials.env"
        run = from_sourced_shell(
            credentials, trainer_argv("mnist_loop", "--job-id", "spaced-mnist"), home
        )
        assert run.returncode == 0, run.stderr
        assert "No such file or directory" not in run.stderr
        assert "bso trial 1 of job spaced-mnist" in run.stderr
        keys = from_sourced_shell(
            credentials,
            [str(BIN / "bso"), "keys", "list", "--data-dir", str(service.data_dir)],
            home,
        )
        assert keys.returncode == 0, keys.stderr
        assert "default" in keys.stdout
        assert not (tmp_path / "my").exists()
        bare = from_sourced_shell(credentials, [str(BIN / "python"), "-c", NO_URL_SCRIPT], home)
        assert bare.returncode == 0, bare.stderr
        assert "bso trial 1 of job no-url" in bare.stderr
        assert "unavailable" not in bare.stderr
        assert bare.stdout.split() == ["attached", "True"]
    finally:
        service.stop()
