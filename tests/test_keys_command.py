"""``bso keys create``'s team file: what an operator hands a team, and nothing else.

No Redis runs here (the admin URL's port is closed): what the command does to a
running Redis is in ``tests/test_tenant_users.py``."""

from __future__ import annotations

import stat
from dataclasses import replace
from pathlib import Path

import pytest

from bso.apikeys import DEFAULT_TENANT, key_id_of
from bso.cli import main
from bso.service import BsoService
from bso.storage.sql import SqlStore
from bso.storage.sql.engine import upgrade
from bso_workers.credentials import Credentials, read_env_file, save
from bso_workers.supervision import free_port
from bso_workers.tenant_keys import create_key

CLIENT_PORT = 16399


def served_data_dir(path: Path) -> tuple[Path, Credentials]:
    """A data dir as ``bso up`` leaves it: credentials.env with every secret."""
    path.mkdir(mode=0o700)
    database = f"sqlite:///{path / 'bso.sqlite3'}"
    upgrade(database)
    store = SqlStore(database)
    try:
        credentials = replace(Credentials.generate(), api_key=create_key(store, DEFAULT_TENANT))
    finally:
        store.close()
    save(path, credentials, "127.0.0.1", CLIENT_PORT, database)
    return path, credentials


def tenant_url(tenant: str, key: str, host: str = "127.0.0.1", port: int = CLIENT_PORT) -> str:
    """The URL a team file must hold: the tenant's own user, its key's secret."""
    return f"redis://bso-tenant-{tenant}:{key_id_of(key)[1]}@{host}:{port}/0"


def tenant_of(data_dir: Path, key: str) -> str:
    store = SqlStore(f"sqlite:///{data_dir / 'bso.sqlite3'}")
    try:
        return BsoService(store).authenticate(key)
    finally:
        store.close()


def test_a_team_gets_its_key_and_the_clients_url_and_no_other_secret(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data, credentials = served_data_dir(tmp_path / "bso")
    assert main(["keys", "create", "--tenant", "team-a", "--data-dir", str(data)]) == 0
    out = capsys.readouterr().out.splitlines()
    key = out[1]
    (team_file,) = (data / "teams").iterdir()
    assert team_file.name == f"team-a-{key.split('_')[1]}.env"
    assert out[2].startswith("Redis at redis://bso-admin:***@127.0.0.1:16399/0 was not updated")
    assert out[3].startswith(f"team file {team_file} (0600): hand team team-a this file")
    assert stat.S_IMODE(team_file.stat().st_mode) == 0o600
    assert stat.S_IMODE((data / "teams").stat().st_mode) == 0o700
    values = read_env_file(team_file)
    assert values == {
        "BSO_BROKER_URL": tenant_url("team-a", key),
        "BSO_API_KEY": key,
    }
    text = team_file.read_text()
    for secret in (
        credentials.worker_password,
        credentials.client_password,
        credentials.admin_password,
        credentials.flower_password,
        credentials.api_key,
        key_id_of(credentials.api_key)[1],
    ):
        assert secret not in text
    assert "bso-worker" not in text
    assert "BSO_DATABASE_URL" not in text
    assert tenant_of(data, key) == "team-a"


def test_the_team_file_can_go_to_stdout_instead(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data, credentials = served_data_dir(tmp_path / "bso")
    argv = ["keys", "create", "--tenant", "team-b", "--data-dir", str(data), "--print-team-file"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert not (data / "teams").exists()
    lines = [line for line in printed.splitlines() if not line.startswith("#")]
    url, key = (line.split("=", 1)[1] for line in lines)
    assert url == tenant_url("team-b", key)
    assert credentials.client_password not in printed
    assert tenant_of(data, key) == "team-b"


def test_without_the_clients_url_no_file_is_written_and_the_output_says_what_to_hand(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "bare"
    assert main(["keys", "create", "--tenant", "team-c", "--data-dir", str(data)]) == 0
    out = capsys.readouterr().out
    assert "no team file" in out
    assert "give --broker-url" in out
    assert "no bso-admin URL" in out
    assert not (data / "teams").exists()
    url = "redis://bso-client:secret@bso.example:6379/0"
    argv = ["keys", "create", "--tenant", "team-c", "--data-dir", str(data), "--broker-url", url]
    assert main(argv) == 0
    capsys.readouterr()
    (team_file,) = (data / "teams").iterdir()
    values = read_env_file(team_file)
    assert values["BSO_BROKER_URL"] == tenant_url(
        "team-c", values["BSO_API_KEY"], "bso.example", 6379
    )


def keys_in(data: Path) -> list[str]:
    store = SqlStore(f"sqlite:///{data / 'bso.sqlite3'}")
    try:
        return [r.tenant for r in store.api_keys()]
    finally:
        store.close()


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("redis://bso-client:secret@h;touch /tmp/X:1/0", "a shell would act on"),
        ("not a url", "must be a redis:// or rediss:// URL with a host"),
        ("redis://bso-client:secret@0.0.0.0:1/0", "give --redis-host"),
    ],
)
def test_a_url_a_team_cannot_use_safely_is_refused_before_any_key_is_made(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], url: str, says: str
) -> None:
    data, _ = served_data_dir(tmp_path / "bso")
    argv = ["keys", "create", "--tenant", "team-d", "--data-dir", str(data), "--broker-url", url]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert says in err
    assert "secret" not in err
    assert "team-d" not in keys_in(data)


def test_the_address_teams_reach_redis_at_replaces_a_wildcard_or_loopback_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data, _ = served_data_dir(tmp_path / "bso")
    assert main(["keys", "create", "--tenant", "team-e", "--data-dir", str(data)]) == 0
    assert "only jobs on this machine reach it" in capsys.readouterr().out
    argv = ["keys", "create", "--tenant", "team-f", "--data-dir", str(data)]
    assert main([*argv, "--redis-host", "bso.example"]) == 0
    assert "only jobs on this machine" not in capsys.readouterr().out
    (team_file,) = (data / "teams").glob("team-f-*.env")
    values = read_env_file(team_file)
    assert values["BSO_BROKER_URL"] == tenant_url("team-f", values["BSO_API_KEY"], "bso.example")


def test_a_key_made_in_another_database_gets_no_file_with_this_services_url(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data, _ = served_data_dir(tmp_path / "bso")
    other = f"sqlite:///{tmp_path / 'other.sqlite3'}"
    argv = ["keys", "create", "--tenant", "team-g", "--data-dir", str(data)]
    assert main([*argv, "--database-url", other]) == 0
    out = capsys.readouterr().out
    assert "no team file: the key is in" in out
    assert not (data / "teams").exists()
    assert main([*argv, "--database-url", other, "--print-team-file"]) == 2
    assert "no team file to print" in capsys.readouterr().err


def test_revoking_a_key_removes_its_team_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data, _ = served_data_dir(tmp_path / "bso")
    for tenant in ("team-h", "team-i"):
        assert main(["keys", "create", "--tenant", tenant, "--data-dir", str(data)]) == 0
    capsys.readouterr()
    (kept,) = (data / "teams").glob("team-i-*.env")
    (gone,) = (data / "teams").glob("team-h-*.env")
    key_id = gone.stem.rsplit("-", 1)[1]
    assert main(["keys", "revoke", key_id, "--data-dir", str(data)]) == 0
    assert f"removed its team file {gone}" in capsys.readouterr().out
    assert not gone.exists()
    assert kept.exists()


def test_a_tenant_name_with_a_trailing_newline_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data, _ = served_data_dir(tmp_path / "bso")
    with pytest.raises(SystemExit) as exited:
        main(["keys", "create", "--tenant", "team-nl\n", "--data-dir", str(data)])
    assert exited.value.code == 2
    assert "argument --tenant: 'team-nl\\n'" in capsys.readouterr().err
    assert not (data / "teams").exists()


def test_a_tenants_limits_are_shown_set_listed_and_reset(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data, _ = served_data_dir(tmp_path / "bso")
    at = ["--data-dir", str(data)]
    assert main(["keys", "limits", "team-a", *at]) == 0
    assert capsys.readouterr().out == (
        "limits of team-a: at most 1000 events waiting, 20 per second "
        "(bursts of 100 within 5 s) (the defaults)\n"
    )
    assert main(["keys", "limits", "--tenant", "team-a", "--max-queue", "1", *at]) == 0
    out = capsys.readouterr().out
    assert "limits of team-a: at most 1 event waiting, 20 per second" in out
    assert "tenant team-a has no API key yet: the limits apply once" in out
    assert main(["keys", "limits", "team-a", "--max-queue", "10", *at]) == 0
    assert main(["keys", "limits", "team-a", "--per-second", "2", *at]) == 0  # keeps the 10
    capsys.readouterr()
    assert main(["keys", "list", *at]) == 0
    listed = capsys.readouterr().out
    assert (
        "limits of team-a: at most 10 events waiting, 2 per second (bursts of 10 within 5 s)\n"
        in listed
    )
    assert "limits of default: at most 1000 events waiting" in listed
    assert main(["keys", "limits", "team-a", "--defaults", *at]) == 0
    assert "(the defaults)" in capsys.readouterr().out
    store = SqlStore(f"sqlite:///{data / 'bso.sqlite3'}")
    try:
        assert store.tenant_limits() == {}
    finally:
        store.close()


@pytest.mark.parametrize(
    "argv", [["--max-queue", "0"], ["--per-second", "x"], ["--max-queue", "2000000"]]
)
def test_a_limit_that_is_no_count_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    data, _ = served_data_dir(tmp_path / "bso")
    with pytest.raises(SystemExit) as exited:
        main(["keys", "limits", "team-a", *argv, "--data-dir", str(data)])
    assert exited.value.code == 2
    assert "a whole number from 1 to 1000000" in capsys.readouterr().err


def test_outside_a_data_dir_nothing_is_written_where_no_service_reads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An operator in the wrong folder, without --data-dir: every action says so (exit 2)
    and no database appears in ./.bso for keys no service would check."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("BSO_DATABASE_URL", raising=False)
    for argv in (["list"], ["create", "--tenant", "team-a"], ["limits", "team-a"]):
        assert main(["keys", *argv]) == 2
        assert "no bso database in .bso (no credentials.env, no bso.sqlite3)" in (
            capsys.readouterr().err
        )
    assert not (tmp_path / ".bso").exists()
    # In the data dir's parent (where `bso up` ran), the same commands work.
    served_data_dir(tmp_path / ".bso")
    assert main(["keys", "list"]) == 0


def test_keys_list_on_a_data_dir_that_is_not_there_makes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A list reads: a typo'd --data-dir was made (its parents too) before the list said
    there was no database in it."""
    monkeypatch.delenv("BSO_DATABASE_URL", raising=False)
    typo = tmp_path / "typo" / ".bso"
    assert main(["keys", "list", "--data-dir", str(typo)]) == 2
    err = capsys.readouterr().err
    assert f"no bso database in {typo} (no credentials.env, no bso.sqlite3): " in err
    assert not (tmp_path / "typo").exists()


def test_a_sync_with_redis_down_says_what_to_do(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It said only that Redis was not updated, where create and limits name the fix."""
    data, _ = served_data_dir(tmp_path / "bso")
    admin = f"redis://bso-admin:hunter2@127.0.0.1:{free_port()}/0"
    assert main(["keys", "sync", "--admin-url", admin, "--data-dir", str(data)]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1
    assert err.startswith("bso keys: Redis at redis://bso-admin:***@127.0.0.1:")
    assert err.rstrip().endswith(
        "is bso up running? When it starts it gives every tenant its user itself; "
        "else check --admin-url"
    )
    assert "hunter2" not in err


def test_keys_list_reads_the_store_only_so_it_takes_no_admin_url(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An option a command ignores would let an operator think the listing came from Redis."""
    data, _ = served_data_dir(tmp_path / "bso")
    with pytest.raises(SystemExit) as exited:
        main(["keys", "list", "--admin-url", "redis://x@127.0.0.1:1/0", "--data-dir", str(data)])
    assert exited.value.code == 2
    assert "unrecognized arguments: --admin-url" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["list"], ["create", "--tenant", "team-a"]])
def test_an_older_database_is_left_for_bso_migrate(
    argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """bso keys (a list included) upgraded a database of revision 0008 to 0009 as it
    opened it, moving every team's jobs under the workers of the bso that still
    served it; it now says to migrate, and changes nothing."""
    from alembic import command
    from sqlalchemy import text

    from bso.storage.schema import SCHEMA_REVISION
    from bso.storage.sql.engine import alembic_config, make_engine

    url = f"sqlite:///{tmp_path / 'old.sqlite3'}"
    engine = make_engine(url)
    try:
        with engine.begin() as connection:
            config = alembic_config()
            config.attributes["connection"] = connection
            command.upgrade(config, "0008")
        assert main(["keys", *argv, "--database-url", url]) == 2
        err = capsys.readouterr().err
        assert f"not at the current bso schema (found 0008, need {SCHEMA_REVISION})" in err
        assert f"bso migrate --database-url {url}" in err
        with engine.connect() as connection:
            found = connection.execute(text("SELECT version_num FROM alembic_version"))
            assert found.scalars().all() == ["0008"]
    finally:
        engine.dispose()


def test_a_brand_new_database_gets_its_tables_from_a_first_key(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'new.sqlite3'}"
    assert main(["keys", "create", "--tenant", "team-a", "--database-url", url]) == 0
    assert [r.tenant for r in SqlStore(url).api_keys()] == ["team-a"]


def test_limits_name_one_tenant(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data, _ = served_data_dir(tmp_path / "bso")
    at = ["--data-dir", str(data)]
    assert main(["keys", "limits", *at]) == 2
    assert "name the tenant: bso keys limits TEAM (or --tenant TEAM)" in capsys.readouterr().err
    assert main(["keys", "limits", "team-a", "--tenant", "team-b", *at]) == 2
    assert "two tenants named: team-a and --tenant team-b" in capsys.readouterr().err
