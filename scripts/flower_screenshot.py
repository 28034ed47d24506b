"""Flower as an operator sees it after a job: headless Chromium screenshots to look at.

    .venv/bin/python scripts/flower_screenshot.py --out flower-shots

Starts ``bso up`` in a scratch data dir (free ports, Flower on), runs one small
job through it with the client (register, a trial, two epoch reports), then
takes two screenshots with the login from ``credentials.env``: Flower's task
list (``tasks.png``, each task's result in its Result column, the job first, the
rest of the line scrolled in the cell) and the detail page of the job's ``bso.next_trial`` task
(``next_trial.png``, whose Result row reads ``trial job=... trial=1 bs=16``).
Stops the stack with Ctrl-C's signal and prints the files written.

Needs ``chromium`` on the PATH (Debian: ``apt-get install chromium``).
"""

from __future__ import annotations

import argparse
import base64
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bso.spec import JobSpec
from bso_client.transport import ServiceClient
from bso_workers.credentials import read_env_file

JOB = "flower-screenshot"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n", 1)[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--out", type=Path, default=Path("flower-shots"), help="folder for PNGs")
    parser.add_argument("--chromium", default="chromium", help="the browser to run headless")
    return parser.parse_args(argv)


def wait_for_line(popen: subprocess.Popen[str], needle: str, timeout_s: float = 120) -> str:
    """The first line of ``popen``'s output that contains ``needle``."""
    assert popen.stdout is not None
    deadline = time.monotonic() + timeout_s
    for line in popen.stdout:
        if needle in line:
            return line
        if time.monotonic() > deadline:
            break
    raise SystemExit(f"flower_screenshot: bso up never printed {needle!r}")


def flower_tasks(flower: str, login: str) -> dict[str, Any]:
    auth = base64.b64encode(login.encode()).decode()
    request = urllib.request.Request(
        f"{flower}/api/tasks", headers={"Authorization": f"Basic {auth}"}
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        tasks: dict[str, Any] = json.load(response)
    return tasks


def screenshot(chromium: str, url: str, path: Path) -> None:
    subprocess.run(
        [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            "--window-size=1400,900",
            "--virtual-time-budget=5000",
            f"--screenshot={path}",
            url,
        ],
        capture_output=True,
        timeout=120,
        check=True,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if shutil.which(args.chromium) is None:
        print(f"flower_screenshot: {args.chromium} not found; apt-get install chromium")
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        data = Path(scratch) / "data"
        up = [sys.executable, "-m", "bso.cli", "up", "--data-dir", str(data), "--redis-port", "0"]
        popen = subprocess.Popen([*up, "--flower-port", "0"], stdout=subprocess.PIPE, text=True)
        try:
            flower = wait_for_line(popen, "flower ").split()[1]
            wait_for_line(popen, "Ctrl-C stops everything")
            credentials = read_env_file(data / "credentials.env")
            spec = JobSpec(job_id=JOB, batch_sizes=[8, 16], default_batch_size=16, target_metric=1)
            with ServiceClient.connect(
                credentials["BSO_BROKER_URL"], api_key=credentials["BSO_API_KEY"], timeout_s=30
            ) as client:
                client.register(spec)
                trial = client.next_trial(JOB)
                for epoch in (1, 2):
                    client.report_epoch(
                        JOB,
                        trial.trial_number,
                        epoch=epoch,
                        time_s=epoch,
                        energy_j=9.0 * epoch,
                        metric=0.3 * epoch,
                    )
            time.sleep(2)  # Flower hears the workers' event batches about once a second
            login = credentials["FLOWER_BASIC_AUTH"]
            tasks = flower_tasks(flower, login)
            uuid = next(u for u, t in tasks.items() if t["name"] == "bso.next_trial")
            host = flower.removeprefix("http://")
            written = [args.out / "tasks.png", args.out / "next_trial.png"]
            screenshot(args.chromium, f"http://{login}@{host}/tasks", written[0])
            screenshot(args.chromium, f"http://{login}@{host}/task/{uuid}", written[1])
        finally:
            popen.send_signal(signal.SIGINT)
            popen.wait(60)
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
