"""How ``bso`` reports a failure: one line on stderr, never a traceback.

A user of ``bso`` reads what went wrong and what to do about it; a traceback
answers neither and may quote a password.  So :func:`bso.cli.main` turns every
exception of a command into one line, ``bso <command>: <what>; <the fix>``,
with every URL in it redacted, and an exit status:

* **2**, a mistake the user can fix: argparse's own errors, and the errors
  :func:`user_error_line` knows: a malformed Redis or database URL, a service
  that cannot be reached, a database not at the current schema, a path that
  does not exist or cannot be written, a refused API key, an unknown job, and
  :class:`UserError`, which a command raises with its own line;
* **1**, the command ran and failed (a demo's job failed, no batch size fits:
  any other :class:`~bso.errors.BsoError`, whose message is the line), or bso
  has a bug: any other exception is one line that says it is an internal error
  and how to see its traceback (``BSO_DEBUG=1``);
* **130**, interrupted (Ctrl-C).

With ``BSO_DEBUG=1`` in the environment every exception is raised as it is,
traceback and all, for a bug report.

This module imports no optional dependency at load time (``bso simulate``
runs on the core install): a library's errors are recognized only if that
library is already imported, which it is when a command raised one.
"""

from __future__ import annotations

import errno
import os
import re
import sys
from pathlib import Path

from bso.errors import BsoError, Forbidden, ServiceUnavailable, Unauthorized, UnknownJob
from bso.wire.urls import redact_urls_in

DEBUG_ENV = "BSO_DEBUG"
"""Set to 1 to see the traceback of any failure instead of its one line."""

USER_ERROR_STATUS = 2
FAILURE_STATUS = 1
INTERRUPTED_STATUS = 130


class UserError(Exception):
    """A mistake the user can fix; the message says what is wrong and what to do.

    ``bso`` prints it as one line and exits with status 2.
    """


def debugging(environ: dict[str, str] | None = None) -> bool:
    """Whether ``BSO_DEBUG`` asks for tracebacks."""
    value = (os.environ if environ is None else environ).get(DEBUG_ENV, "")
    return value.strip().lower() not in ("", "0", "false", "no")


def one_line(text: str) -> str:
    """``text`` as a single line with its URLs redacted: what a failure line may show."""
    return redact_urls_in(" ".join(text.split()))


def failure_line(exc: Exception) -> tuple[str, int]:
    """The line (without the ``bso <command>:`` prefix) and exit status for ``exc``."""
    known = user_error_line(exc)
    if known is not None:
        return one_line(known), USER_ERROR_STATUS
    if isinstance(exc, BsoError):
        return one_line(f"{type(exc).__name__}: {exc.message}"), FAILURE_STATUS
    return (
        one_line(
            f"internal error ({type(exc).__name__}: {_first_line(exc)}); this is a bug in bso: "
            f"run the command again with {DEBUG_ENV}=1 to see the traceback, and report it"
        ),
        FAILURE_STATUS,
    )


def user_error_line(exc: Exception) -> str | None:
    """What to tell the user about ``exc`` if it is a mistake they can fix, else None."""
    if isinstance(exc, UserError):
        return str(exc)
    if isinstance(exc, BsoError):
        return _bso_error_line(exc)
    for describe in (_url_error_line, _database_error_line, _redis_error_line):
        line = describe(exc)
        if line is not None:
            return line
    if isinstance(exc, OSError):
        return _path_error_line(exc)
    return None


def _bso_error_line(exc: BsoError) -> str | None:
    if isinstance(exc, ServiceUnavailable):
        if "bso up" in exc.message:  # the message names the fix already
            return exc.message
        return f"{exc.message.rstrip('.')}; {broker_fix(exc)}"
    if isinstance(exc, Unauthorized):
        return (
            f"{exc.message}; give the tenant's API key with --api-key or BSO_API_KEY "
            "(`bso keys create` makes one)"
        )
    if isinstance(exc, Forbidden):
        return f"{exc.message}; use an API key of the tenant that owns the job"
    if isinstance(exc, UnknownJob):
        return f"{exc.message}; check the job id"
    return None


def broker_fix(exc: BaseException) -> str:
    """What to do about a broker that did not serve, from the Redis error behind ``exc``."""
    redis = sys.modules.get("redis")
    seen: set[int] = set()
    current: BaseException | None = exc
    while redis is not None and current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, redis.AuthenticationError | redis.exceptions.AuthorizationError):
            return (
                "check the user and password of the broker URL (--broker-url, else "
                "$BSO_BROKER_URL, else the data folder's credentials.env): a team's come in "
                "its team file, and a revoked key's stop working (a revoked default key is "
                "replaced, in credentials.env, when bso up starts again)"
            )
        if isinstance(current, redis.exceptions.NoPermissionError):
            return "this Redis user lacks a right bso needs: check its ACL (docs/security.md)"
        current = current.__cause__ or current.__context__
    return "is the service running? `bso up` starts one; else check --broker-url"


def _url_error_line(exc: Exception) -> str | None:
    connection = sys.modules.get("bso.wire.connection")
    if connection is not None and isinstance(exc, connection.InvalidBrokerUrl):
        return str(exc)
    sa_exc = sys.modules.get("sqlalchemy.exc")
    if sa_exc is not None and isinstance(exc, sa_exc.ArgumentError):
        return (
            f"not a database URL bso can use ({_first_line(exc)}); give --database-url as "
            "sqlite:///path/to/bso.sqlite3, postgresql://[user:password@]host:5432/database "
            "or mysql://[user:password@]host:3306/database"
        )
    return None


def _database_error_line(exc: Exception) -> str | None:
    engine = sys.modules.get("bso.storage.sql.engine")
    if engine is not None and isinstance(exc, engine.SchemaTooNewError | engine.NoSqliteFileError):
        return _first_line(exc)
    if engine is not None and isinstance(exc, engine.SchemaNotCurrentError):
        return (
            f"{_first_line(exc).split(';')[0]}; apply the migrations first: "
            f"bso migrate --database-url {exc.url or 'URL'}"
        )
    sa_exc = sys.modules.get("sqlalchemy.exc")
    if sa_exc is None or not isinstance(exc, sa_exc.OperationalError | sa_exc.InterfaceError):
        return None
    cause = exc.orig if exc.orig is not None else exc
    if type(cause).__module__.startswith("sqlite3"):
        fix = "check --database-url: the SQLite file's folder must exist and be writable"
    else:
        fix = "start the database server, or check --database-url (host, port, user, password)"
    return f"cannot use the database: {_first_line(cause)}; {fix}"


def _redis_error_line(exc: Exception) -> str | None:
    redis = sys.modules.get("redis")
    if redis is None or not isinstance(exc, redis.RedisError):
        return None
    if isinstance(exc, redis.AuthenticationError | redis.exceptions.AuthorizationError):
        return f"Redis refused the credentials ({exc}); check the user and password of --broker-url"
    if isinstance(exc, redis.exceptions.NoPermissionError):
        return (
            f"Redis denied a command to this user ({exc}); use the workers' URL "
            "(BSO_WORKER_BROKER_URL in the data dir's credentials.env)"
        )
    if isinstance(exc, redis.ConnectionError | redis.TimeoutError):
        return f"cannot reach Redis ({exc}); is the service running? `bso up` starts one"
    return None


_PATH_FIXES = {
    errno.ENOENT: "create the folder first, or give a path in one that exists",
    errno.EACCES: "give a path you may write to, or change its permissions",
    errno.EPERM: "give a path you may write to, or change its permissions",
    errno.ENOTDIR: "a file is in the way where a folder should be: give another path",
    errno.EEXIST: "a file is in the way where a folder should be: give another path",
    errno.EISDIR: "that is a folder: give a file's path",
    errno.EROFS: "that file system is read-only: give a path on another one",
    errno.ENOSPC: "the disk is full: free some space or give a path on another disk",
}


def _path_error_line(exc: OSError) -> str | None:
    fix = _PATH_FIXES.get(exc.errno or 0)
    if fix is None or exc.filename is None:
        return None
    return f"{exc.strerror}: {Path(os.fsdecode(exc.filename))}; {fix}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    line = text.splitlines()[0] if text else ""
    return re.sub(r"^\([\w.]+\) ", "", line)  # SQLAlchemy's "(sqlite3.OperationalError) "
