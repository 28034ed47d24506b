"""compose.yaml must start what `bso up` starts, with settings the workers understand.

No Docker engine runs in CI, so this checks the file against the code instead:
a renamed queue, setting or command would otherwise only break in production.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from bso import keys
from bso.cli import main
from bso_workers.settings import WorkerSettings

ROOT = Path(__file__).resolve().parent.parent


def compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((ROOT / "compose.yaml").read_text())
    return data


def test_services_cover_the_whole_stack() -> None:
    services = compose()["services"]
    assert {"redis", "postgres", "migrate", "worker", "beat", "flower"} <= set(services)
    # Workers scale with --scale: no fixed container name or host port on them.
    assert "container_name" not in services["worker"]
    assert "ports" not in services["worker"]


def test_workers_consume_the_queues_the_tasks_are_routed_to() -> None:
    command = compose()["services"]["worker"]["command"]
    queues = command[command.index("--queues") + 1].split(",")
    assert sorted(queues) == sorted([keys.EVENTS_QUEUE, keys.MAINTENANCE_QUEUE])
    assert command[:3] == ["celery", "-A", "bso_workers.app"]


def test_workers_run_solo_and_come_back_after_a_hard_time_limit() -> None:
    worker = compose()["services"]["worker"]
    command = worker["command"]
    assert command[command.index("--pool") + 1] == "solo"
    assert "--concurrency" not in command  # solo nodes scale with --scale, not processes
    assert worker["restart"] in {"unless-stopped", "always", "on-failure"}
    assert worker["init"] is True


def test_environment_is_made_of_real_settings() -> None:
    fields = {f"BSO_{name.upper()}" for name in WorkerSettings.model_fields}
    for name, service in compose()["services"].items():
        env = service.get("environment", {})
        if name in {"migrate", "worker", "beat", "flower"}:
            unknown = {k for k in env if k.startswith("BSO_")} - fields
            assert not unknown, f"{name} sets unknown settings {unknown}"
            settings = WorkerSettings(**{k[4:].lower(): v for k, v in env.items()})
            assert settings.database_url.startswith("postgresql+psycopg://")


def test_migrate_runs_a_real_bso_command(tmp_path: Path) -> None:
    migrate = compose()["services"]["migrate"]
    assert migrate["command"] == ["bso", "migrate"]
    url = f"sqlite:///{tmp_path / 'db.sqlite3'}"
    assert main(["migrate", "--database-url", url]) == 0
    assert main(["migrate", "--database-url", url]) == 0  # idempotent
    for name in ("worker", "beat"):
        assert compose()["services"][name]["depends_on"]["migrate"] == {
            "condition": "service_completed_successfully"
        }
