"""Shared fixtures live in tests/fixtures/; each module is registered here."""

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest_plugins: list[str] = [
    "tests.fixtures.postgres",
    "tests.fixtures.mariadb",
    "tests.fixtures.redis_server",
    "tests.fixtures.celery_workers",
    "tests.fixtures.reply_backends",
    "tests.fixtures.trainer_runs",
]


@pytest.fixture(autouse=True)
def _private_bso_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Each test gets its own client cache dir (``BSO_CACHE_DIR``): the detached-run
    journals and the last recommendations a fail-open optimizer keeps
    (:mod:`bso_client.fail_open`) never leak between tests or into ``~/.cache``."""
    path = tmp_path_factory.mktemp("bso-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("BSO_CACHE_DIR", str(path))
        yield path
