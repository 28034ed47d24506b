"""Flower as an operator uses it: a job through a live ``bso up``, then ``/api/tasks``.

Flower's process screens what it hears like any bso process; it used to refuse
Celery's batched task events, so Flower listed no task and the dead-letter
count rose with Celery's own traffic.  Here every event's task must be listed,
succeeded, with a result an operator can read, no secret anywhere in what
Flower serves, and no dead letter.
"""

from __future__ import annotations

import base64
import json
import re
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from bso.spec import JobSpec
from bso.wire import keys
from bso.wire.message import MAX_REPR_CHARS, celery_message
from bso_client.transport import ServiceClient
from bso_workers.credentials import read_env_file
from tests.test_up import bso, start

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, str]]:
    folder = tmp_path_factory.mktemp("flower")
    data = folder / "data"
    running = start(
        bso("up", "--data-dir", str(data), "--redis-port", "0", "--flower-port", "0"), folder
    )
    try:
        flower = running.wait_for(r"flower\s+(http://\S+)").group(1)
        running.wait_for("Ctrl-C stops everything")
        yield data, flower
    finally:
        running.popen.send_signal(signal.SIGINT)
        try:
            running.popen.wait(60)
        except subprocess.TimeoutExpired:
            running.popen.kill()


def flower_get(url: str, login: str) -> Any:
    request = urllib.request.Request(url, headers={"Authorization": f"Basic {login}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.load(response)


def test_flower_lists_every_event_task_with_a_readable_result_and_no_secret(
    stack: tuple[Path, str],
) -> None:
    data, flower = stack
    credentials = read_env_file(data / "credentials.env")
    login = base64.b64encode(credentials["FLOWER_BASIC_AUTH"].encode()).decode()
    spec = JobSpec(job_id="flower-job", batch_sizes=[8, 16], default_batch_size=16, target_metric=1)
    with ServiceClient.connect(
        credentials["BSO_BROKER_URL"], api_key=credentials["BSO_API_KEY"], timeout_s=30
    ) as client:
        client.register(spec)
        trial = client.next_trial("flower-job")
        client.report_epoch(
            "flower-job", trial.trial_number, epoch=1, time_s=1.0, energy_j=10.0, metric=0.5
        )

    # Flower learns of a task's success from the worker's event, which can reach it
    # after the client had its reply: wait for every state to settle, not only for
    # the three tasks to show up (a busy machine caught one still RECEIVED).
    deadline = time.monotonic() + 30
    while True:
        tasks = flower_get(f"{flower}/api/tasks", login)
        ours = {t["name"]: t for t in tasks.values() if str(t.get("args")).find("flower-job") >= 0}
        settled = all(t["state"] in ("SUCCESS", "FAILURE") for t in ours.values())
        if (len(ours) >= 3 and settled) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert set(ours) == {"bso.register", "bso.next_trial", "bso.epoch"}, tasks
    assert {t["state"] for t in ours.values()} == {"SUCCESS"}
    assert all(t["runtime"] is not None and t["runtime"] >= 0 for t in ours.values())
    assert ours["bso.next_trial"]["result"] == (
        f"'trial job=flower-job tenant=default trial={trial.trial_number} bs={trial.batch_size}'"
    )
    assert ours["bso.epoch"]["result"].startswith(
        "'epoch_decision job=flower-job tenant=default trial="
    )

    served = json.dumps(tasks) + json.dumps(flower_get(f"{flower}/api/workers", login))
    secrets = [credentials["BSO_API_KEY"], credentials["FLOWER_BASIC_AUTH"].split(":", 1)[1]]
    secrets += [v for k, v in credentials.items() if "PASSWORD" in k]
    secrets += [m.group(1) for m in re.finditer(r"//[^:/]+:([^@]+)@", json.dumps(credentials))]
    for secret in secrets:
        assert secret not in served
    assert "bso:reply:announce:" not in served

    deadletters = subprocess.run(
        bso("deadletters", "--data-dir", str(data), "--json"),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert json.loads(deadletters.stdout)["counts"].get("total", 0) == 0, deadletters.stdout


def test_flower_s_task_list_has_a_result_column(stack: tuple[Path, str]) -> None:
    """Flower's own default list shows no result: an operator had to open each task's
    page to see what bso replied."""
    data, flower = stack
    credentials = read_env_file(data / "credentials.env")
    login = base64.b64encode(credentials["FLOWER_BASIC_AUTH"].encode()).decode()
    request = urllib.request.Request(f"{flower}/tasks", headers={"Authorization": f"Basic {login}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        page = response.read().decode()
    headers = re.findall(r'<th data-column="(\w+)">([^<]+)</th>', page)
    assert ("result", "Result") in headers, headers
    assert [name for name, _ in headers][:3] == ["name", "uuid", "state"]


def test_flower_keeps_a_bounded_preview_of_a_tenants_oversized_arguments(
    stack: tuple[Path, str],
) -> None:
    """A team's user pushes, around its door, an item whose ``argsrepr`` header is
    half a megabyte (within the item limit): the workers used to repeat it whole in
    the task event Flower keeps, so a team could make Flower hold gigabytes."""
    data, flower = stack
    credentials = read_env_file(data / "credentials.env")
    login = base64.b64encode(credentials["FLOWER_BASIC_AUTH"].encode()).decode()
    namespace = keys.tenant_namespace("default")
    event_id = "oversized-argsrepr"
    payload = json.dumps(
        {
            "version": 1,
            "kind": "heartbeat",
            "event_id": event_id,
            "job_id": "no-such-job",
            "trial_number": 1,
        }
    )
    message = json.loads(
        celery_message(
            keys.TASK_HEARTBEAT,
            payload,
            f"{event_id}.1",
            namespace.queue,
            api_key=credentials["BSO_API_KEY"],
        )
    )
    message["headers"]["argsrepr"] = "A" * 500_000
    tenant = redis.Redis.from_url(credentials["BSO_BROKER_URL"])
    tenant.lpush(namespace.queue_key, json.dumps(message))
    tenant.close()

    deadline = time.monotonic() + 30
    task: dict[str, Any] | None = None
    while task is None or task["state"] != "SUCCESS":
        assert time.monotonic() < deadline, task
        time.sleep(0.5)
        task = flower_get(f"{flower}/api/tasks", login).get(f"{event_id}.1")
    assert task["args"] == "A" * (MAX_REPR_CHARS - 3) + "..."
