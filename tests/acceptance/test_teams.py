"""Handing a team what its training jobs need, as an operator does beside a live ``bso up``.

The operator runs ``bso keys create --tenant team-a --data-dir DIR``; the team
gets only the file it writes (the clients' URL and its own key, none of the
data dir's other secrets), sources it, and trains.  The job is the team's: the
operator's view of the database names the tenant, the default tenant's key finds
no job of that id, and may register one of its own.
"""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest
import redis

from bso.wire.keys import TENANT_REFUSED_KEY
from tests.acceptance.conftest import (
    BIN,
    LiveService,
    free_port,
    read_env_file,
    run_trainer,
    trainer_argv,
)

pytestmark = pytest.mark.integration


def bso(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "bso"), *argv], capture_output=True, text=True, timeout=120, check=False
    )


def test_a_team_trains_with_its_team_file_alone(service: LiveService) -> None:
    created = bso("keys", "create", "--tenant", "team-a", "--data-dir", str(service.data_dir))
    assert created.returncode == 0, created.stderr
    line = next(row for row in created.stdout.splitlines() if row.startswith("team file "))
    team_file = line.split()[2]
    handed = read_env_file(service.data_dir / "teams" / os.path.basename(team_file))
    assert sorted(handed) == ["BSO_API_KEY", "BSO_BROKER_URL"]
    secrets = service.credentials
    for name in ("BSO_REDIS_WORKER_PASSWORD", "BSO_FLOWER_PASSWORD", "BSO_API_KEY"):
        assert secrets[name] not in "".join(handed.values()), name

    job = "acceptance-handed-file"
    env = {**service.env(), **handed}  # the team's shell: its file sourced, nothing else
    run = run_trainer(trainer_argv("mnist_loop", "--job-id", job), env)
    assert run.run_status["outcome"] in ("converged", "relaunch"), str(run)
    assert not run.bso_lines("ERROR"), str(run)

    url = secrets["BSO_DATABASE_URL"]
    view = bso("status", f"team-a/{job}", "--database-url", url, "--json")
    assert view.returncode == 0, view.stderr
    (status,) = json.loads(view.stdout)
    assert status["tenant"] == "team-a"
    assert status["lanes"][0]["trials"] == 1

    # Job ids are per team: the default tenant's key (the data dir's) finds no job of
    # that id, in exactly the words it gets for a job nobody registered.
    data_dir = ("--data-dir", str(service.data_dir))
    theirs, nobodys = bso("status", job, *data_dir), bso("status", "never-registered", *data_dir)
    assert theirs.returncode == nobodys.returncode == 2
    assert theirs.stderr.replace(job, "<job>") == nobodys.stderr.replace(
        "never-registered", "<job>"
    )
    assert "team-a" not in theirs.stdout + theirs.stderr

    # ... and may train a job of that id itself: a second job, team-a's untouched.
    own = run_trainer(trainer_argv("mnist_loop", "--job-id", job), service.env())
    assert own.run_status["outcome"] in ("converged", "relaunch"), str(own)
    mine = bso("status", job, *data_dir, "--json")
    assert mine.returncode == 0, mine.stderr
    assert [(s["tenant"], s["lanes"][0]["trials"]) for s in json.loads(mine.stdout)] == [
        ("default", 1)
    ]
    both = bso("status", "--database-url", url, "--json")
    assert sorted(
        (s["tenant"], s["lanes"][0]["trials"])
        for s in json.loads(both.stdout)
        if s["job_id"] == job
    ) == [("default", 1), ("team-a", 1)]
    listed = subprocess.run(
        [str(BIN / "bso"), "jobs", "list", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert listed.returncode == 0, listed.stderr
    assert [j["job_id"] for j in json.loads(listed.stdout)] == [job]


def test_a_team_past_its_rate_trains_on_and_its_log_says_why(service: LiveService) -> None:
    """A team given a rate of one event a second (bursts of five) sends more than that:
    its door refuses events with the wait; the run waits where a call may (within its
    timeout), skips a read that may not wait (its status line), and trains to its end."""
    created = bso("keys", "create", "--tenant", "team-slow", "--data-dir", str(service.data_dir))
    assert created.returncode == 0, created.stderr
    limited = bso(
        "keys", "limits", "team-slow", "--per-second", "1", "--data-dir", str(service.data_dir)
    )
    assert limited.returncode == 0, limited.stderr
    assert "1 per second (bursts of 5 within 5 s)" in limited.stdout
    (team_file,) = (service.data_dir / "teams").glob("team-slow-*.env")
    env = {**service.env(), **read_env_file(team_file)}
    run = run_trainer(trainer_argv("mnist_loop", "--job-id", "acceptance-rate-limited"), env)
    assert run.run_status["outcome"] in ("converged", "relaunch"), str(run)
    refusals = [line for line in run.stderr.splitlines() if "refused at the door" in line]
    assert refusals, str(run)
    assert "tenant team-slow's event was refused at the door, not queued" in refusals[0]
    assert "send it again in" in refusals[0]
    assert not run.bso_lines("ERROR"), str(run)
    listed = bso("keys", "list", "--data-dir", str(service.data_dir))
    assert "limits of team-slow: at most 1000 events waiting, 1 per second" in listed.stdout
    worker = redis.Redis.from_url(service.credentials["BSO_WORKER_BROKER_URL"])
    try:  # what the metrics endpoint exports, counted by the workers within 2 s
        deadline = time.monotonic() + 10
        while not worker.hget(TENANT_REFUSED_KEY, "team-slow") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert int(worker.hget(TENANT_REFUSED_KEY, "team-slow") or 0) >= len(refusals)
    finally:
        worker.close()


def test_two_teams_on_one_machine_each_deliver_only_their_own_journals(
    service: LiveService,
) -> None:
    """Two teams share a training machine (one HOME, so one cache dir), and each has a
    job of the same id.  team-a's run cannot reach the service (a wrong port) and
    journals its epochs; the default team's run of its own job of that id, with the
    service up, must not deliver team-a's journal (into its own job, with its own key);
    team-a's next run does."""
    created = bso("keys", "create", "--tenant", "team-j", "--data-dir", str(service.data_dir))
    assert created.returncode == 0, created.stderr
    (team_file,) = (service.data_dir / "teams").glob("team-j-*.env")
    handed = read_env_file(team_file)
    team_env = {**service.env(), **handed}
    wrong_port = handed["BSO_BROKER_URL"].replace(f":{service.port}/", f":{free_port()}/")
    job = "acceptance-shared-machine"

    lost = run_trainer(
        trainer_argv("mnist_loop", "--job-id", job), {**team_env, "BSO_BROKER_URL": wrong_port}
    )
    assert lost.summary["detached"], str(lost)
    own = run_trainer(trainer_argv("mnist_loop", "--job-id", job), service.env())
    assert own.run_status["outcome"] in ("converged", "relaunch"), str(own)
    back = run_trainer(trainer_argv("mnist_loop", "--job-id", job), team_env)
    assert back.run_status["outcome"] in ("converged", "relaunch"), str(back)

    url = service.credentials["BSO_DATABASE_URL"]
    found = {}
    for key in (job, f"team-j/{job}"):
        view = bso("status", key, "--database-url", url, "--json")
        assert view.returncode == 0, view.stderr
        ((status,),) = [json.loads(view.stdout)]
        (lane,) = status["lanes"]
        found[status["tenant"]] = (lane["trials"], lane["detached_trials"])
    assert found == {"default": (1, 0), "team-j": (2, 1)}
