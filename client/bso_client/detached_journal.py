"""The journal of a detached run, kept on the training machine until the service has it.

A run that lost the service (:mod:`bso_client.fail_open`) writes every epoch to
one JSON file, replaced atomically (a temporary file, fsync, ``os.replace``), so
a crash leaves the previous version or the new one, never half of one::

    <cache dir>/detached/<job key>/<journal id>.json

(the cache dir is discovery's: ``BSO_CACHE_DIR``, else ``$XDG_CACHE_HOME/bso`` or
``~/.cache/bso``).  The file holds the :class:`~bso.wire.events.DeliverDetachedRun`
event itself, whose ``event_id`` is the journal's id: delivering it twice is
applied once by the service.  A journal is removed only after the service
acknowledged it (or refused it for good: its answer to that id never changes).

A journal is deliverable once its run ended, or when the process that wrote it
is gone (killed: delivered as interrupted), which the lock it holds tells
(:func:`hold_lock`).  :func:`pending_journals` lists a
job's deliverable journals; the next run of the job on the machine delivers them.

Job ids are per tenant, so two teams sharing a cache dir may each have a job
``nightly``: a job's journals are kept under its key for the tenant the run acts
for (:func:`local_owner`, :func:`bso.apikeys.job_key`), and one team's run never
delivers another's journal with its own key.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import socket
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import ValidationError

from bso.apikeys import DEFAULT_TENANT, job_key, key_id_of
from bso.core.vocabulary import StopReason
from bso.errors import BsoError, Unauthorized
from bso.spec import Hardware
from bso.wire.connection import namespace_of_url
from bso.wire.events import (
    DeliverDetachedRun,
    DetachedEpoch,
    DetachedRunDelivered,
    EndReason,
    new_event_id,
)
from bso_client.discovery import cache_dir
from bso_client.fail_open import is_service_failure

logger = logging.getLogger("bso_client.optimizer")

JOURNAL_VERSION = 1


NO_OWNER = "key:none"
"""The owner of a run with no valid API key on a URL that names no team: nobody's, so
its epochs are not journaled (no later run could tell whose they are)."""


def local_owner(broker_url: str | None, api_key: str | None) -> str:
    """Whom a run's journals and remembered recommendations belong to on this machine.

    A team's own URL names its tenant (:func:`bso.wire.connection.namespace_of_url`).
    The shared URL of a deployment from before tenant users does not, so the API
    key's id stands in (``key:<id>``; ``:`` is in no tenant name): a rotated key
    starts afresh.  An in-process service serves the default tenant.
    """
    if broker_url is None:
        return DEFAULT_TENANT
    tenant = namespace_of_url(broker_url).tenant
    if tenant is not None:
        return tenant
    try:
        key_id, _ = key_id_of(api_key)
    except Unauthorized:  # the service refuses the run before it trains
        return NO_OWNER
    return f"key:{key_id}"


def owners_delivered(broker_url: str | None, api_key: str | None) -> tuple[str, ...]:
    """Whose journals a run of ``api_key`` on ``broker_url`` delivers: its own owner's,
    and, on a team's own URL, those of runs that used the same key on a URL that names
    no tenant (``key:<id>``: the shared URL, or a guessed one, while the service was
    down).  The service takes the key on the team's queue only if it is the team's."""
    owner = local_owner(broker_url, api_key)
    if owner.startswith("key:"):
        return (owner,)
    try:
        key_id, _ = key_id_of(api_key)
    except Unauthorized:
        return (owner,)
    return (owner, f"key:{key_id}")


def job_folder(job_id: str, root: Path | None = None, owner: str = DEFAULT_TENANT) -> Path:
    """Where ``owner``'s journals of ``job_id`` are: a readable name plus a hash of the
    job's key, so that no job id (``..``, a colon) can leave the folder or collide after
    the characters are replaced.  The default tenant's folders are those of the job id
    alone, as before job ids were per tenant."""
    key = job_key(owner, job_id)
    readable = re.sub(r"[^A-Za-z0-9_-]", "_", key)[:64]
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return cache_dir(root) / "detached" / f"{readable}-{digest}"


@dataclass
class DetachedJournal:
    """One detached run's journal; :meth:`save` after every change."""

    path: Path
    run: DeliverDetachedRun
    ended: bool = False
    pid: int = field(default_factory=os.getpid)
    host: str = field(default_factory=socket.gethostname)
    _lock: int | None = field(default=None, repr=False, compare=False)
    """The open lock file the writer holds while it lives (:func:`hold_lock`)."""

    @classmethod
    def start(
        cls,
        *,
        job_id: str,
        hardware: Hardware,
        batch_size: int,
        trial_number: int | None,
        epochs: list[DetachedEpoch],
        root: Path | None = None,
        owner: str = DEFAULT_TENANT,
    ) -> DetachedJournal:
        """A new journal for the run, written at once, among ``owner``'s."""
        run = DeliverDetachedRun(
            event_id=new_event_id(),
            job_id=job_id,
            hardware=hardware,
            batch_size=batch_size,
            trial_number=trial_number,
            epochs=list(epochs),
        )
        journal = cls(job_folder(job_id, root, owner) / f"{run.event_id}.json", run)
        journal.save()
        journal._lock = hold_lock(journal.path)
        return journal

    def record(self, epoch: DetachedEpoch) -> DetachedJournal:
        self.run = self.run.model_copy(update={"epochs": [*self.run.epochs, epoch]})
        self.save()
        return self

    def end(self, reason: EndReason) -> DetachedJournal:
        """The run is over: ``reason`` counts where the epochs reached neither the
        target nor ``max_epochs``."""
        self.run = self.run.model_copy(update={"end_reason": reason})
        self.ended = True
        self.save()
        return self

    def save(self) -> None:
        document = {
            "version": JOURNAL_VERSION,
            "ended": self.ended,
            "pid": self.pid,
            "host": self.host,
            "run": self.run.model_dump(mode="json"),
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(dir=self.path.parent, prefix=".journal-", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as out:
                json.dump(document, out)
                out.flush()
                os.fsync(out.fileno())
            os.replace(temporary, self.path)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)
        lock_path(self.path).unlink(missing_ok=True)
        self.release()

    def release(self) -> None:
        """Let go of the writer's lock (the process's exit does it too)."""
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None

    @classmethod
    def load(cls, path: Path) -> DetachedJournal | None:
        """The journal at ``path``; None if it cannot be read.

        A file that is no journal (cut short or overwritten by a crash of the disk,
        an edit, another JSON value) used to be skipped at DEBUG on every run, its run
        lost unsaid, and one that was valid JSON of another shape raised out of the
        next run's start and ended it.  It is now set aside once (:func:`_set_aside`)
        with a WARNING.  A journal of another version (a newer client on the machine)
        is left to it."""
        try:
            text = path.read_text()
        except OSError as err:  # delivered meanwhile, or an unreadable folder
            logger.debug("bso: cannot read detached-run journal %s: %s", path, err)
            return None
        try:
            document = json.loads(text)
            if not isinstance(document, dict):
                raise TypeError(f"a JSON {type(document).__name__}, not an object")
            if document.get("version") != JOURNAL_VERSION:
                logger.debug("bso: journal %s is of another version", path)
                return None
            run = DeliverDetachedRun.model_validate(document["run"])
            ended, pid, host = document["ended"], document["pid"], document["host"]
            if not isinstance(ended, bool) or not isinstance(host, str):
                raise TypeError("'ended' or 'host' of the wrong type")
            if not isinstance(pid, int) or not 0 < pid < 2**31:
                raise ValueError(f"no process id: {pid!r}")
        except (ValueError, KeyError, TypeError, ValidationError) as err:
            _set_aside(path, err)
            return None
        return cls(path, run, ended, pid, host)

    @property
    def deliverable(self) -> bool:
        """Ended, or its writer is gone (then it is delivered as interrupted)."""
        return self.ended or not _writer_alive(self.path, self.pid, self.host)

    @property
    def empty(self) -> bool:
        """Nothing to learn: no epoch, and no trial the service waits to hear about."""
        return not self.run.epochs and self.run.trial_number is None


def lock_path(journal: Path) -> Path:
    """The lock file beside a journal (not a ``*.json``: never read as a journal)."""
    return journal.with_name(journal.stem + ".lock")


def hold_lock(journal: Path) -> int | None:
    """Take the journal's lock for this process's life, and keep it open: the fd.

    Whether a journal's writer still runs was told by its pid and host name only, and
    a container has a host name of its own each time it starts (Docker's container
    id, a Kubernetes pod's name) and a pid namespace of its own: a run in a container
    that lost the service left a journal that every later container, with the same
    cache volume, took for another machine's, never delivered.  A lock held by the
    writer is released by the kernel when it dies, however it dies, seen from any
    container on the machine.  None where the file system has no locks (then the pid
    and host name decide, as before)."""
    try:
        fd = os.open(lock_path(journal), os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # no locks here: no lock file, lest a reader take it for a dead one
        os.close(fd)
        lock_path(journal).unlink(missing_ok=True)
        return None
    return fd


def _lock_held(journal: Path) -> bool | None:
    """Whether the journal's writer holds its lock; None where no lock tells (a journal
    of an earlier client, or a file system without locks)."""
    try:
        fd = os.open(lock_path(journal), os.O_RDWR)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return None
    finally:
        os.close(fd)  # a lock taken here is released with it
    return False


def _writer_alive(journal: Path, pid: int, host: str) -> bool:
    held = _lock_held(journal)
    if held is not None:
        return held
    if host != socket.gethostname():
        return True  # a shared cache dir: another machine's run is its own to deliver
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


UNREADABLE_SUFFIX = ".unreadable"
"""Appended to a journal file that cannot be read, so that no later run reads it again."""


def _set_aside(path: Path, why: Exception) -> None:
    """Rename an unreadable journal out of the runs' way (kept for a person to read)
    and say once, as a WARNING, that bso will not learn from its run."""
    aside = path.with_name(path.name + UNREADABLE_SUFFIX)
    try:
        os.replace(path, aside)
    except OSError:
        aside = path
    logger.warning(
        "bso: the detached-run journal %s cannot be read (%s); bso will not learn from "
        "that run; the file is kept as %s",
        path,
        str(why)[:200],
        aside,
    )


def pending_journals(
    job_id: str, root: Path | None = None, owner: str = DEFAULT_TENANT
) -> list[DetachedJournal]:
    """``owner``'s journals of the job on this machine that may be delivered now, oldest
    first."""
    try:
        folder = job_folder(job_id, root, owner)
        paths = sorted((p.stat().st_mtime, p) for p in folder.glob("*.json"))
    except OSError:  # no folder (or no cache folder), or a journal delivered meanwhile
        return []
    found = [DetachedJournal.load(p) for _, p in paths]
    return [j for j in found if j is not None and j.run.job_id == job_id and j.deliverable]


def deliver(
    journal: DetachedJournal, send: Callable[[DeliverDetachedRun], DetachedRunDelivered]
) -> DetachedRunDelivered | None:
    """Send ``journal`` with ``send``; remove it once the service answered.

    Returns the service's reply, or None when the service refused the run for good
    (an invalid journal, a deleted job: logged, and the journal is removed, since
    the service gives that same answer to that id forever).  A failure of the
    service (unreachable, a refused key) is raised and the journal kept.
    """
    if not journal.ended:  # its process is gone: killed, so interrupted
        journal.end(StopReason.INTERRUPTED)
    if journal.empty:
        journal.remove()
        return None
    try:
        reply = send(journal.run)
    except BsoError as err:
        if is_service_failure(err):
            raise
        logger.warning(
            "bso refused the detached run %s of job %s (%s); its journal %s is removed",
            journal.run.event_id,
            journal.run.job_id,
            err,
            journal.path,
        )
        journal.remove()
        return None
    journal.remove()
    logger.info(
        "bso: delivered the detached run %s of job %s: trial %d, %s",
        journal.run.event_id,
        journal.run.job_id,
        reply.trial_number,
        delivered_outcome(reply),
    )
    return reply


def delivered_outcome(reply: DetachedRunDelivered) -> str:
    """How the delivered run's trial ended, for its log line: ``converged
    (target_reached)``; an interruption says it is not held against the size (not
    ``interrupted (interrupted)``)."""
    if reply.reason is StopReason.INTERRUPTED:
        return "interrupted (its process was stopped or killed): not held against the batch size"
    return f"{reply.status.value} ({reply.reason.value if reply.reason else 'no reason'})"
