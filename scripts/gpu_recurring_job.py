"""A real recurring job with bso and with always-default: cumulative cost, measured.

Issue 25's check on real hardware: a small model with a learnable synthetic task
(an MLP on noisy class prototypes, new noise every recurrence) is retrained
``--recurrences`` times with bso choosing the batch size among the candidates a
memory probe made (:func:`bso_client.discovery.probe_plan`), and ``--default-runs``
times at the default size alone (a job whose only candidate is the default), each
run measured by the optimizer's own monitor (NVML on a GPU; time only on a CPU,
which the output says) against the in-process service.  Always-default's
cumulative cost is its mean run times the recurrences.

    python scripts/gpu_recurring_job.py                          # on a GPU
    python scripts/gpu_recurring_job.py --recurrences 3 --default-runs 1 --samples 4096

Prints one line per run, then bso's cumulative cost over always-default's, and
what bso recommends at what confidence; ``--json FILE`` writes the same.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bso.errors import NoFeasibleBatchSize
from bso.service import BsoService
from bso.spec import JobSpec
from bso.storage.memory import MemoryStore
from bso_client import BatchSizeOptimizer, TrainFailError
from bso_client.discovery import Discovery, probe_plan

FEATURES = 64
CLASSES = 10
HIDDEN = 512
NOISE = 2.5
"""Of the class prototypes (unit scale): validation accuracy levels off near 0.92,
and the target (0.9) takes one to four epochs, more at large batches."""
LEARNING_RATE = 0.01
"""At the default batch size; bso.scale_lr scales it linearly (SGD) to the run's."""


def build_model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, HIDDEN), torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, CLASSES),
    )  # fmt: skip


def synthetic(seed: int, size: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Noisy copies of fixed class prototypes: learnable in a few epochs, not in one."""
    prototypes = torch.randn(CLASSES, FEATURES, generator=torch.Generator().manual_seed(0))
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, CLASSES, (size,), generator=generator)
    inputs = prototypes[labels] + NOISE * torch.randn(size, FEATURES, generator=generator)
    return inputs.to(device), labels.to(device)


def factory(device: str) -> Any:
    def build() -> tuple[Any, ...]:
        model = build_model().to(device)

        def make_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
            return synthetic(1, n, device)

        optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE, momentum=0.9)
        return model, optimizer, make_batch, torch.nn.functional.cross_entropy

    return build


def run_once(
    service: BsoService, job: JobSpec, recurrence: int, samples: int, device: str
) -> dict[str, Any]:
    """One run of the job, as a training script runs it; what it cost."""
    torch.manual_seed(recurrence)
    train = synthetic(100 + recurrence, samples, device)
    val = synthetic(10_000 + recurrence, 2048, device)
    model = build_model().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE, momentum=0.9)
    started = time.perf_counter()
    with BatchSizeOptimizer(job, service=service, environ={}) as bso:
        batch = bso.get_batch_size()
        bso.scale_lr(optimizer)
        bso.on_train_begin()
        accuracy = 0.0
        for _ in range(job.max_epochs):
            order = torch.randperm(samples, device=device)
            for start in range(0, samples - batch + 1, batch):
                index = order[start : start + batch]
                optimizer.zero_grad()
                loss = torch.nn.functional.cross_entropy(model(train[0][index]), train[1][index])
                loss.backward()  # type: ignore[no-untyped-call]
                optimizer.step()
            with torch.no_grad():
                accuracy = float((model(val[0]).argmax(1) == val[1]).float().mean())
            try:
                bso.on_evaluate(accuracy)
            except TrainFailError:  # stopped unconverged: the run's cost counts all the same
                break
            if bso.training_finished:
                break
        measured = bso.monitor.measures_energy if bso.monitor is not None else False
    with service.store.read(job.job_id or "") as tx:
        trial = tx.trials()[-1]
    return {
        "batch_size": batch,
        "epochs": trial.epochs,
        "cost": trial.cost,
        "status": trial.status.value,
        "accuracy": round(accuracy, 4),
        "seconds": round(time.perf_counter() - started, 2),
        "energy_measured": measured,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recurrences", type=int, default=20)
    parser.add_argument("--default-runs", type=int, default=5)
    parser.add_argument("--samples", type=int, default=16_384)
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--max-epochs", type=int, default=20)
    parser.add_argument("--limit", type=int, default=8192, help="largest candidate batch")
    parser.add_argument("--memory-budget", default=None, help="the probe's budget (CPU: required)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="  %(levelname)s %(name)s: %(message)s")
    budget = args.memory_budget or (None if args.device.startswith("cuda") else "256MiB")
    # Sizes past a quarter of the data train too few steps an epoch to mean much,
    # and the default leaves an epoch at least 32 steps.
    limit = min(args.limit, args.samples // 4)
    with tempfile.TemporaryDirectory() as cache:
        probed = probe_plan(
            Discovery(
                factory(args.device), memory_budget=budget, device=args.device,
                limit=limit, cache_dir=Path(cache),
            ),
            default_cap=max(args.samples // 32, 1),
        )  # fmt: skip
    plan = probed.plan
    print(
        f"device {args.device}; candidates the probe made: {plan.batch_sizes}, default "
        f"{plan.default_batch_size} (largest pass that fits: {probed.max_batch_size})"
    )
    spec = {
        "target_metric": args.target,
        "max_epochs": args.max_epochs,
        "eta_knob": 0.5,
        "mab_seed": 1,
    }
    arms = {
        "bso": (
            JobSpec(
                job_id="recurring-bso",
                batch_sizes=plan.batch_sizes,
                default_batch_size=plan.default_batch_size,
                **spec,
            ),
            args.recurrences,
        ),
        "always-default": (
            JobSpec(
                job_id="recurring-default",
                batch_sizes=[plan.default_batch_size],
                default_batch_size=plan.default_batch_size,
                **spec,
            ),
            args.default_runs,
        ),
    }
    service = BsoService(MemoryStore())
    runs: dict[str, list[dict[str, Any]]] = {}
    for name, (job, count) in arms.items():
        runs[name] = []
        for recurrence in range(1, count + 1):
            try:
                run = run_once(service, job, recurrence, args.samples, args.device)
            except NoFeasibleBatchSize as err:  # every size failed: no run can start
                print(f"{name:>14} stops after {recurrence - 1} run(s): {err.message}")
                break
            runs[name].append(run)
            print(
                f"{name:>14} run {recurrence:>2}: batch {run['batch_size']:>5}, "
                f"{run['epochs']:>2} epochs, {run['status']:<9} cost {run['cost']:>10.1f} "
                f"({run['seconds']} s)",
                flush=True,
            )
    if not runs["always-default"] or not runs["bso"]:
        print("no comparison: an arm ran no run (raise --max-epochs or lower --target)")
        return 1
    recurrences = len(runs["bso"])
    bso_total = sum(r["cost"] for r in runs["bso"])
    default_mean = statistics.fmean(r["cost"] for r in runs["always-default"])
    default_total = default_mean * recurrences
    (lane,) = service.status("recurring-bso").lanes
    energy = all(r["energy_measured"] for rs in runs.values() for r in rs)
    summary = {
        "device": args.device,
        "energy_measured": energy,
        "candidates": plan.batch_sizes,
        "default_batch_size": plan.default_batch_size,
        "bso_cumulative_cost": bso_total,
        "always_default_cumulative_cost": default_total,
        "ratio": bso_total / default_total,
        "recommended": lane.recommended_batch_size,
        "confidence": lane.confidence,
        "runs": runs,
    }
    print(
        f"bso over {recurrences} recurrences: {bso_total:.1f}; always-default "
        f"({len(runs['always-default'])} runs, mean {default_mean:.1f}, times {recurrences}): "
        f"{default_total:.1f}; ratio {summary['ratio']:.3f}; bso recommends "
        f"{lane.recommended_batch_size} at confidence {lane.confidence} "
        f"({'energy measured' if energy else 'time only: no energy measured'})"
    )
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
