"""Shared fixtures live in tests/fixtures/; each module is registered here."""

pytest_plugins: list[str] = [
    "tests.fixtures.postgres",
    "tests.fixtures.redis_server",
    "tests.fixtures.celery_workers",
    "tests.fixtures.reply_backends",
]
