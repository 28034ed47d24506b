"""Loading Zeus's public traces (shared/traces) into workloads.

The expected values are recomputed here from the CSV files with the standard
library, independently of :mod:`bso.replay.traces`.
"""

from __future__ import annotations

import csv
import math
import shutil
import statistics
from collections import defaultdict
from pathlib import Path

import pytest

from bso.replay.traces import (
    KNOWN_DATASETS,
    TraceError,
    available_gpus,
    load_trace_workloads,
)
from bso.replay.workloads import Workload

# The repository root's sibling ``shared/`` (CI: ../shared/traces from the root).
TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"


@pytest.fixture(scope="module")
def traces() -> Path:
    if not (TRACES / "summary_train.csv").is_file():
        pytest.fail(
            f"Zeus's traces are missing: expected {TRACES}/summary_train.csv and "
            "summary_power_v100.csv (the shared/ folder beside the repository)"
        )
    return TRACES


@pytest.fixture(scope="module")
def workloads(traces: Path) -> dict[str, Workload]:
    return {w.name: w for w in load_trace_workloads(traces)}


def read(path: Path) -> list[dict[str, str]]:
    with path.open() as f:
        return list(csv.DictReader(f))


def test_six_datasets_on_the_v100(traces: Path, workloads: dict[str, Workload]) -> None:
    assert available_gpus(traces) == ["v100"]
    assert set(workloads) == {
        "cifar100",
        "imagenet",
        "squad",
        "librispeech",
        "movielens-1m",
        "sentiment140",
    }
    for w in workloads.values():
        assert w.gpu_model == "Tesla V100"
        assert w.gpu_count == 1
        assert w.max_power_w == 250.0  # the highest power limit of the trace
    assert load_trace_workloads(traces, "v100") == list(workloads.values())


@pytest.mark.parametrize(
    ("name", "settings"),
    [
        # (default batch size, target metric, max epochs, higher is better)
        ("cifar100", (1024, 0.6, 100, True)),
        ("imagenet", (256, 0.65, 100, True)),
        ("squad", (32, 84.0, 6, True)),
        # 256 has recorded runs but no power profile: capped to the largest size that has.
        ("librispeech", (192, 40.0, 16, False)),
        ("movielens-1m", (1024, 0.41, 100, True)),
        ("sentiment140", (128, 0.84, 10, True)),
    ],
)
def test_job_settings_of_zeus_experiments(
    workloads: dict[str, Workload], name: str, settings: tuple[int, float, int, bool]
) -> None:
    default, target, max_epochs, higher_is_better = settings
    w = workloads[name]
    assert w.default_batch_size == default
    assert w.default_batch_size in w.batch_sizes
    assert w.target_metric == target
    assert w.max_epochs == max_epochs
    assert w.higher_is_better_metric is higher_is_better
    assert KNOWN_DATASETS[name].target_metric == target


def test_sizes_are_those_with_both_runs_and_power(
    traces: Path, workloads: dict[str, Workload]
) -> None:
    train = read(traces / "summary_train.csv")
    power = read(traces / "summary_power_v100.csv")
    for name, w in workloads.items():
        trained = {int(r["batch_size"]) for r in train if r["dataset"] == name}
        profiled = {int(r["batch_size"]) for r in power if r["dataset"] == name}
        assert w.batch_sizes == sorted(trained & profiled), name
    assert 256 not in workloads["librispeech"].batch_sizes
    assert max(workloads["librispeech"].batch_sizes) == 192


def reference_runs(traces: Path, name: str, target: float) -> dict[int, list[int | None]]:
    """Per size, the epoch each seeded run first reached ``target`` (None: never)."""
    rows = [r for r in read(traces / "summary_train.csv") if r["dataset"] == name]
    runs: dict[int, dict[str, int | None]] = defaultdict(dict)
    for r in rows:
        runs[int(r["batch_size"])].setdefault(r["run"], None)
    for r in rows:
        if float(r["target_metric"]) == target and not math.isnan(float(r["target_epoch"])):
            runs[int(r["batch_size"])][r["run"]] = int(float(r["target_epoch"]))
    return {b: list(per_run.values()) for b, per_run in runs.items()}


def sort_key(epochs: int | None) -> float:
    return math.inf if epochs is None else epochs


def test_recorded_runs_match_the_train_trace(traces: Path, workloads: dict[str, Workload]) -> None:
    for name, w in workloads.items():
        expected = reference_runs(traces, name, w.target_metric)
        for b in w.batch_sizes:
            assert sorted(w.runs[b], key=sort_key) == sorted(expected[b], key=sort_key), (name, b)
    cifar = workloads["cifar100"]
    assert len(cifar.runs[1024]) == 10
    assert None in cifar.runs[4096]  # a large size that misses the target


def reference_profiles(traces: Path, name: str) -> dict[int, tuple[float, float]]:
    """Time per epoch and power at the top power limit, with the train trace's optimizer.

    Zeus's simulator selects the power rows of the job's optimizer; the train
    trace of each dataset uses one optimizer.
    """
    optimizers = {
        r["optimizer"] for r in read(traces / "summary_train.csv") if r["dataset"] == name
    }
    assert len(optimizers) == 1
    power = [r for r in read(traces / "summary_power_v100.csv") if r["dataset"] == name]
    top = max(float(r["power_limit"]) for r in power)
    return {
        int(r["batch_size"]): (float(r["time_per_epoch"]), float(r["average_power"]))
        for r in power
        if float(r["power_limit"]) == top and r["optimizer"] in optimizers
    }


@pytest.mark.parametrize("name", sorted(KNOWN_DATASETS))
def test_power_profiles_use_the_optimizer_of_the_train_trace(
    traces: Path, workloads: dict[str, Workload], name: str
) -> None:
    expected = reference_profiles(traces, name)
    w = workloads[name]
    for b in w.batch_sizes:
        profile = w.profiles[b]
        assert (profile.epoch_time_s, profile.avg_power_w) == pytest.approx(expected[b]), (
            name,
            b,
        )


def reference_oracle(traces: Path, w: Workload, eta: float) -> int:
    profiles = reference_profiles(traces, w.name)
    runs = reference_runs(traces, w.name, w.target_metric)
    costs = {}
    for b in w.batch_sizes:
        epochs = runs[b]
        if any(e is None or e > w.max_epochs for e in epochs):
            continue
        time, power = profiles[b]
        per_epoch = eta * time * power + (1 - eta) * w.max_power_w * time
        costs[b] = statistics.fmean(e for e in epochs if e is not None) * per_epoch
    return min(costs, key=lambda b: costs[b])


@pytest.mark.parametrize("eta", [0.0, 0.5, 1.0])
def test_oracle_sizes(traces: Path, workloads: dict[str, Workload], eta: float) -> None:
    for w in workloads.values():
        best, cost = w.oracle(eta)
        assert math.isfinite(cost)
        assert best == reference_oracle(traces, w, eta), w.name
        assert cost == min(w.expected_cost(b, eta) for b in w.batch_sizes)


def test_the_default_is_poor_where_zeus_says_so(workloads: dict[str, Workload]) -> None:
    for name in ("cifar100", "movielens-1m"):
        w = workloads[name]
        _, best = w.oracle(0.5)
        assert w.expected_cost(w.default_batch_size, 0.5) > 1.5 * best, name


def test_lower_is_better_metric_is_read_the_right_way(workloads: dict[str, Workload]) -> None:
    w = workloads["librispeech"]
    size = w.default_batch_size
    needed = min(e for e in w.runs[size] if e is not None)
    reports = list(w.epoch_reports(size, needed))
    assert reports[needed - 1].metric <= w.target_metric
    assert all(r.metric > w.target_metric for r in reports[: needed - 1])


# -- errors -----------------------------------------------------------------------------


def test_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match=r"needs summary_train\.csv and summary_power_<gpu>\.csv"):
        load_trace_workloads(tmp_path / "does-not-exist")


def test_folder_without_power_trace(tmp_path: Path, traces: Path) -> None:
    shutil.copy(traces / "summary_train.csv", tmp_path)
    with pytest.raises(TraceError, match=r"summary_power_<gpu>\.csv"):
        load_trace_workloads(tmp_path)


def test_folder_without_train_trace(tmp_path: Path, traces: Path) -> None:
    shutil.copy(traces / "summary_power_v100.csv", tmp_path)
    with pytest.raises(TraceError, match=r"summary_train\.csv"):
        load_trace_workloads(tmp_path)


def test_unknown_gpu(traces: Path) -> None:
    with pytest.raises(TraceError) as info:
        load_trace_workloads(traces, "a40")
    message = str(info.value)
    assert "no power trace for GPU 'a40'" in message
    assert "v100" in message


def test_empty_power_trace(tmp_path: Path, traces: Path) -> None:
    shutil.copy(traces / "summary_train.csv", tmp_path)
    header = (traces / "summary_power_v100.csv").read_text().splitlines()[0]
    (tmp_path / "summary_power_v100.csv").write_text(header + "\n")
    with pytest.raises(TraceError, match="is empty"):
        load_trace_workloads(tmp_path)


def test_traces_of_unknown_datasets_only(tmp_path: Path) -> None:
    (tmp_path / "summary_train.csv").write_text(
        "dataset,network,batch_size,optimizer,learning_rate,run,target_metric,target_epoch\n"
        "mnist,lenet,32,sgd,0.1,1,0.9,3\n"
    )
    (tmp_path / "summary_power_v100.csv").write_text(
        "dataset,network,batch_size,optimizer,power_limit,time_per_epoch,average_power\n"
        "mnist,lenet,32,sgd,250,10.0,100.0\n"
    )
    with pytest.raises(TraceError, match="no dataset of"):
        load_trace_workloads(tmp_path)


def test_trace_errors_are_value_errors() -> None:
    assert issubclass(TraceError, ValueError)
