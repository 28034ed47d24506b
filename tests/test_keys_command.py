"""``bso keys create``'s team file: what an operator hands a team, and nothing else."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from bso.cli import main
from bso.service import BsoService
from bso.storage.sql import SqlStore
from bso_workers.credentials import Credentials, read_env_file, save

CLIENT_PORT = 16399


def served_data_dir(path: Path) -> tuple[Path, Credentials]:
    """A data dir as ``bso up`` leaves it: credentials.env with every secret."""
    path.mkdir(mode=0o700)
    credentials = Credentials.generate()
    save(path, credentials, "127.0.0.1", CLIENT_PORT, f"sqlite:///{path / 'bso.sqlite3'}")
    return path, credentials


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
    assert out[2].startswith(f"team file {team_file} (0600): hand team team-a this file")
    assert stat.S_IMODE(team_file.stat().st_mode) == 0o600
    assert stat.S_IMODE((data / "teams").stat().st_mode) == 0o700
    values = read_env_file(team_file)
    assert values == {
        "BSO_BROKER_URL": credentials.client_url("127.0.0.1", CLIENT_PORT),
        "BSO_API_KEY": key,
    }
    text = team_file.read_text()
    for secret in (
        credentials.worker_password,
        credentials.flower_password,
        credentials.api_key or "no default key in this data dir",
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
    assert url == credentials.client_url("127.0.0.1", CLIENT_PORT)
    assert tenant_of(data, key) == "team-b"


def test_without_the_clients_url_no_file_is_written_and_the_output_says_what_to_hand(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "bare"
    assert main(["keys", "create", "--tenant", "team-c", "--data-dir", str(data)]) == 0
    out = capsys.readouterr().out
    assert "no team file" in out
    assert "give --broker-url" in out
    assert not (data / "teams").exists()
    url = "redis://bso-client:secret@bso.example:6379/0"
    argv = ["keys", "create", "--tenant", "team-c", "--data-dir", str(data), "--broker-url", url]
    assert main(argv) == 0
    capsys.readouterr()
    (team_file,) = (data / "teams").iterdir()
    assert read_env_file(team_file)["BSO_BROKER_URL"] == url
