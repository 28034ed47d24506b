"""Size and import time of the training-side install, at two commits.

For each commit: a fresh venv with ``pip install '<checkout>[client]'`` (bso,
its client extra and their dependencies, no editable install), the size of its
``site-packages`` (``du``), and the median over fresh interpreters of the time
``import bso_client`` takes and of the time ``from bso_client import
BatchSizeOptimizer`` takes (the optimizer, its transport, redis-py and the wire).

    .venv/bin/python scripts/measure_client.py 219ef2e HEAD
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROBES = {
    "import bso_client": "import bso_client",
    "from bso_client import BatchSizeOptimizer": "from bso_client import BatchSizeOptimizer",
}
TIMER = "import time; t = time.perf_counter(); {probe}; print(time.perf_counter() - t)"


def checkout(rev: str, into: Path) -> Path:
    """A clean copy of ``rev``'s tree (``git archive``), so nothing local leaks in."""
    into.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev], capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def install(source: Path, venv: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", f"{source}[client]"],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return python


def site_packages_mb(venv: Path) -> float:
    (site,) = venv.glob("lib/python*/site-packages")
    out = subprocess.run(["du", "-sk", str(site)], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[0]) / 1024


def import_seconds(python: Path, probe: str, cwd: Path) -> float:
    done = subprocess.run(
        [str(python), "-c", TIMER.format(probe=probe)],
        capture_output=True,
        text=True,
        check=True,
        cwd=cwd,
    )
    return float(done.stdout.strip())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("revs", nargs="+", help="commits to measure, e.g. 219ef2e HEAD")
    parser.add_argument("--runs", type=int, default=21, help="interpreters per import timing")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        pythons, sizes = {}, {}
        for rev in args.revs:
            source = checkout(rev, Path(work) / rev / "src")
            venv = Path(work) / rev / "venv"
            pythons[rev] = install(source, venv)
            sizes[rev] = site_packages_mb(venv)
        # Timed from an empty folder (so no checkout is importable by accident), the
        # commits interleaved run by run, so that a busy moment hits them alike.
        empty = Path(work) / "empty"
        empty.mkdir()
        times: dict[tuple[str, str], list[float]] = {}
        for _ in range(args.runs):
            for rev, python in pythons.items():
                for name, probe in PROBES.items():
                    times.setdefault((rev, name), []).append(import_seconds(python, probe, empty))
    print(f"{'commit':<10} {'site-packages MB':>16} " + " ".join(f"{p!r:>44}" for p in PROBES))
    for rev in args.revs:
        cells = [f"{statistics.median(times[rev, name]) * 1000:>41.0f} ms" for name in PROBES]
        print(f"{rev:<10} {sizes[rev]:>16.1f} " + " ".join(cells))
    print(f"(median of {args.runs} fresh interpreters per cell)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
