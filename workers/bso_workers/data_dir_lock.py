"""One running service per data folder: an exclusive lock that dies with its holder.

Two stacks on one data folder would share its SQLite file, Redis's append-only
file, beat's schedule and the metrics folder (which a start empties), and the
later one would leave ``credentials.env`` naming its own Redis, dead once it
stops, while the earlier one still runs.  So :meth:`bso_workers.stack.Stack.start`
takes this lock before it reads or writes anything in the folder, and
:meth:`~bso_workers.stack.Stack.stop` lets it go once every child has stopped.

The lock is ``flock(2)`` on :data:`LOCK_FILE` in the data folder: the kernel
drops it when the holding process exits, however it exits (SIGKILL, the OOM
killer), so a lock file left behind never blocks the next start.  The file
holds the holder's pid and what it is (``bso up``), for the refusal's message
only; it is emptied on release but never removed (a lock file removed while
another process has it open would let two holders lock two different files).
Its descriptor is not inherited by the children the stack starts (Python opens
files non-inheritable, and :func:`~bso_workers.supervision.spawn` closes the
rest), so the lock is the supervisor's alone.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import time
from dataclasses import dataclass
from pathlib import Path

LOCK_FILE = "bso.lock"

_HELD = (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)
"""What ``flock(LOCK_NB)`` fails with when another descriptor holds the lock."""

_READ_TRIES = 20
_READ_PAUSE_S = 0.025
"""A holder writes its pid just after it locks: a refused start reads the file
again for up to half a second before it gives up on naming the pid."""


@dataclass(frozen=True)
class Holder:
    """Who holds a data folder, as its lock file says."""

    pid: int | None
    what: str


class DataDirInUse(Exception):
    """Another process already runs a service from this data folder."""

    def __init__(self, data_dir: Path, holder: Holder) -> None:
        self.data_dir = data_dir
        self.holder = holder
        pid = f"pid {holder.pid}" if holder.pid is not None else "pid unknown"
        super().__init__(
            f"{holder.what} already runs from {data_dir} ({pid}); stop it first "
            "(Ctrl-C where it runs), or give this one another --data-dir"
        )


@dataclass
class DataDirLock:
    """The held lock on one data folder; :meth:`release` (or the process's exit) frees it."""

    data_dir: Path
    _fd: int | None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Empty the lock file and unlock it; a second call does nothing."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)


def lock_data_dir(data_dir: Path, what: str) -> DataDirLock:
    """Lock ``data_dir`` for this process (creating the folder if need be), recording
    ``what`` holds it.

    Raises :class:`DataDirInUse`, naming the holder, if another process (or another
    lock in this one) holds it already; then nothing in the folder has changed.
    """
    data_dir = data_dir.resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(data_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno not in _HELD:
            raise
        raise DataDirInUse(data_dir, holder_of(data_dir)) from None
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {what}\n".encode(), 0)
    except BaseException:
        os.close(fd)  # closing the only descriptor drops the lock
        raise
    return DataDirLock(data_dir, fd)


def refusal(data_dir: Path) -> DataDirInUse | None:
    """The refusal a start on ``data_dir`` would meet now, or None; creates nothing.

    For a command's checks before it starts (``bso up`` looks here before it looks
    for taken ports, so that a second ``bso up`` on the default ports is told what
    runs, not to pick other ports); :func:`lock_data_dir` is still the one that counts.
    """
    data_dir = data_dir.resolve()
    try:
        fd = os.open(data_dir / LOCK_FILE, os.O_RDONLY)
    except FileNotFoundError:
        return None  # no lock file: nothing ever ran from here (or no folder yet)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno not in _HELD:
            raise
        return DataDirInUse(data_dir, holder_of(data_dir))
    finally:
        os.close(fd)  # the probe's own lock, if it got it, goes with the descriptor
    return None


def holder_of(data_dir: Path) -> Holder:
    """What the lock file of ``data_dir`` says holds it (``pid None`` if it does not say)."""
    text = ""
    for attempt in range(_READ_TRIES):
        try:
            text = (data_dir / LOCK_FILE).read_text(errors="replace")
        except OSError:
            text = ""
        if text.strip() or attempt == _READ_TRIES - 1:
            break
        time.sleep(_READ_PAUSE_S)
    return parse_holder(text)


def parse_holder(text: str) -> Holder:
    """``"<pid> <what>"``, as :func:`lock_data_dir` writes it; anything else: a holder unknown."""
    pid, _, what = text.strip().partition(" ")
    if not pid.isdigit():
        return Holder(None, "another bso service")
    return Holder(int(pid), what.strip() or "another bso service")
