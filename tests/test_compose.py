"""compose.yaml must start what `bso up` starts, with settings the workers understand.

No Docker engine runs in CI, so this checks the file against the code instead:
a renamed queue, setting or command would otherwise only break in production.
"""

from __future__ import annotations

import importlib.util
import os
import re
import stat
import subprocess
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml

from bso.cli import main
from bso.wire import keys
from bso_workers.credentials import Credentials, read_env_file
from bso_workers.settings import WorkerSettings

ROOT = Path(__file__).resolve().parent.parent


def _load_compose_env() -> ModuleType:
    """scripts/compose_env.py (scripts are not a package)."""
    spec = importlib.util.spec_from_file_location("compose_env", ROOT / "scripts/compose_env.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


COMPOSE_ENV = _load_compose_env()
COMPOSE_SECRETS: tuple[str, ...] = COMPOSE_ENV.COMPOSE_SECRETS


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


# -- secrets and authentication -------------------------------------------------------------


def test_redis_builds_the_same_acl_as_bso_up_from_the_env_file(tmp_path: Path) -> None:
    """The compose Redis writes its ACL file at start; run that script (as compose
    would hand it to sh) and compare with bso_workers.credentials' own ACL."""
    script = compose()["services"]["redis"]["entrypoint"][2].replace("$$", "$")
    acl_path = tmp_path / "users.acl"
    script = script.replace("/etc/bso-users.acl", str(acl_path))
    script = "\n".join(
        line for line in script.splitlines() if not line.startswith(("chown", "exec"))
    )
    credentials = Credentials.generate()
    env = {
        "PATH": os.environ["PATH"],
        "BSO_REDIS_WORKER_PASSWORD": credentials.worker_password,
        "BSO_REDIS_CLIENT_PASSWORD": credentials.client_password,
    }
    subprocess.run(["sh", "-c", script], env=env, check=True)
    assert acl_path.read_text() == credentials.acl()
    assert stat.S_IMODE(acl_path.stat().st_mode) == 0o600
    command = compose()["services"]["redis"]["entrypoint"][2]
    for option in ("--aclfile", "--protected-mode yes", "--appendonly yes", "--appendfsync"):
        assert option in command


def test_no_secret_is_written_in_the_file_and_the_env_file_has_them_all(tmp_path: Path) -> None:
    text = (ROOT / "compose.yaml").read_text()
    referenced = set(re.findall(r"\$\{(BSO_[A-Z_]+)", text))
    assert referenced == set(COMPOSE_SECRETS)
    assert "FLOWER_UNAUTHENTICATED_API" not in text
    assert "bso:bso@" not in text
    env_file = tmp_path / ".env"
    assert COMPOSE_ENV.main(["--output", str(env_file)]) == 0
    assert COMPOSE_ENV.main(["--output", str(env_file)]) == 1  # never overwritten
    values = read_env_file(env_file)
    assert set(values) == set(COMPOSE_SECRETS)
    assert all(len(v) >= 40 for v in values.values())
    assert stat.S_IMODE(env_file.stat().st_mode) == 0o600
    services = compose()["services"]
    assert services["flower"]["environment"]["FLOWER_BASIC_AUTH"].startswith("bso:${")
    for name in ("redis", "flower"):
        assert all(p.startswith("127.0.0.1:") for p in services[name]["ports"])
