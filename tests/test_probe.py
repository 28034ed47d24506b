"""``bso probe MODULE:FACTORY`` on the CPU, as a user runs it."""

from __future__ import annotations

import argparse
import json
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


def test_the_cpu_needs_a_budget(factory_dir: Path) -> None:
    with pytest.raises(SystemExit, match="on the CPU give --memory-budget"):
        main(["probe", "probe_factory:setup"])


def test_a_device_that_is_not_there_is_named(factory_dir: Path) -> None:
    import torch

    with pytest.raises(SystemExit, match="not a device: 'gpu0'"):
        main(["probe", "probe_factory:setup", "--device", "gpu0", "--memory-budget", "1GiB"])
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="torch sees no CUDA device here"):
            main(["probe", "probe_factory:setup", "--device", "cuda", "--memory-budget", "1GiB"])


def test_a_factory_that_does_not_load_is_named(factory_dir: Path) -> None:
    with pytest.raises(SystemExit, match="cannot load nowhere:setup"):
        main(["probe", "nowhere:setup", "--memory-budget", "1GiB"])
    with pytest.raises(SystemExit, match="expected MODULE:FACTORY"):
        main(["probe", "probe_factory", "--memory-budget", "1GiB"])


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
