"""Alembic environment of the bso SQL store.

:func:`bso.storage.sql.engine.upgrade` hands over a connection with a transaction
already open in ``config.attributes["connection"]``, so that the upgrade runs
under its lock and commits as a whole.  The ``alembic`` command line instead
names the database with ``-x url=...`` (see alembic.ini); ``--sql`` prints the
DDL for a database administrator to apply.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy.engine import Connection

from bso.storage.schema import metadata
from bso.storage.sql.engine import make_engine

config = context.config


def database_url() -> str:
    url = context.get_x_argument(as_dictionary=True).get("url")
    if not url:
        raise SystemExit("name the database: alembic -c <alembic.ini> -x url=<SQLAlchemy URL> ...")
    return url


def run_migrations(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=metadata,
        # SQLite can alter little in place; batch mode rebuilds tables instead.
        render_as_batch=connection.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        context.run_migrations()


def main() -> None:
    given: Connection | None = config.attributes.get("connection")
    if given is not None:
        run_migrations(given)
    elif context.is_offline_mode():
        context.configure(url=database_url(), target_metadata=metadata, literal_binds=True)
        with context.begin_transaction():
            context.run_migrations()
    else:
        engine = make_engine(database_url())
        try:
            with engine.begin() as connection:
                run_migrations(connection)
        finally:
            engine.dispose()


main()
