"""API keys: shape, hashing, checks and redaction (bso.apikeys)."""

from __future__ import annotations

import hashlib
import re
from dataclasses import replace
from datetime import UTC, datetime

import pytest

from bso.apikeys import (
    MAX_KEY_LENGTH,
    check_secret,
    key_id_of,
    new_api_key,
    redact_key_bytes,
    redact_keys,
)
from bso.errors import Unauthorized

T0 = datetime(2026, 11, 24, tzinfo=UTC)


def test_a_new_key_is_random_and_only_its_hash_is_kept() -> None:
    key, record = new_api_key("team-a", T0)
    other, _ = new_api_key("team-a", T0)
    assert key != other
    assert len(key) == MAX_KEY_LENGTH
    assert re.fullmatch(r"bso_[0-9a-f]{12}_[A-Za-z0-9_-]{43}", key)
    key_id, secret = key_id_of(key)
    assert record.key_id == key_id
    assert record.tenant == "team-a"
    assert record.secret_sha256 == hashlib.sha256(secret.encode()).hexdigest()
    assert secret not in repr(record)


@pytest.mark.parametrize("tenant", ["", "-lead", "a b", "x" * 65, "é"])
def test_tenant_names_are_checked(tenant: str) -> None:
    with pytest.raises(ValueError, match="tenant"):
        new_api_key(tenant, T0)


def test_check_secret_accepts_only_the_right_unrevoked_key() -> None:
    key, record = new_api_key("team-a", T0)
    key_id, secret = key_id_of(key)
    assert check_secret(record, key_id, secret) == "team-a"
    with pytest.raises(Unauthorized, match="not valid"):
        check_secret(record, key_id, secret[:-1] + ("x" if secret[-1] != "x" else "y"))
    with pytest.raises(Unauthorized, match="not valid"):
        check_secret(None, key_id, secret)
    with pytest.raises(Unauthorized, match="revoked"):
        check_secret(replace(record, revoked_at=T0), key_id, secret)


@pytest.mark.parametrize("bad", [None, "", "bso_XYZ_abc", "Bearer abc", "bso_" + "a" * 60])
def test_malformed_keys_are_unauthorized_without_being_echoed(bad: str | None) -> None:
    with pytest.raises(Unauthorized) as caught:
        key_id_of(bad)
    if bad:
        assert bad not in caught.value.message


def test_redaction_blanks_every_secret_and_keeps_the_key_id() -> None:
    key, record = new_api_key("team-a", T0)
    _, secret = key_id_of(key)
    text = f'{{"bso_api_key": "{key}", "again": "{key}"}}'
    redacted = redact_keys(text)
    assert secret not in redacted
    assert redacted.count(f"bso_{record.key_id}_***") == 2
    assert secret.encode() not in redact_key_bytes(text.encode())
