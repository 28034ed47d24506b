"""``bso up`` and ``bso demo`` as a user runs them: real subprocesses, real signals.

The stack must come up on free ports, answer on Flower's HTTP API and through
the transport, drive the demo, and leave no process behind on Ctrl-C.
"""

from __future__ import annotations

import base64
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from bso.commands.up import port_in_use
from bso.spec import JobSpec
from bso_client.transport import ServiceClient
from bso_workers.credentials import read_env_file
from bso_workers.supervision import free_port

pytestmark = pytest.mark.integration

READY_TIMEOUT_S = 120


def bso(*args: str) -> list[str]:
    return [sys.executable, "-m", "bso.cli", *args]


@dataclass
class Running:
    """A ``bso`` subprocess whose output is collected line by line by a thread."""

    popen: subprocess.Popen[str]
    lines: queue.Queue[str] = field(default_factory=queue.Queue)
    seen: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            self.lines.put(line)

    def wait_for(self, pattern: str, timeout_s: float = READY_TIMEOUT_S) -> re.Match[str]:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self.lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                pytest.fail(f"no line matching {pattern!r}; output so far:\n{self.output()}")
            self.seen.append(line)
            if match := re.search(pattern, line):
                return match

    def output(self) -> str:
        return "".join(self.seen)

    def printed(self, pattern: str) -> re.Match[str]:
        """The first line already read that matches ``pattern``."""
        for line in self.seen:
            if match := re.search(pattern, line):
                return match
        pytest.fail(f"no line matching {pattern!r} printed; output so far:\n{self.output()}")

    def descendants(self) -> set[int]:
        """Every process below this one, from /proc."""
        found: set[int] = set()
        todo = [self.popen.pid]
        while todo:
            pid = todo.pop()
            for task in Path(f"/proc/{pid}/task").glob("*"):
                try:
                    children = {int(c) for c in (task / "children").read_text().split()}
                except OSError:
                    continue
                todo += sorted(children - found)
                found |= children
        return found


def start(args: list[str], cwd: Path) -> Running:
    popen = subprocess.Popen(
        args,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    return Running(popen)


def alive(pids: set[int]) -> set[int]:
    """The pids that still name a live (non-zombie) process."""
    living = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            living.add(pid)
    return living


def assert_all_gone(pids: set[int], output: str) -> None:
    deadline = time.monotonic() + 10
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(pids), f"left behind: {sorted(alive(pids))}\n{output}"


METRICS_PORT = free_port("127.0.0.1")
"""The metrics port the module's ``bso up`` is given: a scrape config names a fixed one."""


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Running, str, str]]:
    """``bso up`` on free ports; yields it with its broker and Flower URLs."""
    folder = tmp_path_factory.mktemp("up")
    ports = ["--redis-port", "0", "--flower-port", "0", "--metrics-port", str(METRICS_PORT)]
    running = start(bso("up", "--data-dir", str(folder / "data"), *ports), folder)
    try:
        broker = running.wait_for(r"broker/replies\s+(\S+)").group(1)
        flower = running.wait_for(r"flower\s+(http://\S+)").group(1)
        running.wait_for("Ctrl-C stops everything")
        yield running, broker, flower
    finally:
        if running.popen.poll() is None:
            running.popen.kill()  # only reached when the test failed before its SIGINT


def test_up_serves_flower_and_the_transport_then_stops_cleanly_on_ctrl_c(
    stack: tuple[Running, str, str],
) -> None:
    running, broker, flower = stack
    credentials = read_env_file(Path(running.printed(r"credentials\s+(\S+)").group(1)))
    # Log in as the banner tells a person to: its user, and the password it names.
    user, variable = running.printed(r"flower .*login (\S+), password (\S+) in the").groups()
    login = base64.b64encode(f"{user}:{credentials[variable]}".encode()).decode()
    workers_api = f"{flower}/api/workers?refresh=1"
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(workers_api, timeout=10)
    assert refused.value.code == 401
    deadline = time.monotonic() + 30
    while True:
        request = urllib.request.Request(workers_api, headers={"Authorization": f"Basic {login}"})
        with urllib.request.urlopen(request, timeout=10) as response:
            workers = json.load(response)
        if len(workers) == 2 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert sorted(name.split("@")[0] for name in workers) == ["worker1", "worker2"]
    metrics = running.printed(r"metrics\s+(http://\S+)").group(1)
    assert metrics == f"http://127.0.0.1:{METRICS_PORT}/metrics"  # --metrics-port, as given
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(metrics, timeout=10)
    assert refused.value.code == 401

    spec = JobSpec(job_id="up", batch_sizes=[8, 16], default_batch_size=16, target_metric=1)
    api_key = running.printed(r"api key\s+(\S+)").group(1)
    with ServiceClient.connect(broker, api_key=api_key, timeout_s=30) as client:
        assert client.register(spec).created
        assert client.next_trial("up").batch_size == 16

    demo = subprocess.run(
        bso(
            "demo", "--broker-url", broker, "--recurrences", "3", "--workload", "synthetic-language"
        ),
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "BSO_API_KEY": api_key},
        check=False,
    )
    assert demo.returncode == 0, demo.stdout + demo.stderr
    rows = [line for line in demo.stdout.splitlines() if re.match(r"\s+[123]\s+\d", line)]
    assert len(rows) == 3, demo.stdout
    assert "total cost" in demo.stdout

    children = running.descendants()
    assert len(children) >= 5  # redis, 2 solo worker nodes, beat, flower
    running.popen.send_signal(signal.SIGINT)
    assert running.popen.wait(60) == 0, running.output()
    running.wait_for("bso is down", timeout_s=5)
    assert_all_gone(children, running.output())


def test_demo_starts_and_stops_its_own_service(tmp_path: Path) -> None:
    running = start(
        bso(
            "demo",
            "--data-dir",
            str(tmp_path / "data"),
            "--recurrences",
            "2",
            "--workers",
            "1",
            "--pool",
            "prefork",
            "--concurrency",
            "2",
        ),
        tmp_path,
    )
    try:
        running.wait_for(r"^\s+rec\s+batch sizes tried")
        children = running.descendants()
        running.wait_for(r"^\s+2\s+\d")
        running.wait_for("service stopped")
        assert running.popen.wait(60) == 0, running.output()
    finally:
        if running.popen.poll() is None:
            running.popen.kill()
    assert len(children) >= 5  # redis, one worker node and its 2 prefork processes, beat
    assert_all_gone(children, running.output())


def test_the_demo_runs_all_its_recurrences_without_a_refusal_at_the_door(
    tmp_path: Path,
) -> None:
    """The README's first command, as a new user runs it: its simulated job reports
    hours of epochs in seconds, past a team's admission limits, and the service
    the demo starts for it lets it through (each refusal printed a line and made
    the job wait; from the ninth recurrence on, dozens of them)."""
    done = subprocess.run(
        bso("demo", "--data-dir", str(tmp_path / "data")),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        check=False,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert re.search(r"^\s+15\s+\d", done.stdout, re.M), output
    assert "refused at the door" not in output, output


def test_a_dead_worker_node_is_replaced_but_a_dead_redis_stops_everything(
    tmp_path: Path,
) -> None:
    running = start(
        bso(
            "up",
            "--data-dir",
            str(tmp_path / "data"),
            "--redis-port",
            "0",
            "--no-flower",
            "--workers",
            "1",
        ),
        tmp_path,
    )
    try:
        broker = running.wait_for(r"broker/replies\s+(\S+)").group(1)
        running.wait_for("Ctrl-C stops everything")
        launcher = running.popen.pid

        def child(is_it: Callable[[list[str]], bool]) -> int:
            """The launcher's direct child whose argv ``is_it`` accepts."""
            return next(
                pid
                for pid in running.descendants()
                if is_it(Path(f"/proc/{pid}/cmdline").read_text().split("\0"))
                and Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]
                == str(launcher)
            )

        def worker_node(argv: list[str]) -> bool:
            return "worker" in argv  # the celery subcommand (beat's argv has "bso_workers" too)

        def redis_server(argv: list[str]) -> bool:
            return "redis-server" in argv[0]  # Redis rewrites its title: "redis-server host:port"

        node = child(worker_node)
        os.kill(node, signal.SIGKILL)  # what the hard time limit or the OOM killer does
        running.wait_for(r"worker1 exited \(-9\); started it again")
        spec = JobSpec(job_id="after", batch_sizes=[8, 16], default_batch_size=16, target_metric=1)
        api_key = running.printed(r"api key\s+(\S+)").group(1)
        with ServiceClient.connect(broker, api_key=api_key, timeout_s=60) as client:
            assert client.register(spec).created  # served by the new node
        assert child(worker_node) != node

        children = running.descendants()
        os.kill(child(redis_server), signal.SIGKILL)
        assert running.popen.wait(60) == 1, running.output()
    finally:
        if running.popen.poll() is None:
            running.popen.kill()
    running.wait_for("stopping the rest", timeout_s=5)
    assert_all_gone(children, running.output())


def test_up_refuses_prefork_concurrency_on_the_solo_pool(tmp_path: Path) -> None:
    result = subprocess.run(
        bso("up", "--data-dir", str(tmp_path / "data"), "--concurrency", "4"),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert "--concurrency 4 needs --pool prefork" in result.stderr
    assert not (tmp_path / "data").exists()  # refused before anything started


def test_ctrl_c_while_starting_stops_what_was_started(tmp_path: Path) -> None:
    data = tmp_path / "data"
    running = start(
        bso("up", "--data-dir", str(data), "--redis-port", "0", "--no-flower"), tmp_path
    )
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not (data / "logs" / "worker1.log").exists():  # Redis is up, workers starting
            assert time.monotonic() < deadline, running.output()
            time.sleep(0.05)
        children = running.descendants()
        running.popen.send_signal(signal.SIGINT)
        assert running.popen.wait(60) == 130
    finally:
        if running.popen.poll() is None:
            running.popen.kill()
    assert children
    assert_all_gone(children, running.output())


@pytest.mark.parametrize("option", ["--redis-port", "--flower-port", "--metrics-port"])
def test_a_taken_port_is_one_line_that_names_the_fix(tmp_path: Path, option: str) -> None:
    """The python-svc machines run their own Redis on 6379, where plain ``bso up`` starts."""
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = str(other.getsockname()[1])
        ports = {"--redis-port": "0", "--flower-port": "0", "--metrics-port": "0", option: port}
        flags = [x for pair in ports.items() for x in pair]
        run = subprocess.run(
            bso("up", "--data-dir", str(tmp_path / "data"), *flags),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert run.returncode == 2, run.stdout + run.stderr
    [line] = run.stderr.splitlines()
    prefix = (
        f"bso up: port {port} on 127.0.0.1 is taken by another process "
        f"(for {TAKEN_FOR[option]}); give {option} "
    )
    assert line.startswith(prefix), line
    suggested = int(line.removeprefix(prefix).split()[0])
    assert int(port) < suggested <= int(port) + 20
    assert not port_in_use("127.0.0.1", suggested)
    assert line.endswith(
        "(free now): a fixed port keeps the URLs runs were given, so a run training "
        f"across a restart of bso up finds it again ({option} 0 takes any free port, "
        "a new one at every start)"
    )


TAKEN_FOR = {"--redis-port": "Redis", "--flower-port": "Flower", "--metrics-port": "the metrics"}


def broker_port(url: str) -> int:
    port = urllib.parse.urlsplit(url).port
    assert port is not None, url
    return port


def test_a_second_start_on_the_same_data_dir_is_refused_until_the_first_is_killed(
    tmp_path: Path,
) -> None:
    """Two services on one data folder would share its database, append-only file,
    beat schedule and metrics folder, and the later one would leave credentials.env
    naming its own Redis, dead once it stopped.  A second ``bso up`` (even on the
    first one's Redis port, which is taken) and a ``bso demo`` are refused in one
    line that names the folder and the pid, and change nothing; once the first is
    killed with SIGKILL, its lock goes with it and a new start comes up."""
    data = tmp_path / "data"
    up = ["up", "--data-dir", str(data), "--redis-port", "0", "--no-flower", "--workers", "1"]
    first = start(bso(*up), tmp_path)
    children: set[int] = set()
    try:
        first.wait_for("Ctrl-C stops everything")
        credentials = (data / "credentials.env").read_bytes()
        port = broker_port(read_env_file(data / "credentials.env")["BSO_BROKER_URL"])
        refusal = (
            f"bso up already runs from {data.resolve()} (pid {first.popen.pid}); stop it "
            "first (Ctrl-C where it runs), or give this one another --data-dir"
        )
        for argv in (
            ["up", "--data-dir", str(data), "--redis-port", str(port)],
            ["demo", "--data-dir", str(data), "--recurrences", "1"],
        ):
            second = subprocess.run(
                bso(*argv), capture_output=True, text=True, timeout=60, cwd=tmp_path, check=False
            )
            assert second.returncode == 2, second.stdout + second.stderr
            assert second.stderr.splitlines() == [f"bso {argv[0]}: {refusal}"]
            assert "bso is up" not in second.stdout
        assert (data / "credentials.env").read_bytes() == credentials

        children = first.descendants()
        first.popen.kill()
        first.popen.wait(30)
        again = start(bso(*up), tmp_path)
        try:
            again.wait_for("Ctrl-C stops everything")
            assert (data / "bso.lock").read_text() == f"{again.popen.pid} bso up\n"
            broker = read_env_file(data / "credentials.env")["BSO_BROKER_URL"]
            assert broker_port(broker) == broker_port(
                again.printed(r"broker/replies\s+(\S+)").group(1)
            )
            again.popen.send_signal(signal.SIGINT)
            assert again.popen.wait(60) == 0, again.output()
        finally:
            if again.popen.poll() is None:
                again.popen.kill()
        assert (data / "bso.lock").read_text() == ""  # released on the way down
    finally:
        if first.popen.poll() is None:
            first.popen.kill()
    assert_all_gone(children, first.output())
