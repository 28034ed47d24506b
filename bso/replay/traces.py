"""Read Zeus's public traces into :class:`~bso.replay.workloads.Workload` objects.

Format (see Zeus's trace README): ``summary_train.csv`` has one row per
(dataset, batch size, seeded run, target metric) with the epoch that reached
the target (``nan`` if never); ``summary_power_<gpu>.csv`` has time per epoch
and average power per (dataset, batch size, power limit).  Runs are replayed
at the GPU's highest power limit: bso picks batch sizes, not power limits.
"""

from __future__ import annotations

import csv
import math
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from bso.replay.workloads import SizeProfile, Workload


@dataclass(frozen=True, slots=True)
class TraceDefaults:
    """Per-dataset job settings of Zeus's published trace-driven experiments."""

    target_metric: float
    max_epochs: int
    default_batch_size: int
    higher_is_better_metric: bool = True


# The job settings Zeus's NSDI'23 artifact uses for each of its six workloads.
KNOWN_DATASETS: dict[str, TraceDefaults] = {
    "cifar100": TraceDefaults(0.6, 100, 1024),
    "imagenet": TraceDefaults(0.65, 100, 256),
    "squad": TraceDefaults(84.0, 6, 32),
    "librispeech": TraceDefaults(40.0, 16, 256, higher_is_better_metric=False),
    "movielens-1m": TraceDefaults(0.41, 100, 1024),
    "sentiment140": TraceDefaults(0.84, 10, 128),
}

GPU_NAMES = {
    "v100": "Tesla V100",
    "a40": "NVIDIA A40",
    "p100": "Tesla P100",
    "rtx6000": "Quadro RTX 6000",
}


class TraceError(ValueError):
    """The trace folder is missing files or has rows bso cannot use."""


def available_gpus(folder: Path) -> list[str]:
    return sorted(p.stem.removeprefix("summary_power_") for p in folder.glob("summary_power_*.csv"))


def load_trace_workloads(folder: Path, gpu: str | None = None) -> list[Workload]:
    """One workload per known dataset present in both trace files.

    The batch sizes are those with both a power profile and recorded runs; the
    default batch size is capped at the largest one, as Zeus does.
    """
    folder = Path(folder)
    train_path = folder / "summary_train.csv"
    gpus = available_gpus(folder)
    if not train_path.exists() or not gpus:
        raise TraceError(
            f"{folder} needs summary_train.csv and summary_power_<gpu>.csv (Zeus's trace format)"
        )
    gpu = gpu or gpus[0]
    power_path = folder / f"summary_power_{gpu}.csv"
    if not power_path.exists():
        raise TraceError(f"no power trace for GPU {gpu!r} in {folder}; have {gpus}")

    runs, optimizers = _read_runs(train_path)
    profiles, max_power = _read_power(power_path, optimizers)
    workloads = []
    for dataset, defaults in KNOWN_DATASETS.items():
        sizes = sorted(set(profiles.get(dataset, {})) & set(runs.get(dataset, {})))
        if not sizes:
            continue
        default = max(b for b in sizes if b <= defaults.default_batch_size)
        workloads.append(
            Workload(
                name=dataset,
                default_batch_size=default,
                target_metric=defaults.target_metric,
                higher_is_better_metric=defaults.higher_is_better_metric,
                max_epochs=defaults.max_epochs,
                profiles={b: profiles[dataset][b] for b in sizes},
                runs={b: runs[dataset][b][defaults.target_metric] for b in sizes},
                gpu_model=GPU_NAMES.get(gpu, gpu),
                max_power_w=max_power,
            )
        )
    if not workloads:
        raise TraceError(f"no dataset of {sorted(KNOWN_DATASETS)} found in {folder}")
    return workloads


def _read_power(
    path: Path, optimizers: dict[str, str]
) -> tuple[dict[str, dict[int, SizeProfile]], float]:
    """Profiles at the highest power limit, for the optimizer the runs were trained with.

    Some datasets were profiled with several optimizers (cifar100: Adadelta
    and Adam); mixing them would pair one optimizer's speed with another's runs.
    """
    rows = list(csv.DictReader(path.open()))
    if not rows:
        raise TraceError(f"{path} is empty")
    max_power = max(float(r["power_limit"]) for r in rows)
    profiles: dict[str, dict[int, SizeProfile]] = defaultdict(dict)
    for r in rows:
        trained_with = optimizers.get(r["dataset"])
        if trained_with is not None and r["optimizer"].lower() != trained_with:
            continue
        if float(r["power_limit"]) == max_power:
            profiles[r["dataset"]][int(r["batch_size"])] = SizeProfile(
                float(r["time_per_epoch"]), float(r["average_power"])
            )
    return profiles, max_power


def _read_runs(
    path: Path,
) -> tuple[dict[str, dict[int, dict[float, tuple[int | None, ...]]]], dict[str, str]]:
    """dataset -> batch size -> target -> epochs of each run (None: never reached),
    and the optimizer (lower case) each dataset was trained with."""
    per_run: dict[tuple[str, int, float], dict[str, int | None]] = defaultdict(dict)
    optimizers: dict[str, str] = {}
    for r in csv.DictReader(path.open()):
        optimizers.setdefault(r["dataset"], r["optimizer"].lower())
        epoch = float(r["target_epoch"])
        key = (r["dataset"], int(r["batch_size"]), float(r["target_metric"]))
        per_run[key][r["run"]] = None if math.isnan(epoch) else int(epoch)
    runs: dict[str, dict[int, dict[float, tuple[int | None, ...]]]] = defaultdict(
        lambda: defaultdict(dict)
    )
    all_runs: dict[tuple[str, int], set[str]] = defaultdict(set)
    for (dataset, size, _), epochs in per_run.items():
        all_runs[(dataset, size)].update(epochs)
    for (dataset, size, target), epochs in per_run.items():
        # A run with no row for this target never reached it.
        names = sorted(all_runs[(dataset, size)])
        runs[dataset][size][target] = tuple(epochs.get(n) for n in names)
    for dataset, defaults in KNOWN_DATASETS.items():
        for size, targets in runs.get(dataset, {}).items():
            if defaults.target_metric not in targets:
                targets[defaults.target_metric] = tuple(None for _ in all_runs[(dataset, size)])
    return runs, optimizers
