"""``bso migrate``, ``bso up`` and ``bso keys`` use one database unless told otherwise.

They used to differ: ``bso migrate`` defaulted to ``bso.sqlite3`` in the working
directory and ``bso up`` to the one in its data dir, so a user who migrated and
then started the service served a database nobody had migrated.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import pytest

from bso.cli import main, parser_for
from bso.commands import migrate
from bso.commands.up import stack_config
from bso.storage.sql import SqlStore
from bso_workers.credentials import load_or_create, save
from bso_workers.tenant_keys import DATABASE_URL_ENV, database_url_of


def parsed(argv: list[str]) -> argparse.Namespace:
    return parser_for(argv).parse_args(argv)


def url_of_up(options: list[str]) -> str:
    """The database ``bso up OPTIONS`` serves: what ``Stack.start`` computes."""
    config = stack_config(parsed(["up", *options]), flower=False, redis_port=0, flower_port=0)
    return database_url_of(config.data_dir.resolve(), config.database_url)


def url_of_migrate(options: list[str]) -> str:
    return migrate.database_url(parsed(["migrate", *options]))


def url_of_keys(options: list[str]) -> str:
    # keys.run resolves its database with migrate.database_url too; parse keys' own options.
    return migrate.database_url(parsed(["keys", *options, "list"]))


@pytest.fixture(autouse=True)
def in_a_fresh_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(DATABASE_URL_ENV, raising=False)


@pytest.mark.parametrize("options", [[], ["--data-dir", "elsewhere"]], ids=["default", "data-dir"])
def test_migrate_up_and_keys_default_to_the_same_database(
    options: list[str], tmp_path: Path
) -> None:
    folder = options[1] if options else ".bso"
    expected = f"sqlite:///{tmp_path / folder / 'bso.sqlite3'}"
    assert url_of_migrate(options) == url_of_up(options) == url_of_keys(options) == expected


def test_all_three_follow_the_environment_then_the_option(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from_env = f"sqlite:///{tmp_path / 'from-env.sqlite3'}"
    monkeypatch.setenv(DATABASE_URL_ENV, from_env)
    assert url_of_migrate([]) == url_of_up([]) == url_of_keys([]) == from_env
    given = ["--database-url", f"sqlite:///{tmp_path / 'given.sqlite3'}"]
    assert url_of_migrate(given) == url_of_up(given) == url_of_keys(given) == given[1]


def test_bso_migrate_prepares_the_database_bso_up_serves(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["migrate"]) == 0
    url = url_of_up([])
    assert capsys.readouterr().out == f"database at the latest schema: {url}\n"
    SqlStore(url).close()  # refuses a database that is not at the current schema


def test_commands_find_the_database_a_bso_up_of_the_data_dir_served(tmp_path: Path) -> None:
    """A ``bso up --database-url X`` records X in its credentials.env: ``bso keys``
    beside it, given only the data dir, writes there, not into a SQLite file of its own."""
    served = f"sqlite:///{tmp_path / 'served.sqlite3'}"
    config = stack_config(
        parsed(["up", "--data-dir", "data", "--database-url", served]),
        flower=False,
        redis_port=0,
        flower_port=0,
    )
    config.data_dir.mkdir()
    credentials = replace(
        load_or_create(config.data_dir), api_key="bso_" + "0" * 12 + "_" + "a" * 43
    )
    save(config.data_dir, credentials, "127.0.0.1", 6390, served)
    assert url_of_migrate(["--data-dir", "data"]) == url_of_keys(["--data-dir", "data"]) == served
    assert url_of_up(["--data-dir", "data"]) == served
    assert not (tmp_path / "data" / "bso.sqlite3").exists()
