"""`bso keys` and the key `bso up` keeps in its data dir."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest

from bso.cli import main
from bso.service import BsoService
from bso.storage.sql import SqlStore
from bso_workers.credentials import Credentials
from bso_workers.tenant_keys import database_url_of, ensure_api_key


def test_create_list_revoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data_dir = tmp_path / "data"
    assert main(["keys", "--data-dir", str(data_dir), "create", "--tenant", "team-a"]) == 0
    key = re.search(r"bso_\S+", capsys.readouterr().out)
    assert key is not None
    url = database_url_of(data_dir)
    store = SqlStore(url)
    try:
        assert BsoService(store).authenticate(key.group(0)) == "team-a"
        key_id = key.group(0)[4:16]
        assert main(["keys", "--data-dir", str(data_dir), "list"]) == 0
        listed = capsys.readouterr().out
        assert key_id in listed
        assert "active" in listed
        assert key.group(0)[17:] not in listed  # only the key id is ever shown again
        assert main(["keys", "--data-dir", str(data_dir), "revoke", key_id]) == 0
        assert main(["keys", "--data-dir", str(data_dir), "revoke", key_id]) == 2
        captured = capsys.readouterr()
        assert "revoked" in captured.out
        assert f"API key '{key_id}' was already revoked in" in captured.err
        assert "bso keys list" in captured.err
        assert main(["keys", "--data-dir", str(data_dir), "revoke", "0123456789ab"]) == 2
        assert "API key '0123456789ab' is not in" in capsys.readouterr().err
        assert [r.revoked_at is not None for r in store.api_keys()] == [True]
    finally:
        store.close()


def test_bad_tenant_names_are_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        main(["keys", "--data-dir", str(tmp_path), "create", "--tenant", "no spaces"])


def test_the_stack_key_is_reused_and_replaced_when_revoked(tmp_path: Path) -> None:
    url = database_url_of(tmp_path)
    main(["migrate", "--database-url", url])
    credentials = Credentials.generate()
    first = ensure_api_key(url, credentials)
    kept = replace(credentials, api_key=first)
    assert ensure_api_key(url, kept) == first  # a restart keeps it
    store = SqlStore(url)
    try:
        store.revoke_api_key(first[4:16], store.api_keys()[0].created_at)
    finally:
        store.close()
    assert ensure_api_key(url, kept) not in (first, "")
