"""A worker node's health file (bso_workers.healthcheck): touched from the node's event
loop while it consumes, read by compose.yaml's health check."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
from kombu.asynchronous.timer import Timer

from bso_workers.celery_app import create_app
from bso_workers.healthcheck import TOUCH_INTERVAL_S, check, health_file_step, max_age_s
from bso_workers.settings import WorkerSettings
from tests.fixtures.celery_workers import WorkerCluster


def settings(**values: object) -> WorkerSettings:
    return WorkerSettings(_env_file=None, **values)  # type: ignore[arg-type]


def test_a_fresh_file_is_healthy_a_stale_or_missing_one_is_not(tmp_path: Path) -> None:
    path = tmp_path / "alive"
    config = settings(health_file=path)
    assert check(config)[0] is False  # not yet touched
    path.touch()
    now = path.stat().st_mtime
    assert check(config, now=now + max_age_s(config))[0] is True
    healthy, why = check(config, now=now + max_age_s(config) + 1)
    assert healthy is False
    assert "event loop" in why
    assert check(settings())[0] is False  # no file configured: never healthy by accident


def test_the_allowance_covers_the_longest_task() -> None:
    """A solo node's loop is blocked while it runs a task, up to the hard limit; a
    longer limit must widen the allowance, or a busy node would look dead."""
    default, longer = settings(), settings(time_limit_s=300, visibility_timeout_s=3600)
    assert max_age_s(default) >= default.longest_task_s + TOUCH_INTERVAL_S
    assert max_age_s(longer) - max_age_s(default) == longer.longest_task_s - (
        default.longest_task_s
    )


def test_the_step_touches_from_the_worker_timer_and_cleans_up(tmp_path: Path) -> None:
    path = tmp_path / "alive"
    path.touch()  # left by the container's previous run
    old = time.time() - 3600
    os.utime(path, (old, old))
    timer = Timer()
    worker = SimpleNamespace(timer=timer)
    step = health_file_step(path, interval_s=0.01)(worker)
    step.start(worker)
    assert not path.exists()  # stale file removed: healthy only once the loop turns
    entries = list(timer.queue)
    assert len(entries) == 2
    time.sleep(0.05)
    for entry in entries:
        entry.entry()  # what the event loop does when they are due
    assert path.exists()
    assert time.time() - path.stat().st_mtime < 5
    step.stop(worker)
    assert not path.exists()
    assert all(entry.entry.canceled for entry in entries)


def test_the_step_is_added_only_when_a_file_is_set(tmp_path: Path) -> None:
    with_file = create_app(settings(broker_url="memory://", health_file=tmp_path / "alive"))
    assert [s.__name__ for s in with_file.steps["worker"]] == ["HealthFile"]
    assert not create_app(settings(broker_url="memory://")).steps["worker"]
    assert "BSO_HEALTH_FILE" not in settings().to_env()  # bso up's nodes keep no file


def test_the_module_is_the_health_check_command(tmp_path: Path) -> None:
    path = tmp_path / "alive"
    env = {"PATH": os.environ["PATH"], "BSO_HEALTH_FILE": str(path)}

    def run() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "bso_workers.healthcheck"],
            check=False, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60,
        )  # fmt: skip

    missing = run()
    assert missing.returncode == 1
    assert "no health file" in missing.stderr
    path.touch()
    assert run().returncode == 0


@pytest.mark.integration
def test_a_real_node_touches_its_file_while_it_consumes(
    worker_cluster_factory: Callable[..., WorkerCluster], tmp_path: Path
) -> None:
    path = tmp_path / "alive"
    cluster = worker_cluster_factory(f"sqlite:///{tmp_path / 'db.sqlite3'}", health_file=path)
    deadline = time.monotonic() + 30
    while not path.exists():
        assert time.monotonic() < deadline, cluster.logs()
        time.sleep(0.2)
    assert check(cluster.settings)[0] is True
    first = path.stat().st_mtime
    deadline = time.monotonic() + TOUCH_INTERVAL_S + 20
    while path.stat().st_mtime == first:  # touched again, by the timer
        assert time.monotonic() < deadline, cluster.logs()
        time.sleep(0.5)
    cluster.stop()
    assert not path.exists()  # a node that stopped is not healthy
