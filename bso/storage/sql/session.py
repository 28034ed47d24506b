"""One pooled DBAPI connection inside one transaction: where the units of work run.

The per-event units of work bypass SQLAlchemy's ``Connection.execute`` (see
:mod:`bso.storage.sql.statements` for why) but keep what it guarantees: driver
errors still come out as SQLAlchemy's exceptions and lost connections are still
invalidated.  Engine events and ``echo`` logging see only the schema check and
the maintenance statements.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Dialect, Engine, exc
from sqlalchemy.engine.interfaces import DBAPICursor, DBAPIModule
from sqlalchemy.pool import PoolProxiedConnection


class DbapiSession:
    """One pooled DBAPI connection inside one database transaction.

    Driver errors are raised as SQLAlchemy's exceptions (the workers retry on
    ``sqlalchemy.exc.OperationalError``), and a connection the dialect reports
    as lost is invalidated so that the pool never hands it out again.
    """

    def __init__(self, dialect: Dialect, pooled: PoolProxiedConnection) -> None:
        self.dialect = dialect
        self.pooled = pooled
        self.dbapi = pooled.dbapi_connection
        assert self.dbapi is not None  # a connection fresh from the pool is open
        self.cursor: DBAPICursor = self.dbapi.cursor()

    def execute(self, statement: str, params: Mapping[str, Any] | None = None) -> DBAPICursor:
        try:
            if params is None:
                self.cursor.execute(statement)
            else:
                self.cursor.execute(statement, params)
        except self.dialect.loaded_dbapi.Error as error:
            raise self._translated(error, statement, params) from error
        return self.cursor

    def one(self, statement: str, params: Mapping[str, Any]) -> Any:
        """The first row as a tuple, or None."""
        return self.execute(statement, params).fetchone()

    def commit(self) -> None:
        assert self.dbapi is not None
        try:
            self.dbapi.commit()
        except self.dialect.loaded_dbapi.Error as error:
            raise self._translated(error, "COMMIT", None) from error

    def rollback(self) -> None:
        """Roll back; a connection that cannot even do that is discarded."""
        if not self.pooled.is_valid:
            return
        assert self.dbapi is not None
        try:
            self.dbapi.rollback()
        except self.dialect.loaded_dbapi.Error as error:
            self.pooled.invalidate(error)

    def close(self) -> None:
        """Return the connection to the pool (which drops an invalidated one)."""
        if self.pooled.is_valid:
            self.cursor.close()
        self.pooled.close()

    def _translated(
        self, error: DBAPIModule.Error, statement: str, params: Mapping[str, Any] | None
    ) -> BaseException:
        lost = self.dialect.is_disconnect(error, self.dbapi, self.cursor)
        if lost:
            self.pooled.invalidate(error)
        wrapped = exc.DBAPIError.instance(
            statement,
            dict(params) if params is not None else None,
            error,
            self.dialect.loaded_dbapi.Error,
            connection_invalidated=lost,
            dialect=self.dialect,
        )
        assert isinstance(wrapped, BaseException)  # only DontWrapMixin errors are not
        return wrapped


@contextmanager
def open_session(engine: Engine, begin: str | None) -> Iterator[DbapiSession]:
    """A pooled connection in a transaction begun with ``begin`` (None: the driver's
    implicit BEGIN): committed on normal exit, else rolled back."""
    session = DbapiSession(engine.dialect, engine.raw_connection())
    try:
        if begin is not None:
            session.execute(begin)
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()
