"""Every failure of ``bso`` is one line on stderr that names the fix; no traceback, no secret.

A mistake the user can fix exits 2, a bug exits 1 (and says how to see its
traceback), Ctrl-C 130 (``bso.commands.failures``).
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from bso.cli import main
from bso.commands import failures, simulate
from bso.errors import Forbidden, InvalidSpec, ServiceUnavailable, Unauthorized, UnknownJob
from bso_workers.supervision import free_port

ROOT = Path(__file__).resolve().parents[1]
FAST = ["simulate", "--workload", "synthetic-language", "--recurrences", "2"]


def failure_line(argv: list[str], capsys: pytest.CaptureFixture[str], status: int = 2) -> str:
    """The one line ``bso`` prints on stderr for ``argv``, which must exit ``status``."""
    assert main(argv) == status
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith(f"bso {argv[0]}: ")
    assert "Traceback" not in captured.err
    return lines[0]


# -- URLs ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["status", "job", "--broker-url", "http://user:hunter2@broker:6379/0"],
        ["deadletters", "--broker-url", "redis://user:hunter2@broker:port/0"],
    ],
    ids=["wrong-scheme", "bad-port"],
)
def test_a_malformed_redis_url(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    line = failure_line(argv, capsys)
    assert "not a Redis URL: " in line
    assert "user:***@broker" in line
    assert "give one like redis://[user:password@]host:6379/0" in line
    assert "hunter2" not in line


@pytest.mark.parametrize(
    "url", ["not a url", "mysql+nodriver://bso:hunter2@db/bso"], ids=["unparsable", "no-dialect"]
)
def test_a_malformed_database_url(
    url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    line = failure_line(["migrate", "--database-url", url], capsys)
    assert "not a database URL bso can use" in line
    assert "give --database-url as sqlite:///" in line
    assert "hunter2" not in line


@pytest.mark.parametrize("command", ["migrate", "status", "keys"])
@pytest.mark.parametrize(
    "url",
    ["mysql://bso:hunter2", "postgresql://bso:pw@127.0.0.1:54x/bso"],
    ids=["no-host", "port-typo"],
)
def test_a_database_url_whose_port_is_not_a_number(
    command: str, url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Was exit 1, 'internal error (ValueError: invalid literal for int() with base 10:
    'hunter2'); this is a bug in bso': the password in the line, as the port."""
    argv = {"status": ["status"], "keys": ["keys", "list"]}.get(command, [command])
    line = failure_line([*argv, "--database-url", url], capsys)
    assert "not a database URL bso can use (the port after the host is not a number" in line
    assert "hunter2" not in line
    assert "internal error" not in line


# -- services that cannot be reached --------------------------------------------------------


@pytest.mark.parametrize("command", [["status", "job"], ["jobs", "reset", "job"]])
def test_nothing_listening_at_the_broker_url(
    command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    port = free_port()
    url = f"redis://bso-client:hunter2@127.0.0.1:{port}/0"
    line = failure_line([*command, "--broker-url", url, "--api-key", "bso_x"], capsys)
    where = f"redis://bso-client:***@127.0.0.1:{port}/0"
    assert f"the bso service at {where} (from --broker-url) is unreachable" in line
    assert "check that --broker-url names the host and port the service listens on" in line
    assert "`bso up` starts one" in line
    assert "hunter2" not in line
    # The training client's outage settings mean nothing to a command's user.
    assert "outage_window_s" not in line
    assert "ServiceClient" not in line
    assert "gave up after waiting" not in line


def test_an_unreachable_url_from_bso_ups_data_dir_asks_whether_it_still_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    saved = tmp_path / "credentials.env"
    saved.write_text(
        f"BSO_BROKER_URL=redis://bso-client:hunter2@127.0.0.1:{free_port()}/0\nBSO_API_KEY=k\n"
    )
    saved.chmod(0o600)
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("BSO_BROKER_URL", raising=False)
        line = failure_line(["jobs", "list", "--data-dir", str(tmp_path)], capsys)
    assert f"(from bso up's {saved}) is unreachable" in line
    assert "is bso up still running?" in line
    assert "hunter2" not in line


def test_a_database_server_that_is_down(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"postgresql://bso:hunter2@127.0.0.1:{free_port()}/bso"
    line = failure_line(["migrate", "--database-url", url], capsys)
    assert line.startswith("bso migrate: cannot use the database: ")
    assert "start the database server, or check --database-url" in line
    assert "hunter2" not in line


def test_a_database_not_at_the_current_schema_names_the_migration(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "old.sqlite3"
    sqlite3.connect(path).close()  # a database without bso's tables
    url = f"sqlite:///{path}"
    line = failure_line(["status", "--database-url", url], capsys)
    assert "is not at the current bso schema" in line
    assert line.endswith(f"apply the migrations first: bso migrate --database-url {url}")
    assert main(["migrate", "--database-url", url]) == 0  # the fix it names works
    assert main(["status", "--database-url", url]) == 0


@pytest.mark.parametrize(
    "command",
    [["status"], ["migrate"], ["keys", "list"], ["up", "--redis-port", "0", "--flower-port", "0"]],
    ids=["status", "migrate", "keys", "up"],
)
def test_a_database_a_newer_bso_migrated_is_not_sent_to_bso_migrate(
    command: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An operator who rolls back to an older bso: its migrations cannot help (bso never
    downgrades), so no line tells them to run ``bso migrate``, and none says it is a bug."""
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    url = f"sqlite:///{data_dir / 'bso.sqlite3'}"
    assert main(["migrate", "--database-url", url]) == 0
    with sqlite3.connect(data_dir / "bso.sqlite3") as connection:
        connection.execute("UPDATE alembic_version SET version_num = '9999'")
    where = ["--data-dir", str(data_dir)] if command[0] == "up" else ["--database-url", url]
    argv = [*command[:1], *where, *command[1:]] if command[0] == "keys" else [*command, *where]
    line = failure_line(argv, capsys)
    assert "is at a bso schema newer than this bso knows (found 9999, need " in line
    assert "a newer bso migrated it" in line
    assert "apply the migrations" not in line
    assert "bso migrate --database-url" not in line
    assert "internal error" not in line


# -- paths ----------------------------------------------------------------------------------


def test_a_trace_folder_that_does_not_exist(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    line = failure_line(["simulate", "--traces", str(tmp_path / "nowhere")], capsys)
    assert f"--traces {tmp_path / 'nowhere'}: no such folder" in line
    assert "leave --traces out" in line


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("missing/plot.png", "the folder {folder}/missing does not exist; create it first"),
        ("plot", "has no extension to choose the image format by; give one, e.g. {path}.png"),
        ("plot.data", "matplotlib cannot write .data files; use .png, .pdf, .svg"),
        (".", "is a folder; give a file's path"),
    ],
    ids=["no-folder", "no-extension", "unknown-format", "a-folder"],
)
def test_a_plot_path_that_cannot_be_written_is_refused_before_the_replay(
    name: str, says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / name
    line = failure_line([*FAST, "--plot", str(path)], capsys)
    assert says.format(folder=tmp_path, path=path) in line
    assert list(tmp_path.iterdir()) == []  # nothing written, not even plot.png


def test_status_checks_its_plot_path_too(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plot = tmp_path / "missing" / "status.png"
    line = failure_line(["status", "--database-url", "sqlite:///x", "--plot", str(plot)], capsys)
    assert "does not exist; create it first" in line


@pytest.mark.parametrize("command", ["migrate", "up"])
def test_a_data_dir_behind_a_file(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    ports = ["--redis-port", "0", "--flower-port", "0"] if command == "up" else []
    line = failure_line([command, "--data-dir", str(blocker / "data"), *ports], capsys)
    assert str(blocker) in line
    assert "give a folder you can write to" in line or "a file is in the way" in line


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_a_data_dir_that_is_not_writable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    line = failure_line(["migrate", "--data-dir", str(locked / "data")], capsys)
    assert "Permission denied" in line
    assert "give a folder you can write to" in line


# -- bugs, interruptions, and the real command ----------------------------------------------


def test_a_bug_is_one_line_that_says_how_to_see_the_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def broken(_: argparse.Namespace) -> int:
        raise KeyError("redis://bso:hunter2@broker:6379/0")

    monkeypatch.setattr(simulate, "run", broken)
    monkeypatch.delenv(failures.DEBUG_ENV, raising=False)
    line = failure_line(FAST, capsys, status=1)
    assert line.startswith("bso simulate: internal error (KeyError: ")
    assert "run the command again with BSO_DEBUG=1 to see the traceback" in line
    assert "hunter2" not in line
    monkeypatch.setenv(failures.DEBUG_ENV, "1")
    with pytest.raises(KeyError):
        main(FAST)


def test_ctrl_c_is_one_line_and_status_130(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def interrupted(_: argparse.Namespace) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(simulate, "run", interrupted)
    assert failure_line(FAST, capsys, status=130) == "bso simulate: interrupted"


@pytest.mark.parametrize(
    ("error", "status", "fix"),
    [
        (ServiceUnavailable("no reply"), 2, "`bso up` starts one"),
        (Unauthorized("no such key"), 2, "--api-key or BSO_API_KEY"),
        (Forbidden("not yours"), 2, "the tenant that owns the job"),
        (UnknownJob("job 'x' is not registered"), 2, "check the job id"),
        (InvalidSpec("batch_sizes must not be empty"), 1, "InvalidSpec: batch_sizes"),
    ],
)
def test_what_each_bso_error_tells_the_user(error: Exception, status: int, fix: str) -> None:
    line, got = failures.failure_line(error)
    assert got == status
    assert fix in line
    assert "internal error" not in line


@pytest.mark.parametrize(
    ("argv", "starts"),
    [
        (["migrate", "--database-url", "nope://u:hunter2@h/x"], "bso migrate: not a database URL"),
        (
            ["status", "job", "--broker-url", "redis://u:hunter2@127.0.0.1:1/0", "--api-key", "x"],
            "bso status: the bso service at redis://u:***@127.0.0.1:1/0 (from --broker-url) "
            "is unreachable",
        ),
    ],
    ids=["bad-url", "no-broker"],
)
def test_the_real_command_prints_one_line_and_exits_2(
    argv: list[str], starts: str, tmp_path: Path
) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bso.cli", *argv],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={k: v for k, v in os.environ.items() if k != failures.DEBUG_ENV},
    )
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1, done.stderr  # no log line, no traceback
    assert done.stderr.startswith(starts)
    assert "hunter2" not in done.stderr
