"""``bso probe MODULE:FACTORY`` on the CPU, as a user runs it."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bso.cli import main
from bso.commands.probe import memory_size

FACTORY = """
import torch

def setup():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 512), torch.nn.ReLU(), torch.nn.Linear(512, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    def make_batch(n):
        return torch.randn(n, 128), torch.randint(0, 4, (n,))
    return model, optimizer, make_batch, torch.nn.functional.cross_entropy
"""


@pytest.fixture
def factory_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "probe_factory.py").write_text(FACTORY)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_json_gives_the_maximum_its_candidates_and_the_prediction(
    factory_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["probe", "probe_factory:setup", "--memory-budget", "24MiB", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["max_batch_size"] == max(result["candidates"])
    assert result["default_batch_size"] in result["candidates"]
    assert result["measured_peak_bytes"] <= 24 << 20
    assert abs(result["predicted_peak_bytes"] / result["measured_peak_bytes"] - 1) <= 0.15
    assert 3 <= result["trials"] <= 8
    assert result["trials"] == len(result["steps"])
    assert result["micro_batch_size"] is None
    assert set(result["accumulation_steps"]) == {str(b) for b in result["candidates"]}


def test_the_text_output_names_the_maximum(
    factory_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["probe", "probe_factory:setup", "--memory-budget", "24MiB"]) == 0
    out = capsys.readouterr().out
    assert "largest batch within 24.0 MiB on cpu:" in out
    assert "candidates [" in out


def refusal(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The one line on stderr of a command refused as a user error (exit status 2)."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("bso probe: ")
    assert len(err.splitlines()) == 1
    return err


def test_the_cpu_needs_a_budget(factory_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert "on the CPU give --memory-budget" in refusal(["probe", "probe_factory:setup"], capsys)


def test_a_device_that_is_not_there_is_named(
    factory_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    argv = ["probe", "probe_factory:setup", "--memory-budget", "1GiB", "--device"]
    assert "not a device: 'gpu0'" in refusal([*argv, "gpu0"], capsys)
    if not torch.cuda.is_available():
        assert "torch sees no CUDA device here" in refusal([*argv, "cuda"], capsys)


def test_a_factory_that_does_not_load_is_named(
    factory_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    budget = ["--memory-budget", "1GiB"]
    assert "cannot load nowhere:setup" in refusal(["probe", "nowhere:setup", *budget], capsys)
    assert "expected MODULE:FACTORY" in refusal(["probe", "probe_factory", *budget], capsys)


@pytest.mark.parametrize(
    ("text", "size"),
    [("512MiB", 512 << 20), ("2GB", 2 * 10**9), ("1.5G", 1_500_000_000), ("1000", 1000)],
)
def test_memory_sizes_read_as_people_write_them(text: str, size: int) -> None:
    assert memory_size(text) == size


@pytest.mark.parametrize("text", ["lots", "-1MiB", "0"])
def test_a_memory_size_that_is_not_one_is_refused(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        memory_size(text)


def test_micro_batches_make_every_candidate_whole_passes_on_every_device(
    factory_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["probe", "probe_factory:setup", "--memory-budget", "24MiB", "--json"]
    assert main([*argv, "--micro-batch", "48", "--devices", "2", "--limit", "6144"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["micro_batch_size"], result["devices"]) == (48, 2)
    assert result["candidates"][0] == 96  # one micro-batch on each device
    assert max(result["candidates"]) <= 6144
    for size in result["candidates"]:
        per_device = result["per_device_batch_size"][str(size)]
        assert per_device * 2 == size
        assert per_device == 48 * result["accumulation_steps"][str(size)]
    assert result["accumulation_steps"][str(max(result["candidates"]))] > 1
    assert result["max_batch_size"] >= 48  # the micro-batch itself fits


def test_devices_alone_split_each_candidate_without_accumulating(
    factory_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["probe", "probe_factory:setup", "--memory-budget", "24MiB", "--json"]
    assert main([*argv, "--devices", "4"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert max(result["candidates"]) == 4 * result["max_batch_size"]
    assert set(result["accumulation_steps"].values()) == {1}


def test_a_micro_batch_that_does_not_fit_is_refused(
    factory_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["probe", "probe_factory:setup", "--memory-budget", "24MiB"]
    assert main([*argv, "--micro-batch", "1000000"]) == 1
    assert "a micro-batch of 1000000 does not fit" in capsys.readouterr().err


BROKEN_FACTORIES = """
import torch

def raises():
    raise RuntimeError("no such checkpoint: /data/model.pt")

def three():
    return 1, 2, 3

def wrong_targets():
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    def make_batch(n):
        return torch.randn(n, 8), torch.randn(n, 4, 7)
    return model, optimizer, make_batch, torch.nn.functional.cross_entropy
"""


@pytest.mark.parametrize(
    ("factory", "said"),
    [
        ("raises", "broken:raises() raised RuntimeError: no such checkpoint"),
        ("three", "must return (model, optimizer, make_batch, loss_fn), got tuple of 3"),
        ("wrong_targets", "a training step of broken:wrong_targets failed (RuntimeError"),
    ],
)
def test_a_mistake_in_the_users_factory_is_theirs_to_fix(
    factory_dir: Path, capsys: pytest.CaptureFixture[str], factory: str, said: str
) -> None:
    (factory_dir / "broken.py").write_text(BROKEN_FACTORIES)
    assert main(["probe", f"broken:{factory}", "--memory-budget", "8MiB"]) == 2
    err = capsys.readouterr().err.strip()
    assert said in err
    assert "internal error" not in err
    assert len(err.splitlines()) == 1


@pytest.mark.parametrize(
    ("options", "said"),
    [
        (["--micro-batch", "48", "--devices", "2", "--limit", "50"], "below one micro-batch"),
        (["--limit", "100000000"], "is above 4194304"),
    ],
)
def test_a_limit_that_cannot_work_is_refused_up_front(
    factory_dir: Path, capsys: pytest.CaptureFixture[str], options: list[str], said: str
) -> None:
    argv = ["probe", "probe_factory:setup", "--memory-budget", "24MiB", *options]
    assert main(argv) == 2
    assert said in capsys.readouterr().err


def test_the_probe_prints_only_its_own_output(factory_dir: Path) -> None:
    """torch's profiler wrote 9 lines of chatter to the terminal around each probe."""
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "bso.cli",
            "probe",
            "probe_factory:setup",
            "--memory-budget",
            "24MiB",
        ],
        cwd=factory_dir,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    assert run.stderr == ""
    assert run.stdout.startswith("largest batch within 24.0 MiB on cpu: ")
