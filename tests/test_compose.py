"""compose.yaml must start what `bso up` starts, with settings the workers understand.

No Docker engine runs in CI, so this checks the file against the compose
specification's schema and against the code instead: a renamed queue, setting
or command would otherwise only break in production.  The Dockerfile and
.dockerignore are checked the same way.  One test runs the stack for real; it
is skipped where no Docker daemon answers.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from bso.cli import main
from bso.spec import JobSpec
from bso.wire import keys
from bso_client.transport import ServiceClient
from bso_workers.credentials import ADMIN_URL_NAME, Credentials, read_env_file
from bso_workers.redis_server import max_bulk_bytes
from bso_workers.settings import WorkerSettings
from bso_workers.supervision import free_port
from bso_workers.task_results import FLOWER_TASK_COLUMNS
from tests.fixtures.scripts import load_script

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = ROOT / "tests/schemas/compose-spec.json"
SCHEMA_SHA256 = "d549057ebc2925f39f62799eab0db7b9e2c18b35b6c00595199116da3ed10e64"
"""The vendored file's digest (tests/schemas/README.md says where it comes from)."""


COMPOSE_ENV = load_script("compose_env")
BUILD_CONTEXT = load_script("build_context")
COMPOSE_SECRETS: tuple[str, ...] = COMPOSE_ENV.COMPOSE_SECRETS


def compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((ROOT / "compose.yaml").read_text())
    return data


def test_services_cover_the_whole_stack() -> None:
    services = compose()["services"]
    assert {"redis", "postgres", "migrate", "worker", "beat", "flower", "metrics"} <= set(services)
    # Workers scale with --scale: no fixed container name or host port on them.
    assert "container_name" not in services["worker"]
    assert "ports" not in services["worker"]
    assert not [name for name, s in services.items() if "container_name" in s]


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
    """Every BSO_ variable is a worker setting, or (migrate's only) the bso-admin URL
    that `bso keys` reads."""
    fields = {f"BSO_{name.upper()}" for name in WorkerSettings.model_fields}
    for name, service in compose()["services"].items():
        env = dict(service.get("environment", {}))
        if name == "migrate":
            assert env.pop(ADMIN_URL_NAME).startswith("redis://bso-admin:")
        if name in {"migrate", "worker", "beat", "flower"}:
            unknown = {k for k in env if k.startswith("BSO_")} - fields
            assert not unknown, f"{name} sets unknown settings {unknown}"
            settings = WorkerSettings(**{k[4:].lower(): v for k, v in env.items()})
            assert settings.database_url.startswith("postgresql+psycopg://")


def test_migrate_runs_a_real_bso_command(tmp_path: Path) -> None:
    migrate = compose()["services"]["migrate"]
    assert migrate["command"] == ["sh", "-c", "bso migrate && bso keys sync"]
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
    acl_path = tmp_path / "bso-users.acl"
    script = script.replace("/data/", f"{tmp_path}/")
    script = "\n".join(
        line for line in script.splitlines() if not line.startswith(("chown", "exec"))
    )
    credentials = Credentials.generate()
    env = {
        "PATH": os.environ["PATH"],
        "BSO_REDIS_WORKER_PASSWORD": credentials.worker_password,
        "BSO_REDIS_CLIENT_PASSWORD": credentials.client_password,
        "BSO_REDIS_ADMIN_PASSWORD": credentials.admin_password,
    }
    subprocess.run(["sh", "-c", script], env=env, check=True)
    assert acl_path.read_text() == credentials.acl()
    assert stat.S_IMODE(acl_path.stat().st_mode) == 0o600
    # A restart keeps the tenants' users that bso keys saved (ACL SAVE) in the file.
    tenant = "user bso-tenant-team-a on #" + "ab" * 32 + " ~bso:broker:bso.events.t.team-a"
    acl_path.write_text(acl_path.read_text() + tenant + "\nuser bso-worker on #00\n")
    subprocess.run(["sh", "-c", script], env=env, check=True)
    assert acl_path.read_text() == credentials.acl([tenant])
    command = compose()["services"]["redis"]["entrypoint"][2]
    for option in ("--aclfile", "--protected-mode yes", "--appendonly yes", "--appendfsync"):
        assert option in command
    # The workers' item limit is the default there: Redis takes no longer string than bso up's.
    assert f"--proto-max-bulk-len {max_bulk_bytes(keys.DEFAULT_MAX_QUEUE_ITEM_BYTES)}" in command


def test_no_secret_is_written_in_the_file_and_the_env_file_has_them_all(tmp_path: Path) -> None:
    text = (ROOT / "compose.yaml").read_text()
    # Secrets are required (${NAME:?...}) and come from the env file; anything else
    # compose interpolates is a host port with a default.
    required = set(re.findall(r"\$\{([A-Z_]+):\?", text))
    assert required == set(COMPOSE_SECRETS)
    optional = re.findall(r"\$\{([A-Z_]+)(?![A-Z_]|:\?)(.*?)\}", text)
    assert optional, "the host ports are configurable"
    for name, rest in optional:
        assert name.endswith("_PORT"), name
        assert re.fullmatch(r":-\d+", rest), (name, rest)
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


# -- the compose specification ---------------------------------------------------------------


def _validator() -> jsonschema.protocols.Validator:
    raw = SCHEMA.read_bytes()
    assert hashlib.sha256(raw).hexdigest() == SCHEMA_SHA256, "update tests/schemas/README.md"
    schema = json.loads(raw)
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """compose's variable interpolation, for the forms compose.yaml uses: ``${NAME:?msg}``
    (``env`` must have it), ``${NAME:-default}``, and ``$$`` for a literal ``$``."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def variable(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name, op, arg = match.group(1), match.group(2), match.group(3)
        if op == ":-":
            return env.get(name) or arg
        return env[name]  # ":?": compose refuses to start without it

    return re.sub(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(:[-?])(.*?)\}", variable, value)


def test_the_file_follows_the_compose_specification() -> None:
    validator = _validator()
    raw = compose()
    assert not [e.message for e in validator.iter_errors(raw)]
    secrets = dict.fromkeys(COMPOSE_SECRETS, "x" * 43)
    assert not [e.message for e in validator.iter_errors(interpolate(raw, secrets))]
    # The schema does catch mistakes: a misspelt key, an unknown dependency condition.
    typo = copy.deepcopy(raw)
    typo["services"]["worker"]["helthcheck"] = typo["services"]["worker"].pop("healthcheck")
    assert list(validator.iter_errors(typo))
    condition = copy.deepcopy(raw)
    condition["services"]["worker"]["depends_on"]["migrate"]["condition"] = "service_done"
    assert list(validator.iter_errors(condition))


def test_long_running_services_have_health_checks_and_restart() -> None:
    services = compose()["services"]
    for name in ("redis", "postgres", "worker", "flower"):
        assert services[name]["healthcheck"]["test"], name
    for name in ("redis", "postgres", "worker", "beat", "flower"):
        assert services[name]["restart"] == "unless-stopped", name
    assert services["migrate"]["restart"] == "no"  # a one-shot: exits 0 and stays down
    assert services["worker"]["depends_on"]["redis"] == {"condition": "service_healthy"}
    redis_check = " ".join(services["redis"]["healthcheck"]["test"])
    assert "--appendonly yes" in services["redis"]["entrypoint"][2]
    assert "REDISCLI_AUTH" in redis_check
    assert "-a " not in redis_check  # a password on redis-cli's command line would show in ps


def test_the_worker_health_check_reads_the_file_its_node_touches(tmp_path: Path) -> None:
    """Run the worker service's health check command with its environment: fresh
    file healthy, stale or missing file not."""
    worker = compose()["services"]["worker"]
    command = worker["healthcheck"]["test"]
    assert command[:2] == ["CMD", "python"]
    env = interpolate(worker["environment"], dict.fromkeys(COMPOSE_SECRETS, "x" * 43))
    settings = WorkerSettings(_env_file=None, **{k[4:].lower(): v for k, v in env.items()})
    assert settings.health_file is not None
    health_file = tmp_path / "alive"
    env = {**env, "BSO_HEALTH_FILE": str(health_file), "PATH": os.environ["PATH"]}

    def check() -> int:
        run = subprocess.run(
            [sys.executable, *command[2:]],
            check=False, env=env, cwd=tmp_path, capture_output=True, timeout=60,
        )  # fmt: skip
        return run.returncode

    assert check() == 1  # no file: the node has not consumed yet
    health_file.touch()
    assert check() == 0
    stale = time.time() - settings.longest_task_s - 60
    os.utime(health_file, (stale, stale))
    assert check() == 1


def test_flower_login_comes_from_the_environment_not_the_command_line() -> None:
    flower = compose()["services"]["flower"]
    assert not [a for a in flower["command"] if "auth" in a.lower()]
    assert flower["environment"]["FLOWER_BASIC_AUTH"] == (
        "bso:${BSO_FLOWER_PASSWORD:?run scripts/compose_env.py first}"
    )
    check = " ".join(flower["healthcheck"]["test"])
    assert "/healthcheck" in check  # the one page Flower serves without a login
    assert f"--tasks_columns={FLOWER_TASK_COLUMNS}" in flower["command"]  # as bso up's


def test_metrics_sum_every_worker_container_behind_the_login(tmp_path: Path) -> None:
    services = compose()["services"]
    metrics, worker = services["metrics"], services["worker"]
    folder = metrics["environment"]["PROMETHEUS_MULTIPROC_DIR"]
    assert worker["environment"]["PROMETHEUS_MULTIPROC_DIR"] == folder
    assert metrics["volumes"] == worker["volumes"] == [f"metrics-data:{folder}"]
    assert f"mkdir -p {folder} && chown 10001:10001 {folder}" in _dockerfile()
    assert metrics["environment"]["BSO_METRICS_BASIC_AUTH"] == (
        "bso:${BSO_FLOWER_PASSWORD:?run scripts/compose_env.py first}"
    )
    assert not [a for a in metrics["command"] if "auth" in a.lower() or ":" in a]
    assert metrics["ports"] == ["127.0.0.1:${BSO_METRICS_PORT:-9808}:9808"]
    assert metrics["command"][:2] == ["bso", "metrics"]
    # The health check's script passes only when an anonymous request gets 401.
    script = metrics["healthcheck"]["test"][3]
    assert "e.code != 401" in script


# -- the image and its build context ---------------------------------------------------------


def _dockerfile() -> str:
    return (ROOT / "Dockerfile").read_text()


def test_the_build_context_is_what_the_dockerfile_copies(tmp_path: Path) -> None:
    ignore = (ROOT / ".dockerignore").read_text()
    sources = [
        source
        for line in _dockerfile().splitlines()
        if line.startswith("COPY") and "--from=" not in line
        for source in line.split()[1:-1]
    ]
    assert sources, "the Dockerfile copies the source tree"
    sent = BUILD_CONTEXT.context_files(ROOT, ignore)
    for source in sources:
        assert (ROOT / source).exists(), source
        assert any(f == source or f.startswith(f"{source}/") for f in sent), source
    assert {f.split("/")[0] for f in sent} <= {s.rstrip("/") for s in sources}
    # A tree with what a developer's checkout holds: only the copied sources go.
    for name in (
        ".env", ".bso/credentials.env", ".venv/bin/python", ".git/config", "tests/test_x.py",
        "pyproject.toml", "README.md", "Dockerfile", "bso/a.py", "bso/__pycache__/a.pyc",
        "bso/.env", "client/b.py", "workers/c.py", "workers/x.egg-info/PKG-INFO",
        "build/lib/bso/a.py",
    ):  # fmt: skip
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    assert BUILD_CONTEXT.context_files(tmp_path, ignore) == [
        "README.md", "bso/a.py", "client/b.py", "pyproject.toml", "workers/c.py",
    ]  # fmt: skip
    assert len(BUILD_CONTEXT.context_files(tmp_path, None)) == 15  # no .dockerignore: all


def test_dockerignore_rules_follow_docker() -> None:
    """The matcher's corner cases, as Docker documents them."""
    rules = BUILD_CONTEXT.read_patterns("# comment\n*/temp*\n**/*.go\n!keep/**/*.go\n/abs\n")
    assert BUILD_CONTEXT.ignored("somedir/temporary.txt", rules)
    assert BUILD_CONTEXT.ignored("somedir/temp/deep/file", rules)  # a matched dir: all under it
    assert not BUILD_CONTEXT.ignored("temp", rules)  # "*/" needs one level
    assert BUILD_CONTEXT.ignored("a/b/c.go", rules)
    assert BUILD_CONTEXT.ignored("c.go", rules)  # "**/" matches no directory too
    assert not BUILD_CONTEXT.ignored("keep/x/c.go", rules)  # a later "!" wins
    assert BUILD_CONTEXT.ignored("abs/file", rules)  # a leading "/" is the context's root


def test_the_image_installs_the_server_extra_only_and_runs_as_a_user() -> None:
    text = _dockerfile()
    installs = re.findall(r"pip install [^\n]*", text)
    assert installs
    assert all("'.[server]'" in line for line in installs), installs
    assert not re.search(r"\[(?:[^\]]*,)?(dev|client|plot)\b", text)  # no torch, no tools
    assert "--no-cache-dir" in installs[0]
    stages = re.split(r"^FROM ", text, flags=re.MULTILINE)[1:]
    assert len(stages) == 2
    assert "COPY --from=build /opt/bso /opt/bso" in stages[1]
    final_user = re.findall(r"^USER (\S+)", stages[1], flags=re.MULTILINE)
    assert final_user
    assert final_user[-1].split(":")[0] not in {"root", "0"}
    # No secret is baked in: nothing password-like in ENV, ARG or LABEL.
    for line in text.splitlines():
        if line.startswith(("ENV", "ARG", "LABEL")):
            assert not re.search(r"PASSWORD|SECRET|TOKEN|API_KEY|BROKER_URL", line), line


# -- the stack, for real (only where a Docker daemon answers) --------------------------------


def _docker_answers() -> bool:
    if shutil.which("docker") is None:
        return False
    try:
        info = subprocess.run(["docker", "info"], check=False, capture_output=True, timeout=30)
        return info.returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.integration
@pytest.mark.timeout(1800)
@pytest.mark.skipif(not _docker_answers(), reason="no Docker daemon answers `docker info`")
def test_the_stack_serves_a_client_with_two_workers(tmp_path: Path) -> None:
    """compose up --scale worker=2; a client registers a job and gets a batch size; both
    workers report healthy; Flower wants its login; compose down -v."""
    env_file = tmp_path / ".env"
    assert COMPOSE_ENV.main(["--output", str(env_file)]) == 0
    secrets = read_env_file(env_file)
    redis_port, flower_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("BSO_")}  # .env decides
    env |= {"BSO_REDIS_PORT": str(redis_port), "BSO_FLOWER_PORT": str(flower_port)}
    base = [
        "docker", "compose", "--project-name", f"bso-e2e-{os.getpid()}",
        "--project-directory", str(ROOT), "--file", str(ROOT / "compose.yaml"),
        "--env-file", str(env_file),
    ]  # fmt: skip

    def compose_run(*args: str, timeout: float = 600) -> str:
        done = subprocess.run(
            [*base, *args],
            check=False, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip
        assert done.returncode == 0, f"{args}: {done.stderr[-3000:]}"
        return done.stdout

    try:
        compose_run("up", "--build", "--detach", "--scale", "worker=2", timeout=1200)
        out = compose_run("run", "--rm", "-T", "migrate", "bso", "keys", "create", "--tenant=e2e")
        api_key = out.strip().splitlines()[-1]
        url = f"redis://bso-client:{secrets['BSO_REDIS_CLIENT_PASSWORD']}@127.0.0.1:{redis_port}/0"
        spec = JobSpec(
            job_id="e2e", batch_sizes=[32, 64, 128], default_batch_size=64,
            target_metric=0.9, max_epochs=5,
        )  # fmt: skip
        with ServiceClient.connect(url, api_key=api_key, timeout_s=60) as client:
            client.register(spec)
            trial = client.next_trial("e2e")
        assert trial.batch_size in spec.batch_sizes

        deadline = time.monotonic() + 180  # the first check runs 30 s after start
        while True:
            out = compose_run("ps", "--format", "json", "worker")
            rows = [json.loads(line) for line in out.splitlines() if line.strip()]
            rows = [r for row in rows for r in (row if isinstance(row, list) else [row])]
            if len(rows) == 2 and all(r.get("Health") == "healthy" for r in rows):
                break
            assert time.monotonic() < deadline, f"workers not healthy: {rows}"
            time.sleep(5)

        flower = f"http://127.0.0.1:{flower_port}"
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"{flower}/api/workers", timeout=10)
        assert refused.value.code == 401
        login = base64.b64encode(f"bso:{secrets['BSO_FLOWER_PASSWORD']}".encode()).decode()
        request = urllib.request.Request(
            f"{flower}/api/workers", headers={"Authorization": f"Basic {login}"}
        )
        with urllib.request.urlopen(request, timeout=10) as answer:
            assert answer.status == 200
    finally:
        subprocess.run(
            [*base, "down", "--volumes", "--remove-orphans"],
            check=False, env=env, cwd=ROOT, capture_output=True, timeout=300,
        )  # fmt: skip


def test_the_metrics_health_check_passes_only_on_a_served_endpoint() -> None:
    import threading

    from prometheus_client import CollectorRegistry

    from bso_workers.metrics_export import serve

    script = compose()["services"]["metrics"]["healthcheck"]["test"][3]
    server = serve(CollectorRegistry(), "127.0.0.1", 0, "bso", "pw")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        port = str(server.server_port)
        served = subprocess.run([sys.executable, "-c", script.replace("9808", port)], check=False)
    finally:
        server.shutdown()
        server.server_close()
    nothing = subprocess.run([sys.executable, "-c", script.replace("9808", port)], check=False)
    assert (served.returncode, nothing.returncode) == (0, 1)
