"""What `docker build .` sends as its context, with .dockerignore applied, without Docker.

    .venv/bin/python scripts/build_context.py            # files, bytes, tar size
    .venv/bin/python scripts/build_context.py --no-ignore   # as if there were no .dockerignore
    .venv/bin/python scripts/build_context.py --list     # every file that would be sent

The patterns follow Docker's rules (moby's ``patternmatcher``, which BuildKit
uses): ``#`` comments, blank lines skipped, each pattern cleaned like a path and
made relative; ``*`` and ``?`` never cross a ``/``, ``**`` crosses any number of
directories; a pattern that matches a directory matches everything under it;
later lines win, ``!`` re-includes.  The tar size counts what the context's tar
stream holds: a 512-byte header per file and directory, each file padded to 512
bytes.  tests/test_compose.py uses :func:`context_files` to check that the
context holds what the Dockerfile copies and never a secret or a virtualenv.
"""

from __future__ import annotations

import argparse
import os
import posixpath
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BLOCK = 512


@dataclass(frozen=True)
class Pattern:
    text: str
    exclusion: bool  # a "!" line: re-includes what it matches
    regex: re.Pattern[str]

    def match(self, path: str) -> bool:
        return self.regex.match(path) is not None


def _regex(pattern: str) -> re.Pattern[str]:
    """moby patternmatcher's translation of one cleaned pattern."""
    out = "^"
    i = 0
    while i < len(pattern):
        ch = pattern[i]
        i += 1
        if ch == "*":
            if i < len(pattern) and pattern[i] == "*":
                i += 1
                if i < len(pattern) and pattern[i] == "/":
                    i += 1
                out += ".*" if i == len(pattern) else "(.*/)?"
            else:
                out += "[^/]*"
        elif ch == "?":
            out += "[^/]"
        elif ch == "[":
            end = pattern.find("]", i)
            if end < 0:
                out += re.escape(ch)
                continue
            body = pattern[i:end]
            i = end + 1
            if body.startswith("!"):
                body = "^" + body[1:]
            out += f"[{body}]"
        elif ch == "\\" and i < len(pattern):
            out += re.escape(pattern[i])
            i += 1
        else:
            out += re.escape(ch)
    return re.compile(out + "$")


def read_patterns(text: str) -> list[Pattern]:
    """The patterns of a .dockerignore file, as moby's ``dockerignore.ReadAll`` reads them."""
    patterns = []
    for raw in text.splitlines():
        if raw.startswith("#"):
            continue
        line = raw.strip()
        if not line:
            continue
        exclusion = line.startswith("!")
        if exclusion:
            line = line[1:].strip()
        if line:
            line = posixpath.normpath(line)
            if len(line) > 1 and line.startswith("/"):
                line = line[1:]
        patterns.append(Pattern(line, exclusion, _regex(line)))
    return patterns


def ignored(path: str, patterns: list[Pattern]) -> bool:
    """moby's ``MatchesOrParentMatches``: whether ``path`` (relative, with /) is left out."""
    parents = path.split("/")[:-1]
    matched = False
    for pattern in patterns:
        # An exclusion only matters for a path matched so far, an inclusion only for one not.
        if pattern.exclusion != matched:
            continue
        hit = pattern.match(path) or any(
            pattern.match("/".join(parents[: i + 1])) for i in range(len(parents))
        )
        if hit:
            matched = not pattern.exclusion
    return matched


def context_files(root: Path, dockerignore: str | None) -> list[str]:
    """The files (relative, with /) the context of ``root`` holds: every file, symlink
    included, that ``dockerignore``'s patterns (None: no .dockerignore) do not leave out."""
    patterns = read_patterns(dockerignore) if dockerignore is not None else []
    kept = []
    for directory, dirs, files in os.walk(root):
        rel_dir = os.path.relpath(directory, root)
        for name in files + [d for d in dirs if os.path.islink(os.path.join(directory, d))]:
            rel = name if rel_dir == "." else f"{rel_dir}/{name}".replace(os.sep, "/")
            if not ignored(rel, patterns):
                kept.append(rel)
        dirs.sort()
    return sorted(kept)


def tar_bytes(root: Path, files: list[str]) -> int:
    """Size of the context's tar stream: headers for files and their directories, data
    padded to the block size, two end blocks."""
    directories = {posixpath.dirname(f) for f in files} - {""}
    for directory in list(directories):
        parent = directory
        while parent:
            directories.add(parent)
            parent = posixpath.dirname(parent)
    total = BLOCK * (len(files) + len(directories) + 2)
    for f in files:
        path = root / f
        size = 0 if path.is_symlink() else path.stat().st_size
        total += -(-size // BLOCK) * BLOCK
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=ROOT)
    parser.add_argument("--no-ignore", action="store_true", help="as if no .dockerignore")
    parser.add_argument("--list", action="store_true", help="print every file of the context")
    args = parser.parse_args(argv)
    ignore_file = args.root / ".dockerignore"
    text = None if args.no_ignore or not ignore_file.exists() else ignore_file.read_text()
    files = context_files(args.root, text)
    if args.list:
        print("\n".join(files))
    data = sum(0 if (args.root / f).is_symlink() else (args.root / f).stat().st_size for f in files)
    stream = tar_bytes(args.root, files)
    applied = "no .dockerignore" if text is None else ".dockerignore applied"
    print(f"{len(files)} files, {data / 1e6:.1f} MB of data, ", end="")
    print(f"tar stream {stream / 1e6:.1f} MB ({applied})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
