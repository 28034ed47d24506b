"""The SQLite writers' turnstile: a blocking kernel lock, per process, interruptible;
the store's writers take their turn on it."""

from __future__ import annotations

import fcntl
import os
import select
import signal
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

import pytest

from bso.storage.sql import SqlStore
from bso.storage.sql.engine import upgrade
from bso.storage.sql.sqlite_lock import SUFFIX, WriterTurnstile


@contextmanager
def held_elsewhere(path: Path) -> Iterator[None]:
    """The lock taken through another open file: what another bso process would hold."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        os.close(fd)


def entered_after(turnstile: WriterTurnstile, release_after_s: float) -> float:
    """Seconds between the other holder's release and this turnstile's entry (>= 0)."""
    entered: list[float] = []

    def enter() -> None:
        with turnstile.turn():
            entered.append(time.monotonic())

    with held_elsewhere(turnstile.path):
        waiter = threading.Thread(target=enter)
        waiter.start()
        time.sleep(release_after_s)
        assert entered == [], "entered while the lock was held elsewhere"
        released = time.monotonic()
    waiter.join(10)
    (entry,) = entered
    return entry - released


def test_the_lock_file_sits_beside_the_database(tmp_path: Path) -> None:
    turnstile = WriterTurnstile(tmp_path / "bso.sqlite3")
    assert turnstile.path == tmp_path / f"bso.sqlite3{SUFFIX}"
    with turnstile.turn():
        assert turnstile.path.exists()
    turnstile.close()


def test_a_writer_waits_for_the_holder_and_enters_as_soon_as_it_leaves(tmp_path: Path) -> None:
    turnstile = WriterTurnstile(tmp_path / "bso.sqlite3")
    delay = entered_after(turnstile, release_after_s=0.3)
    assert 0 <= delay < 1.0  # woken by the release (in practice within a millisecond)
    turnstile.close()


def test_a_forked_process_does_not_share_its_parents_turn(tmp_path: Path) -> None:
    turnstile = WriterTurnstile(tmp_path / "bso.sqlite3")
    read_end, write_end = os.pipe()
    with turnstile.turn():  # held by the parent through the very object the child inherits
        pid = os.fork()
        if pid == 0:  # the child: nothing but the turn and a write (no locks of pytest's)
            try:
                with turnstile.turn():
                    os.write(write_end, struct.pack("d", time.monotonic()))
            finally:
                os._exit(0)
        os.close(write_end)
        time.sleep(0.3)
        assert not select.select([read_end], [], [], 0)[0], "the child entered in the parent's turn"
        released = time.monotonic()
    assert select.select([read_end], [], [], 10)[0], "the child never entered"
    (entered,) = struct.unpack("d", os.read(read_end, 8))
    assert entered >= released
    os.waitpid(pid, 0)
    os.close(read_end)
    turnstile.close()


def test_a_signal_interrupts_the_wait(tmp_path: Path) -> None:
    class Interrupted(Exception):
        pass

    def on_alarm(_signum: int, _frame: FrameType | None) -> None:
        raise Interrupted

    turnstile = WriterTurnstile(tmp_path / "bso.sqlite3")
    previous = signal.signal(signal.SIGALRM, on_alarm)
    started = time.monotonic()
    try:
        with held_elsewhere(turnstile.path):
            signal.setitimer(signal.ITIMER_REAL, 0.1)
            with pytest.raises(Interrupted), turnstile.turn():
                pass
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert time.monotonic() - started < 5
    turnstile.close()


def test_sqlite_writers_take_their_turn_before_the_write_lock(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'bso.sqlite3'}"
    upgrade(url)
    store = SqlStore(url)
    other = WriterTurnstile(tmp_path / "bso.sqlite3")  # another bso process's handle
    entered = threading.Event()

    def write() -> None:
        with store.transaction("queued") as tx:
            entered.set()
            assert tx.get_job() is None

    with other.turn():
        writer = threading.Thread(target=write)
        writer.start()
        assert not entered.wait(0.3), "a transaction began while another writer had the turn"
        with store.read("queued") as reader:  # readers never wait for writers
            assert reader.get_job() is None
    assert entered.wait(10)
    writer.join(10)
    other.close()
    store.close()
