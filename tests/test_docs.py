"""The docs name only files and commands that exist.

Every repository path in a code span of README.md and docs/*.md
(``bso/...``, ``client/...``, ``scripts/...``, ...; a ``bso_client/...`` or
``bso_workers/...`` path is looked up in its package folder), and every
``bso <command>`` they show, must be there: a newcomer who follows a doc must
never meet a file or a command that is not.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bso.cli import COMMANDS
from bso.spec import JobSpec
from bso_workers.credentials import ADMIN_RULES, ADMIN_USER, WORKER_RULES, WORKER_USER

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"), ROOT / "client" / "README.md"])
TOP_FOLDERS = ("bso", "client", "workers", "scripts", "tests", "docs", "examples", ".ci")
PACKAGE_FOLDERS = {"bso_client": "client", "bso_workers": "workers"}
SPAN = re.compile(r"`([^`\n]+)`")
PATH = re.compile(r"^\.?[\w.-]+(?:/[\w.*-]+)+/?$")
COMMAND = re.compile(r"^(?:\$ )?(?:\.venv/bin/)?bso ([a-z][a-z-]*)(?:\s|$)")


def code_spans(doc: Path, *, shell_only: bool = False) -> list[str]:
    """Inline code spans and the lines of fenced blocks (``text`` blocks are output;
    ``shell_only``: only blocks fenced as shell, where a line is a command)."""
    text = doc.read_text()
    spans = SPAN.findall(re.sub(r"```.*?```", "", text, flags=re.S))
    fence = r"```(?:sh|bash|shell|console)\n" if shell_only else r"```(?!text)[^\n]*\n"
    blocks = re.findall(fence + r"(.*?)```", text, flags=re.S)
    return spans + [line for block in blocks for line in block.splitlines()]


def repo_path(span: str) -> Path | None:
    """The file ``span`` names in this repository, or None if it names none."""
    candidate = span.split(maxsplit=1)[0].rstrip(".,:;)") if span.split() else ""
    if not PATH.match(candidate):
        return None
    first = candidate.split("/", 1)[0]
    if first in PACKAGE_FOLDERS:
        return ROOT / PACKAGE_FOLDERS[first] / candidate
    if first in TOP_FOLDERS:
        return ROOT / candidate
    return None


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_a_doc_names_exists(doc: Path) -> None:
    missing = []
    for span in code_spans(doc):
        path = repo_path(span)
        if path is None:
            continue
        found = any(path.parent.glob(path.name)) if "*" in path.name else path.exists()
        if not found:
            missing.append(str(path.relative_to(ROOT)))
    assert not missing, f"{doc.name} names files that do not exist: {sorted(set(missing))}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_bso_command_a_doc_shows_exists(doc: Path) -> None:
    names = {c.name for c in COMMANDS}
    shown = {m for span in code_spans(doc, shell_only=True) for m in COMMAND.findall(span.strip())}
    assert not shown - names, f"{doc.name} shows commands bso does not have: {shown - names}"


def test_every_job_spec_option_is_in_the_client_guide() -> None:
    """A user reads docs/client.md, not bso/spec.py: every JobSpec field appears there
    in a code span (``field``, ``field=...`` or ``field.part``)."""
    text = (ROOT / "docs" / "client.md").read_text()
    missing = [
        name
        for name in JobSpec.model_fields
        if not re.search(rf"`{re.escape(name)}(?:`|=|\.)", text)
    ]
    assert not missing, f"docs/client.md never names these JobSpec options: {missing}"


def test_every_epoch_loop_in_the_docs_stops_when_bso_says_so() -> None:
    """A snippet copied as is must run: an epoch loop that calls ``on_evaluate`` goes
    on after bso stopped the trial unless it breaks on ``training_finished``, and the
    next ``on_evaluate`` raises ``OperationOrderError`` (the growth snippet did)."""
    unchecked = [
        f"{doc.name} python block {index}"
        for doc in DOCS
        for index, block in enumerate(re.findall(r"```python\n(.*?)```", doc.read_text(), re.S))
        if "on_evaluate(" in block and "training_finished" not in block
    ]
    assert not unchecked, f"epoch loops that never check bso.training_finished: {unchecked}"


def test_the_client_guides_first_loop_exits_for_a_relaunch_when_bso_stops_it() -> None:
    """The loop a new user copies first: copied as it stood, a run bso stopped short of
    its target died of an uncaught TrainFailError (exit 1, a traceback), which a
    launcher takes for a crash (a new user's walkthrough, helper)."""
    first = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "client.md").read_text(), re.S)[0]
    assert "on_evaluate(" in first
    handler = re.search(r"^except TrainFailError\b.*\n((?:    .*\n)+)", first, re.M)
    assert handler is not None, first
    assert "sys.exit(EXIT_RELAUNCH)" in handler.group(1), handler.group(1)
    assert re.search(r"^from bso_client import .*\bEXIT_RELAUNCH\b", first, re.M), first


def test_the_acl_lines_for_your_own_redis_are_the_ones_bso_gives_its_users() -> None:
    """security.md's lines for an operator's own Redis are copied as they stand: a rule
    missing there (as ``+hset`` once was) fails a command only on that Redis."""
    text = (ROOT / "docs" / "security.md").read_text()
    block = text.split("### Your own Redis", 1)[1].split("```", 2)[1]
    lines = {line.split()[1]: line for line in block.splitlines() if line.startswith("user ")}
    for user, rules in ((WORKER_USER, WORKER_RULES), (ADMIN_USER, ADMIN_RULES)):
        password = f"{user.removeprefix('bso-').upper()}_PASSWORD"
        assert lines[user] == f"user {user} on >{password} {rules}"
    assert lines["default"] == "user default off"


def python(
    args: list[str], cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """This interpreter run on ``args`` as a user runs a pasted snippet, its output kept."""
    return subprocess.run(
        [sys.executable, *args], check=False, cwd=cwd, capture_output=True, text=True, env=env
    )


def test_the_readmes_python_example_runs_and_teaches_runs_that_converge(tmp_path: Path) -> None:
    """The README's in-process example, run as a user pastes it into an empty folder:
    it prints the recommendation it says, and it records no script error (it once
    ended each trial with ``end_trial``'s default reason, which is the script giving
    up, so its one run taught a newcomer to record a bug)."""
    text = (ROOT / "README.md").read_text()
    (block,) = re.findall(r"```python\n(from bso\.service import .*?)```", text, flags=re.S)
    shown = re.search(r"print\(.*\)  # (\d+) and its confidence", block)
    assert shown is not None, "the example says what it prints"
    outcomes = (  # what the example's database then says, printed on a line of its own
        "\nprint(*sorted({o for size in lane.sizes for o in size.outcomes}))\n"
    )
    (tmp_path / "example.py").write_text(block + outcomes)
    done = python(["example.py"], cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    printed, recorded = done.stdout.splitlines()
    recommended, confidence = printed.split()
    assert recommended == shown.group(1)
    assert 0 <= int(confidence) <= 100
    assert "script_error" not in recorded.split()
    assert "converged" in recorded.split()


def test_each_way_the_client_guide_gives_to_see_bsos_log_lines_shows_them() -> None:
    """Each alternative of "Seeing bso's log lines" (split at its ``# or`` comments,
    the block's imports before each), pasted alone into a script that configures no
    logging, shows an INFO line of ``bso_client``: the second once only set the level,
    and Python's last-resort handler prints nothing below WARNING."""
    text = (ROOT / "docs" / "client.md").read_text()
    section = text.split("## Seeing bso's log lines", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    first, *others = re.split(r"^# or\b.*\n", block, flags=re.M)
    imports = "".join(line + "\n" for line in first.splitlines() if line.startswith("import "))
    assert others, "the section offers a way that leaves the program's logging alone"
    for way in (first, *(imports + other for other in others)):
        probe = way + "\nlogging.getLogger('bso_client.optimizer').info('bso-probe-line')\n"
        done = python(["-c", probe])
        assert done.returncode == 0, done.stderr
        assert "bso-probe-line" in done.stderr, f"shows no INFO line:\n{way}"


def test_the_client_readme_says_how_to_install_it_while_it_is_on_no_index() -> None:
    """client/README.md (the distribution's own page) showed only ``pip install
    bso-batch-optimizer-client``, which fails while the README says neither
    distribution is published: it must give the checkout's way too."""
    unpublished = "Neither is\npublished on an index yet" in (ROOT / "README.md").read_text()
    client_readme = (ROOT / "client" / "README.md").read_text()
    assert not unpublished or "pip install ./client" in client_readme
