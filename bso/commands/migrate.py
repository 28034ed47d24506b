"""``bso migrate``: apply the Alembic migrations.

Deployments run it once before the workers start; ``bso up`` runs it itself.
The database is the one ``bso up`` uses, by the same rule
(:func:`bso_workers.tenant_keys.database_url_of`): ``--database-url``, else
``$BSO_DATABASE_URL``, else the database recorded in ``--data-dir``'s
``credentials.env``, else the SQLite file in ``--data-dir``: one rule, so
that the database ``bso migrate`` prepares is the one ``bso up`` then serves.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bso.commands.failures import UserError
from bso.storage.sql.engine import upgrade
from bso.wire.urls import redact_url
from bso_workers.stack import DEFAULT_DATA_DIR
from bso_workers.tenant_keys import DATABASE_URL_ENV, database_url_of


def configure_parser(parser: argparse.ArgumentParser) -> None:
    add_database_arguments(parser)


def add_database_arguments(parser: argparse.ArgumentParser) -> None:
    """``--data-dir`` and ``--database-url``, as ``bso migrate`` and ``bso keys`` take them."""
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=DEFAULT_DATA_DIR,
        help="bso up's data dir, whose SQLite file is the database when no URL is given "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--database-url",
        help=f"SQLAlchemy URL (default: ${DATABASE_URL_ENV}, else the database bso up "
        "serves from --data-dir (its credentials.env), else the SQLite file there)",
    )


def database_url(args: argparse.Namespace, *, create: bool = True) -> str:
    """The database ``args`` name, by ``bso up``'s rule; a data dir that cannot be
    made is a :class:`~bso.commands.failures.UserError` naming the option.  Not
    ``create``: a data dir with no database (no service ever ran there) is one too."""
    try:
        return database_url_of(args.data_dir, args.database_url, create=create)
    except FileNotFoundError:
        default = ", the default data dir" if Path(args.data_dir) == DEFAULT_DATA_DIR else ""
        raise UserError(
            f"no bso database in {args.data_dir} (no credentials.env, no bso.sqlite3){default}: "
            "run it where `bso up` ran, or name the service's --data-dir or --database-url "
            "(or set BSO_DATABASE_URL)"
        ) from None
    except OSError as exc:
        raise UserError(
            f"cannot use --data-dir {args.data_dir}: {exc.strerror}; give a folder you can "
            "write to, or --database-url"
        ) from exc


def run(args: argparse.Namespace) -> int:
    url = database_url(args)
    upgrade(url)
    print(f"database at the latest schema: {redact_url(url)}")
    return 0
