"""``bso`` and ``bso simulate``: in-process through bso.cli.main, and as a real command."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest

from bso.cli import COMMANDS, Command, main
from bso.commands.keys import ACTIONS
from bso.replay.report import plot_grid

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT.parent / "shared" / "traces"
FAST = ["simulate", "--workload", "synthetic-language", "--recurrences", "3"]


def table_rows(text: str) -> list[str]:
    """Rows of the per-recurrence tables (they start with the recurrence number)."""
    return [line for line in text.splitlines() if line.split()[:1] and line.split()[0].isdigit()]


def test_simulate_prints_a_table_and_a_summary(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(FAST) == 0
    out = capsys.readouterr().out
    assert "== synthetic-language (eta=0.5) policy=bso" in out
    assert "policy=zeus" not in out  # only the first policy without --details
    assert len(table_rows(out)) == 3
    assert "Cumulative cost / oracle's" in out
    summary = [line for line in out.splitlines() if line.startswith("synthetic-language")]
    assert len(summary) == 1
    mean = [line for line in out.splitlines() if line.startswith("geometric mean")]
    assert len(mean) == 1
    assert len(mean[0].split()) == 2 + 3  # label, then default, bso, zeus
    for value in mean[0].split()[2:]:
        assert float(value) > 0


def test_an_exploration_budget_adds_a_column_and_its_worst_ratio(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main([*FAST, "--exploration-budget", "0.02", "--exploration-budget", "0.05"]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("workload"))
    assert header.split()[-5:] == ["default", "bso", "zeus", "bso@0.02", "bso@0.05"]
    for budget in ("0.02", "0.05"):
        (line,) = [row for row in out.splitlines() if row.startswith(f"bso@{budget}: ")]
        assert line.endswith("x always-default's cost (synthetic-language, eta 0.5)")
        assert float(line.split()[3].rstrip("x")) > 0


def test_transfer_replays_each_workload_as_a_second_lane(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main([*FAST, "--transfer"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Lane B after 3 recurrences on lane A")
    rows = [line for line in out.splitlines() if line.startswith("synthetic-language")]
    assert len(rows) == 4  # one per second GPU of bso.replay.lanes.TILTS
    for row in rows:
        cold, transferred = (float(v) for v in row.split()[-2:])
        assert cold > -1.0
        assert transferred > -1.0
    assert main([*FAST, "--transfer", "--json"]) == 0
    rows_json = json.loads(capsys.readouterr().out)["transfer"]
    assert [r["tilt"] for r in rows_json] == [row.split()[1] for row in rows]


def test_details_shows_every_policy(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*FAST, "--details", "--policies", "zeus,bso"]) == 0
    out = capsys.readouterr().out
    assert "policy=zeus" in out
    assert "policy=bso" in out
    assert len(table_rows(out)) == 6


def test_several_etas_and_workloads(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "simulate",
        "--workload",
        "synthetic-language",
        "--workload",
        "synthetic-recsys",
        "--recurrences",
        "2",
        "--eta",
        "0.2",
        "--eta",
        "0.8",
        "--beta",
        "none",
        "--policies",
        "zeus",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    summary = [line for line in out.splitlines() if line.startswith("synthetic-")]
    assert len(summary) == 4
    assert {line.split()[1] for line in summary} == {"0.2", "0.8"}


def test_json_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*FAST, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    (comparison,) = data["comparisons"]
    assert comparison["workload"] == "synthetic-language"
    ratios = comparison["ratio_to_oracle"]
    assert set(ratios) == {"oracle", "default", "bso", "zeus"}
    assert ratios["oracle"] == 1.0
    assert all(r > 0 for r in ratios.values())
    assert len(comparison["results"]["bso"]["recurrences"]) == 3
    assert set(data["geometric_mean_ratio_to_oracle"]) == {"default", "bso", "zeus"}


def png_size(blob: bytes) -> tuple[int, int]:
    """Width and height of a PNG, from its header."""
    assert blob[:8] == b"\x89PNG\r\n\x1a\n"
    return int.from_bytes(blob[16:20], "big"), int.from_bytes(blob[20:24], "big")


def test_plot_writes_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "out.png"
    assert main([*FAST, "--policies", "zeus", "--plot", str(path)]) == 0
    assert str(path) in capsys.readouterr().err
    blob = path.read_bytes()
    assert png_size(blob)[0] <= 600  # one panel
    assert len(blob) > 10_000


def test_many_comparisons_plot_as_a_grid_that_reads_at_a_normal_size(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    workloads = ["synthetic-language", "synthetic-recsys", "synthetic-vision"]
    argv = ["simulate", "--recurrences", "2", "--policies", "zeus"]
    argv += [a for w in workloads for a in ("--workload", w)]
    argv += [a for eta in ("0.2", "0.4", "0.6", "0.8") for a in ("--eta", eta)]
    path = tmp_path / "grid.png"
    assert main([*argv, "--plot", str(path)]) == 0  # 12 comparisons
    width, height = png_size(path.read_bytes())
    assert width <= 1500  # 3 panels side by side (one row of 12 was 5,940 pixels)
    assert height > width  # 4 rows of them


@pytest.mark.parametrize(
    ("panels", "grid"), [(1, (1, 1)), (2, (1, 2)), (3, (1, 3)), (4, (2, 3)), (12, (4, 3))]
)
def test_plot_grid(panels: int, grid: tuple[int, int]) -> None:
    assert plot_grid(panels) == grid


def test_a_terminal_sees_the_progress_bar(tmp_path: Path) -> None:
    controller, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    with subprocess.Popen(
        [sys.executable, "-m", "bso.cli", *FAST, "--policies", "zeus"],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=terminal,
    ) as process:
        os.close(terminal)
        shown = b""
        while chunk := _read(controller):
            shown += chunk
        assert process.wait(120) == 0
    os.close(controller)
    assert b"replaying:" in shown
    assert b"/3 " in shown  # the total: 3 recurrences of one policy


def _read(fd: int) -> bytes:
    """What a pty's controller reads; b"" once the other side is closed."""
    try:
        return os.read(fd, 4096)
    except OSError:  # EIO: the child closed the terminal
        return b""


def test_missing_trace_folder_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "no-traces"
    assert main(["simulate", "--traces", str(missing)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("bso simulate: ")
    assert str(missing) in err
    assert "summary_train.csv" in err


def test_unknown_workload_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--workload", "mnist", "--recurrences", "1"]) == 2
    captured = capsys.readouterr()
    assert "unknown workload(s) ['mnist']" in captured.err
    assert "synthetic-language" in captured.err  # says what there is
    assert captured.out == ""


@pytest.mark.parametrize(
    "argv",
    [
        ["simulate", "--policies", "random"],
        ["simulate", "--policies", ""],
        ["simulate", "--recurrences", "many"],
        ["simulate", "--beta", "big"],
        ["simulate", "--exploration-budget", "-0.1"],
        ["simulate", "--exploration-budget", "lots"],
        ["frobnicate"],
        [],
    ],
)
def test_bad_arguments_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert "usage: bso" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "usage"),
    [
        (["jobs", "list", "--bogus"], "usage: bso jobs list "),
        (["keys", "list", "--bogus"], "usage: bso keys list "),
        (["simulate", "--bogus"], "usage: bso simulate "),
        (["status", "job", "extra"], "usage: bso status "),
    ],
)
def test_an_unknown_option_shows_the_usage_of_the_command_it_was_given_to(
    argv: list[str], usage: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``bso jobs list --bogus`` printed the top-level ``bso`` usage, which does not
    show the options the user was looking for."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(usage)
    assert f"{usage[len('usage: ') :].strip()}: error: unrecognized arguments: {argv[-1]}" in err


def exit_code(argv: list[str]) -> int:
    """The status ``bso`` would exit with, whether main returns it or argparse exits."""
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1


@pytest.mark.parametrize(
    ("option", "value", "named"),
    [
        ("--eta", "1.5", "eta"),
        ("--eta", "-0.1", "eta"),
        ("--beta", "0.5", "beta"),
        ("--recurrences", "0", "recurrences"),
    ],
)
def test_out_of_range_knobs_exit_2_with_a_message(
    option: str, value: str, named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["simulate", "--workload", "synthetic-language", "--recurrences", "2", option, value]
    code = exit_code(argv)
    captured = capsys.readouterr()
    assert code == 2
    assert named in captured.err
    assert value in captured.err
    assert "nan" not in captured.out


def test_simulate_on_the_v100_traces(capsys: pytest.CaptureFixture[str]) -> None:
    if not (TRACES / "summary_train.csv").is_file():
        pytest.fail(f"Zeus's traces are missing: expected them in {TRACES}")
    argv = ["simulate", "--traces", str(TRACES), "--gpu", "v100", "--workload", "squad"]
    assert main([*argv, "--recurrences", "3", "--json"]) == 0
    (comparison,) = json.loads(capsys.readouterr().out)["comparisons"]
    assert comparison["workload"] == "squad"
    assert main(["simulate", "--traces", str(TRACES), "--gpu", "a40"]) == 2
    assert "no power trace for GPU 'a40'" in capsys.readouterr().err


def test_as_a_real_command(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bso.cli", *FAST, "--policies", "zeus"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""  # no progress bar where stderr is no terminal
    assert "geometric mean" in done.stdout
    assert len(table_rows(done.stdout)) == 3
    failed = subprocess.run(
        [sys.executable, "-m", "bso.cli", "simulate", "--traces", str(tmp_path / "nowhere")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert failed.returncode == 2
    assert "bso simulate:" in failed.stderr
    assert "summary_train.csv" in failed.stderr


def help_text(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """What ``bso ... --help`` prints; it exits 0."""
    with pytest.raises(SystemExit) as exited:
        main([*argv, "--help"])
    assert exited.value.code == 0
    return capsys.readouterr().out


def assert_plain(text: str) -> None:
    """No docstring markup and no default that says nothing."""
    for markup in ("``", ":mod:", ":func:", ":class:", ":data:", ":meth:"):
        assert markup not in text
    assert "(default: None)" not in text
    assert "(default: False)" not in text


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c.name)
def test_every_command_help_describes_it_and_shows_defaults(
    command: Command, capsys: pytest.CaptureFixture[str]
) -> None:
    text = help_text([command.name], capsys)
    assert_plain(text)
    assert " ".join(command.description.split()) in " ".join(text.split())
    assert "(default: " in text


@pytest.mark.parametrize("action", ["create", "list", "revoke"])
def test_every_keys_action_help_describes_it(
    action: str, capsys: pytest.CaptureFixture[str]
) -> None:
    text = help_text(["keys", action], capsys)
    assert_plain(text)
    assert ACTIONS[action] in text


def test_top_level_help_lists_every_command_and_the_exit_statuses(
    capsys: pytest.CaptureFixture[str],
) -> None:
    text = help_text([], capsys)
    assert_plain(text)
    for command in COMMANDS:
        assert command.name in text
        assert " ".join(command.summary.split()) in " ".join(text.split())
    assert "exit status:" in text
    assert "BSO_DEBUG=1" in text


def test_a_reader_that_goes_away_ends_the_command_quietly() -> None:
    """``bso status JOB | head``: a closed pipe is not a bug in bso."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first line is written
    try:
        run = subprocess.run(
            [sys.executable, "-m", "bso.cli", *FAST],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
            check=False,
        )
    finally:
        os.close(write_end)
    assert run.stderr == ""
    assert run.returncode == 0


@pytest.mark.parametrize(
    "argv",
    [
        ["keys", "create", "--tenant", "team-a", "--data-dir", "{dir}"],
        ["keys", "--data-dir", "{dir}", "create", "--tenant", "team-a"],
        ["--data-dir", "{dir}", "keys", "create", "--tenant", "team-a"],
        ["--data-dir={dir}", "keys", "create", "--tenant", "team-a"],
    ],
)
def test_a_global_option_works_before_or_after_the_command_and_its_action(
    argv: list[str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)  # where the default data dir (.bso) would be made
    data = tmp_path / "data"
    assert main([a.format(dir=data) for a in argv]) == 0
    created = capsys.readouterr().out
    assert main(["keys", "list", "--data-dir", str(data)]) == 0
    listed = capsys.readouterr().out
    assert "team-a" in listed
    assert listed.split()[0] in created  # the key id of the key just made
    assert not (tmp_path / ".bso").exists()


def test_an_option_given_before_the_action_is_kept_when_none_follows_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path / 'other.sqlite3'}"
    assert main(["keys", "--database-url", url, "create", "--data-dir", str(tmp_path)]) == 0
    capsys.readouterr()
    assert main(["keys", "list", "--database-url", url]) == 0
    assert "default" in capsys.readouterr().out
