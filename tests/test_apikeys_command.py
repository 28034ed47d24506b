"""`bso keys` and the key `bso up` keeps in its data dir."""

from __future__ import annotations

import re
import stat
from pathlib import Path

import pytest

from bso.cli import main
from bso.service import BsoService
from bso.storage.sql import SqlStore
from bso_workers.apikeys_command import API_KEY_FILE, database_url_of, ensure_data_dir_key


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
        assert main(["keys", "--data-dir", str(data_dir), "revoke", key_id]) == 1
        assert "revoked" in capsys.readouterr().out
        assert [r.revoked_at is not None for r in store.api_keys()] == [True]
    finally:
        store.close()


def test_bad_tenant_names_are_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        main(["keys", "--data-dir", str(tmp_path), "create", "--tenant", "no spaces"])


def test_the_data_dir_key_is_kept_private_reused_and_replaced_when_revoked(
    tmp_path: Path,
) -> None:
    url = database_url_of(tmp_path)
    main(["migrate", "--database-url", url])
    first = ensure_data_dir_key(tmp_path, url)
    saved = tmp_path / API_KEY_FILE
    assert saved.read_text().strip() == first
    assert stat.S_IMODE(saved.stat().st_mode) == 0o600
    assert ensure_data_dir_key(tmp_path, url) == first  # a restart keeps it
    store = SqlStore(url)
    try:
        store.revoke_api_key(first[4:16], store.api_keys()[0].created_at)
    finally:
        store.close()
    second = ensure_data_dir_key(tmp_path, url)
    assert second != first
    assert saved.read_text().strip() == second
