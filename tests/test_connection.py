"""redact_url: no password of a broker or database URL reaches a message or a log; and
what a refused URL is told to look like."""

from __future__ import annotations

import pytest
import redis

from bso.wire.connection import broker_error, redact_url


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://h:1/0?password=s3cret", "redis://h:1/0?password=***"),
        ("redis://h/0?db=1&Password=s3cret&ssl=true", "redis://h/0?db=1&Password=***&ssl=true"),
        ("rediss://:s3cret@h:1/0?password=s3cret", "rediss://:***@h:1/0?password=***"),
        (
            "postgresql+psycopg://u@h/db?sslpassword=s3cret&application_name=bso",
            "postgresql+psycopg://u@h/db?sslpassword=***&application_name=bso",
        ),
        ("redis://h/0?pass%77ord=s3cret", "redis://h/0?pass%77ord=***"),
        ("redis://h/0?api_key=s3cret&token=s3cret", "redis://h/0?api_key=***&token=***"),
        ("redis://u:s3@cret@h/0", "redis://u:***@h/0"),
    ],
)
def test_passwords_in_user_info_and_query_are_redacted(url: str, shown: str) -> None:
    assert redact_url(url) == shown
    assert "s3" not in redact_url(url)


@pytest.mark.parametrize(
    "url", ["redis://h:1/0", "redis://h/0?db=1&socket_timeout=5", "sqlite:////tmp/bso.db"]
)
def test_urls_without_secrets_are_kept_as_written(url: str) -> None:
    assert redact_url(url) == url


def test_a_url_that_does_not_parse_is_not_shown() -> None:
    assert "s3cret" not in redact_url("redis://:s3cret@[::1/0")


def test_a_url_without_credentials_is_shown_the_url_credentials_env_holds() -> None:
    """The examples' old ``--broker-url redis://127.0.0.1:6379/0`` against ``bso up``: the
    line named ``redis://bso-client:...``, a user that is not the one in credentials.env's
    BSO_BROKER_URL (the default tenant's own, ``bso-tenant-default``)."""
    refused = broker_error("redis://127.0.0.1:6379/0", redis.AuthenticationError("NOAUTH"))
    message = str(refused)
    assert "BSO_BROKER_URL from bso up's credentials.env" in message
    assert "redis://bso-tenant-default:...@host:port/0" in message
    assert "bso-client:" not in message
    assert "team file" in message  # a team's URL is its own
