"""One service per data folder: the lock, who it names, and that it dies with its holder."""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from bso_workers.data_dir_lock import (
    LOCK_FILE,
    DataDirInUse,
    Holder,
    lock_data_dir,
    parse_holder,
    refusal,
)

HOLDER = textwrap.dedent(
    """
    import subprocess, sys, time
    from pathlib import Path
    from bso_workers.data_dir_lock import lock_data_dir

    lock = lock_data_dir(Path(sys.argv[1]), "bso up")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    print(child.pid, flush=True)
    time.sleep(60)
    """
)
"""A process that locks the folder, starts a child as ``bso up`` does, and waits."""


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], int]]:
    """Another process holding ``tmp_path / "data"``, and the pid of its child."""
    popen = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path / "data")],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert popen.stdout is not None
    child = int(popen.stdout.readline())
    try:
        yield popen, child
    finally:
        for pid in (popen.pid, child):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        popen.wait(10)


def test_the_lock_makes_the_folder_and_names_its_holder(tmp_path: Path) -> None:
    data = tmp_path / "a" / "data"
    lock = lock_data_dir(data, "bso up")
    try:
        assert lock.held
        path = data / LOCK_FILE
        assert path.read_text() == f"{os.getpid()} bso up\n"
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    finally:
        lock.release()


def test_a_second_lock_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    data = tmp_path / "data"
    lock = lock_data_dir(data, "bso up")
    try:
        before = (data / LOCK_FILE).read_bytes()
        with pytest.raises(DataDirInUse) as refused:
            lock_data_dir(data, "bso demo")
        assert refused.value.holder == Holder(os.getpid(), "bso up")
        assert refused.value.data_dir == data.resolve()
        assert str(refused.value) == (
            f"bso up already runs from {data.resolve()} (pid {os.getpid()}); stop it first "
            "(Ctrl-C where it runs), or give this one another --data-dir"
        )
        assert (data / LOCK_FILE).read_bytes() == before
        assert sorted(p.name for p in data.iterdir()) == [LOCK_FILE]
    finally:
        lock.release()


def test_a_released_lock_is_emptied_and_free_again(tmp_path: Path) -> None:
    data = tmp_path / "data"
    first = lock_data_dir(data, "bso up")
    first.release()
    first.release()  # a second release does nothing
    assert not first.held
    assert (data / LOCK_FILE).read_text() == ""
    second = lock_data_dir(data, "bso demo")
    try:
        assert (data / LOCK_FILE).read_text() == f"{os.getpid()} bso demo\n"
    finally:
        second.release()


def test_refusal_looks_without_taking_or_creating_anything(tmp_path: Path) -> None:
    data = tmp_path / "data"
    assert refusal(data) is None
    assert not data.exists()
    lock = lock_data_dir(data, "bso up")
    try:
        found = refusal(data)
        assert found is not None
        assert found.holder == Holder(os.getpid(), "bso up")
        assert lock.held
        assert (data / LOCK_FILE).read_text() == f"{os.getpid()} bso up\n"
    finally:
        lock.release()
    assert refusal(data) is None
    lock_data_dir(data, "bso up").release()  # the look left the lock free


def test_a_holder_in_another_process_is_named_by_its_pid(
    tmp_path: Path, holder: tuple[subprocess.Popen[str], int]
) -> None:
    popen, _child = holder
    data = tmp_path / "data"
    with pytest.raises(DataDirInUse, match=rf"bso up already runs from .* \(pid {popen.pid}\)"):
        lock_data_dir(data, "bso up")
    found = refusal(data)
    assert found is not None
    assert found.holder.pid == popen.pid


def test_the_lock_dies_with_its_holder_not_with_its_children(
    tmp_path: Path, holder: tuple[subprocess.Popen[str], int]
) -> None:
    """kill -9 leaves the lock file naming a dead pid; that never blocks the next start.
    A child of the holder (Redis, a worker) does not keep the lock."""
    popen, child = holder
    data = tmp_path / "data"
    os.kill(popen.pid, signal.SIGKILL)
    popen.wait(10)
    assert (data / LOCK_FILE).read_text() == f"{popen.pid} bso up\n"  # stale
    os.kill(child, 0)  # the holder's child still runs
    assert refusal(data) is None
    lock = lock_data_dir(data, "bso up")
    try:
        assert (data / LOCK_FILE).read_text() == f"{os.getpid()} bso up\n"
    finally:
        lock.release()


@pytest.mark.parametrize(
    ("text", "holder"),
    [
        ("123 bso up\n", Holder(123, "bso up")),
        ("123 a bso service", Holder(123, "a bso service")),
        ("123\n", Holder(123, "another bso service")),
        ("", Holder(None, "another bso service")),
        ("garbage here", Holder(None, "another bso service")),
    ],
)
def test_the_lock_file_is_read_leniently(text: str, holder: Holder) -> None:
    assert parse_holder(text) == holder


def test_an_unknown_pid_is_said_so(tmp_path: Path) -> None:
    refused = DataDirInUse(tmp_path, Holder(None, "another bso service"))
    assert str(refused).startswith(
        f"another bso service already runs from {tmp_path} (pid unknown)"
    )
