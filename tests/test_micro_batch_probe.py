"""bso_client.micro_batch_probe and ``bso probe --explore-micro-batch``: real steps
on a small torch model, on the CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bso.cli import main
from bso.core.micro_batch import MicroBatchChoice
from bso.spec import Hardware
from bso_client.energy.base import EnergyMonitor
from bso_client.micro_batch_probe import accumulated_step, explore_micro_batch
from tests.test_probe import factory_dir  # noqa: F401 (a fixture)


def mlp() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def fixed_data(size: int = 48) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(size, 16, generator=generator), torch.randint(
        0, 3, (size,), generator=generator
    )


def test_an_accumulated_step_makes_the_update_of_one_pass() -> None:
    """Without batch-dependent layers, three steps in passes of 4, 8 or 48 samples
    end at the same weights, up to float rounding."""
    inputs, targets = fixed_data()
    finals = []
    for micro in (4, 8, 48):
        model, optimizer = mlp()
        served = 0

        def make_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
            nonlocal served
            start, served = served % 48, served + n
            return inputs[start : start + n], targets[start : start + n]

        for _ in range(3):
            accumulated_step(
                model, optimizer, make_batch, torch.nn.functional.cross_entropy,
                per_device=48, micro_batch=micro, device=torch.device("cpu"),
            )  # fmt: skip
        finals.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert torch.allclose(finals[0], finals[2], atol=1e-6)
    assert torch.allclose(finals[1], finals[2], atol=1e-6)


def test_exploring_leaves_the_model_as_it_was_and_logs_its_updates() -> None:
    model, optimizer = mlp()
    before = [p.detach().clone() for p in model.parameters()]
    heard: list[MicroBatchChoice] = []

    def make_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(n, 16), torch.randint(0, 3, (n,))

    exploration = explore_micro_batch(
        model, optimizer, make_batch, torch.nn.functional.cross_entropy,
        global_batch=64, devices=2, budget_steps=12, on_update=heard.append,
    )  # fmt: skip
    assert exploration.steps_taken <= 12
    assert set(exploration.steps) <= {1, 2, 4, 8, 16, 32}  # divisors of 64 / 2
    assert exploration.base == 32  # the largest that fits: no limit given
    assert heard[0] == MicroBatchChoice(32, 1.0, 0.0, {})  # the base, before anything is timed
    assert all(
        line.log_line().startswith("current recommended micro_batch_size: ") for line in heard
    )
    for was, now in zip(before, model.parameters(), strict=True):
        assert torch.equal(was, now)


def test_bso_probe_explores_the_micro_batches_of_a_global_batch(
    factory_dir: Path,  # noqa: F811 (the fixture)
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["probe", "probe_factory:setup", "--memory-budget", "24MiB", "--explore-micro-batch"]
    assert main([*argv, "--global-batch", "64", "--steps", "20", "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found["global_batch"] == 64
    assert found["steps"] <= found["budget_steps"] == 20
    sizes = [row["micro_batch"] for row in found["candidates"]]
    assert sizes == sorted(sizes, reverse=True)
    assert all(64 % m == 0 and m <= found["largest_fitting"] for m in sizes)
    assert sizes[0] == 64  # one pass of the whole batch fits in 24 MiB
    assert all(row["accumulation"] * row["micro_batch"] == 64 for row in found["candidates"])
    timed = [row for row in found["candidates"] if row["timed_steps"] >= 3]
    assert found["recommended"] in [row["micro_batch"] for row in timed]
    assert found["untimed"] == sum(row["timed_steps"] == 0 for row in found["candidates"])
    assert all(row["ms_per_sample"] > 0 for row in timed)
    assert sum(row["steps"] for row in found["candidates"]) == found["steps"]
    # No NVML or RAPL here: the cost is time alone, and the table says so.
    assert (found["eta_knob"], found["energy_measured"]) == (0.5, False)
    assert all(row["mj_per_sample"] is None for row in found["candidates"])

    assert main([*argv, "--global-batch", "64", "--steps", "8"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("bso: current recommended micro_batch_size: ")
    assert any(
        line.split()[:5] == ["micro", "passes", "timed", "ms/sample", "mJ/sample"] for line in out
    )
    assert out[-1].startswith("recommended micro_batch_size ")
    assert "costs " in out[-1]
    assert "as much per sample (time alone: no energy measured here)" in out[-1]


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ([], "--explore-micro-batch needs --global-batch"),
        (["--global-batch", "63", "--devices", "2"], "must be a multiple of --devices 2 from 1"),
        (["--global-batch", "64", "--micro-batch", "8"], "chooses the micro-batch"),
        (["--global-batch", "64", "--limit", "1"], "chooses the micro-batch"),
        (["--global-batch", "64", "--steps", "7"], "--steps 7 is too few"),
        (["--global-batch", "99999999"], "from 1 to"),
        (["--global-batch", "64", "--eta-knob", "1.5"], "--eta-knob must be from 0 to 1"),
    ],
)
def test_bad_exploration_arguments_are_refused_in_one_line(
    factory_dir: Path,  # noqa: F811 (the fixture)
    capsys: pytest.CaptureFixture[str],
    extra: list[str],
    says: str,
) -> None:
    argv = ["probe", "probe_factory:setup", "--memory-budget", "24MiB", "--explore-micro-batch"]
    assert main([*argv, *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("bso probe: ")
    assert says in err
    assert len(err.splitlines()) == 1


def test_exploration_arguments_without_exploring_are_refused(
    factory_dir: Path,  # noqa: F811 (the fixture)
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert (
        main(["probe", "probe_factory:setup", "--memory-budget", "24MiB", "--global-batch", "64"])
        == 2
    )
    assert "go with --explore-micro-batch" in capsys.readouterr().err


def test_energy_alone_is_refused_where_none_is_measured(
    factory_dir: Path,  # noqa: F811 (the fixture)
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["probe", "probe_factory:setup", "--memory-budget", "24MiB", "--explore-micro-batch"]
    assert main([*argv, "--global-batch", "64", "--eta-knob", "1"]) == 2
    err = capsys.readouterr().err
    assert "--eta-knob 1 weighs energy alone, but no energy is measured here" in err


def test_with_a_monitor_each_step_logs_its_time_and_energy_per_sample() -> None:
    model, optimizer = mlp()
    inputs, targets = fixed_data()
    monitor = StepEnergy()
    steps: dict[int, list[tuple[float, float]]] = {}
    exploration = explore_micro_batch(
        model, optimizer, lambda n: (inputs[:n], targets[:n]),
        torch.nn.functional.cross_entropy,
        global_batch=48, budget_steps=10, monitor=monitor, eta_knob=1.0, step_log=steps,
    )  # fmt: skip
    assert sum(len(v) for v in steps.values()) == exploration.steps_taken == 10
    assert all(s > 0 and j == pytest.approx(2.0 / 48) for v in steps.values() for s, j in v)


class StepEnergy(EnergyMonitor):
    """Two joules per window, whatever happens in it."""

    kind = "nvml"

    def __init__(self) -> None:
        super().__init__(Hardware(gpu_model="Fake", gpu_count=1, max_power_w=100.0), self._tick)
        self.readings = 0

    def _tick(self) -> float:
        return 0.0

    @property
    def description(self) -> str:
        return "two joules a window"

    def _energy_j(self) -> float:
        self.readings += 1
        return 2.0 * (self.readings // 2)

    def _release(self) -> None:
        pass
