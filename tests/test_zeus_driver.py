"""scripts/zeus_driver.py: Zeus 0.16.0's own optimizer replayed on tiny hand-checked worlds.

The benchmark's "zeus-0.16.0" column is only as good as this replay, so the
expectations below are derived by hand from Zeus's documented algorithm
(default size first, then smaller sizes, then larger ones; a size that misses
the target ends its direction; a second pruning round among the converged sizes
starting from the cheapest; then Thompson sampling) and from the replay rules,
not from the driver's own output.

The driver runs in the side venv ``.venv-zeus``; when it is missing the fixture
creates it with ``scripts/setup_zeus_venv.sh`` (a minute or two, once), so this
module is never skipped.
"""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.fixtures.scripts import load_script

ROOT = Path(__file__).resolve().parent.parent
SETUP = ROOT / "scripts" / "setup_zeus_venv.sh"
DRIVER = ROOT / "scripts" / "zeus_driver.py"

# Creating the venv from PyPI can take minutes on a loaded machine.
pytestmark = pytest.mark.timeout(1200)

ETA = 0.5
MAX_POWER_W = 300.0
GPUS = 2
# size -> (epoch_time_s, avg_power_w); larger sizes are faster per epoch.
PROFILES = {256: (8.0, 150.0), 512: (5.0, 180.0), 1024: (3.0, 220.0), 2048: (2.0, 260.0)}
# Epochs each size needs in every attempt; 2048 never reaches the target.
NEEDS: dict[int, int | None] = {256: 12, 512: 10, 1024: 9, 2048: None}


def load_driver() -> ModuleType:
    """Import the driver as a module from bso's venv (it imports zeus only lazily)."""
    return load_script("zeus_driver")


def expected_cost(size: int, epochs: int) -> float:
    """Cost of ``epochs`` epochs at ``size``, written out independently of the driver."""
    epoch_time_s, power_w = PROFILES[size]
    time_s = epochs * epoch_time_s
    energy_j = time_s * power_w * GPUS
    return ETA * energy_j + (1 - ETA) * MAX_POWER_W * GPUS * time_s


def make_world(
    job_id: str, *, beta_knob: float | None, max_epochs: int, recurrences: int
) -> dict[str, Any]:
    """Every recurrence has two identical attempts; the last one has a single all-miss attempt."""
    attempt = {str(b): e for b, e in NEEDS.items()}
    return {
        "job": {
            "job_id": job_id,
            "batch_sizes": sorted(PROFILES),
            "default_batch_size": 1024,
            "eta_knob": ETA,
            "beta_knob": beta_knob,
            "target_metric": 0.6,
            "higher_is_better_metric": True,
            "max_epochs": max_epochs,
            "num_pruning_rounds": 2,
            "window_size": 10,
            "mab_prior_mean": 0.0,
            "mab_prior_precision": 0.0,
            "mab_num_explorations": 2,
            "mab_seed": 1,
            "max_power_w": MAX_POWER_W,
            "gpu_count": GPUS,
            "gpu_model": "Tesla V100",
        },
        "sizes": {str(b): {"epoch_time_s": t, "avg_power_w": p} for b, (t, p) in PROFILES.items()},
        "recurrences": [[dict(attempt), dict(attempt)] for _ in range(recurrences - 1)]
        + [[{str(b): None for b in PROFILES}]],
    }


@pytest.fixture(scope="module")
def zeus_python() -> Path:
    """The side venv's python, created by the setup script when missing (idempotent)."""
    done = subprocess.run(
        ["bash", str(SETUP)], capture_output=True, text=True, timeout=1100, check=False
    )
    assert done.returncode == 0, f"setup_zeus_venv.sh failed:\n{done.stdout}\n{done.stderr}"
    python = Path(done.stdout.strip().splitlines()[-1])
    assert python.exists(), done.stdout
    return python


def run_driver(python: Path, payload: Any, *args: str) -> Any:
    """Run the driver on ``payload`` and parse its stdout (which must be JSON only)."""
    done = subprocess.run(
        [str(python), str(DRIVER), *args],
        input=json.dumps(payload),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def check_arithmetic(world: dict[str, Any], result: dict[str, Any]) -> None:
    """Per-attempt and per-recurrence time/energy/cost follow the replay rules."""
    assert result["policy"] == "zeus-0.16.0"
    assert len(result["recurrences"]) == len(world["recurrences"])
    for record, world_attempts in zip(result["recurrences"], world["recurrences"], strict=True):
        attempts = record["attempts"]
        assert len(attempts) <= len(world_attempts)
        assert record["tries"] == len(attempts) == len(record["sizes"])
        assert record["sizes"] == [a["size"] for a in attempts]
        for a, epochs_needed in zip(attempts, world_attempts, strict=False):
            assert a["cost"] == pytest.approx(expected_cost(a["size"], a["epochs"]))
            needed = epochs_needed[str(a["size"])]
            if a["reached_target"]:
                # Zeus stops a run at the first epoch it reports the target.
                assert a["epochs"] == needed
            else:
                assert needed is None or a["epochs"] < needed
        assert record["cost"] == pytest.approx(sum(a["cost"] for a in attempts))
        assert record["time_s"] == pytest.approx(sum(a["time_s"] for a in attempts))
        assert record["energy_j"] == pytest.approx(sum(a["energy_j"] for a in attempts))
        assert record["converged"] == (bool(attempts) and attempts[-1]["reached_target"])


def test_cost_arithmetic_pure_python() -> None:
    """The driver's cost is Zeus's zeus_cost with max power of all GPUs together."""
    driver = load_driver()
    profile = driver.SizeProfile(epoch_time_s=3.0, avg_power_w=220.0)
    time_s, energy_j = driver.run_time_energy(profile, 9, GPUS)
    assert (time_s, energy_j) == (27.0, 27.0 * 220.0 * 2)
    # 0.5 * 11880 J + 0.5 * (300 W * 2 GPUs) * 27 s
    assert driver.run_cost(energy_j, time_s, ETA, MAX_POWER_W * GPUS) == pytest.approx(14040.0)
    assert driver.run_cost(energy_j, time_s, 1.0, 600.0) == energy_j
    assert driver.run_cost(energy_j, time_s, 0.0, 600.0) == 600.0 * time_s
    assert expected_cost(1024, 9) == pytest.approx(14040.0)

    job = driver.JobConfig.from_json(
        make_world("j", beta_knob=None, max_epochs=5, recurrences=1)["job"]
    )
    assert job.cluster_max_power_w == MAX_POWER_W * GPUS
    assert job.missed_metric() < job.target_metric
    lower = driver.JobConfig.from_json(
        {
            **make_world("j", beta_knob=2.0, max_epochs=5, recurrences=1)["job"],
            "higher_is_better_metric": False,
        }
    )
    assert lower.missed_metric() > lower.target_metric
    assert driver.epochs_needed({"512": None, "1024": 7}, 1024) == 7
    assert driver.epochs_needed({"512": None, "1024": 7}, 512) is None
    with pytest.raises(ValueError, match="no entry"):
        driver.epochs_needed({"512": 3}, 2048)


def test_first_stop_epoch_pure_python() -> None:
    """The --fast search finds the first stop of any monotone predicate, guess or not."""
    driver = load_driver()
    max_epochs = 40
    for answer in range(1, max_epochs + 1):
        for guess in (1, 2, answer - 1, answer, answer + 1, max_epochs, max_epochs + 5):
            calls: list[int] = []

            async def stops(epoch: int, answer: int = answer, calls: list[int] = calls) -> bool:
                assert 1 <= epoch <= max_epochs
                calls.append(epoch)
                return epoch >= answer

            found = asyncio.run(driver.first_stop_epoch(stops, max_epochs, guess))
            assert found == answer, (answer, guess, calls)
            assert len(calls) <= 2 + math.ceil(math.log2(max_epochs))
            if guess == answer:
                assert len(calls) <= 2


def test_replay_without_early_stop(zeus_python: Path) -> None:
    """beta_knob=None: a run that never converges is stopped at max_epochs, once."""
    world = make_world("no-beta", beta_knob=None, max_epochs=20, recurrences=9)
    result = run_driver(zeus_python, world)
    check_arithmetic(world, result)
    sizes = [r["sizes"] for r in result["recurrences"]]
    # Round 1: default 1024, then down 512, 256, then up 2048 (misses, 20 epochs);
    # the same recurrence retries and round 2 starts at the cheapest converged size
    # (1024), then goes down among the converged ones. After that the bandit has
    # zero-variance arms, so it always picks the cheapest: 1024.
    assert sizes == [
        [1024],
        [512],
        [256],
        [2048, 1024],
        [512],
        [256],
        [1024],
        [1024],
        [1024],
    ]
    first_2048 = result["recurrences"][3]["attempts"][0]
    assert first_2048["epochs"] == 20
    assert not first_2048["zeus_converged"]
    assert [r["zeus_stage"] for r in result["recurrences"]][-2:] == ["MAB", "MAB"]
    # The last recurrence's only attempt misses: not converged, one try, max_epochs paid.
    last = result["recurrences"][-1]
    assert last["converged"] is False
    assert last["tries"] == 1
    assert last["attempts"][0]["epochs"] == 20
    assert all(r["converged"] for r in result["recurrences"][:-1])
    # The size that never converges is never handed out again.
    assert sum(s.count(2048) for s in sizes) == 1


def test_replay_with_early_stop(zeus_python: Path) -> None:
    """beta_knob=2: runs are cut once their cost passes 2x the cheapest run so far."""
    world = make_world("beta2", beta_knob=2.0, max_epochs=40, recurrences=8)
    result = run_driver(zeus_python, world)
    check_arithmetic(world, result)
    records = result["recurrences"]
    bound = 2.0 * expected_cost(1024, 9)  # 1024's run is the cheapest: 14040
    # 256 would need 12 epochs (cost 43200) but passes the bound at epoch 8; 2048
    # never converges and passes it at epoch 26 (before max_epochs=40).
    cut_256 = min(k for k in range(1, 41) if expected_cost(256, k) > bound)
    cut_2048 = min(k for k in range(1, 41) if expected_cost(2048, k) > bound)
    assert (cut_256, cut_2048) == (8, 26)
    assert [r["sizes"] for r in records] == [
        [1024],
        [512],
        [256, 2048],  # both attempts of this recurrence are cut: not converged
        [1024],  # round 2 among {512, 1024}, from the cheapest
        [512],
        [1024],  # bandit
        [1024],
        [1024],  # the all-miss recurrence, cut by the bound
    ]
    assert [a["epochs"] for a in records[2]["attempts"]] == [cut_256, cut_2048]
    assert records[2]["converged"] is False
    assert records[2]["tries"] == 2
    assert records[-1]["attempts"][0]["epochs"] == min(
        k for k in range(1, 41) if expected_cost(1024, k) > bound
    )
    assert [r["converged"] for r in records] == [True, True, False, True, True, True, True, False]


def test_list_input_and_fast_match_single_runs(zeus_python: Path) -> None:
    """A list of worlds gives a list of results, and --fast gives the same replay."""
    all_miss = make_world("c", beta_knob=2.0, max_epochs=10, recurrences=3)
    all_miss["recurrences"] = [[dict.fromkeys(map(str, PROFILES))] * 2] * 3
    worlds = [
        make_world("a", beta_knob=None, max_epochs=20, recurrences=7),
        make_world("b", beta_knob=2.0, max_epochs=40, recurrences=7),
        all_miss,
    ]
    together = run_driver(zeus_python, worlds)
    assert isinstance(together, list)
    assert [r["job_id"] for r in together] == ["a", "b", "c"]
    check_arithmetic(worlds[0], together[0])

    # When the default size misses, Zeus skips every smaller size, tries the larger
    # ones, and once a pruning round ends with nothing converged it refuses to hand
    # out any size again: those recurrences carry Zeus's error, no tries, no cost.
    stuck = together[2]["recurrences"]
    assert stuck[0]["sizes"] == [1024, 2048]
    assert stuck[0]["converged"] is False
    for record in stuck[1:]:
        assert record["error"].startswith("ZeusBSOServerRuntimeError")
        assert (record["tries"], record["cost"], record["converged"]) == (0, 0, False)
    # Each world gets a fresh database: the second one replays as if it were alone.
    # (One interpreter start costs seconds, mostly Zeus importing scikit-learn.)
    assert together[1] == run_driver(zeus_python, worlds[1])
    assert run_driver(zeus_python, worlds, "--fast") == together
