"""Does the micro-batch exploration pick the fastest?  Exhaustive timing against its picks.

For each model (an MLP, and a small convolutional network: two shapes of
work), every micro-batch of the global batch is timed for ``--steps`` optimizer
steps after a warm-up, in rotation (so that drift in the machine's load falls
on all of them alike): the exhaustive answer.  Then the exploration
(:func:`bso_client.micro_batch_probe.explore_micro_batch`) runs ``--repeats``
times with a budget of ``--budget`` steps, and each pick's throughput, from the
exhaustive timing, is compared with the best's.  Prints per model the
exhaustive table, then per repeat the pick, its confidence, the steps it took,
and its throughput as a share of the best's.

    .venv/bin/python scripts/bench_micro_batch.py
    .venv/bin/python scripts/bench_micro_batch.py --global-batch 512 --budget 40 --device cuda
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from bso.core.micro_batch import candidates
from bso_client.micro_batch_probe import accumulated_step, explore_micro_batch

Setup = tuple[torch.nn.Module, torch.optim.Optimizer, Callable[[int], tuple[Any, ...]], Any]


def mlp(device: torch.device) -> Setup:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024),
        torch.nn.ReLU(), torch.nn.Linear(1024, 10),
    ).to(device)  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def make_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(n, 256, device=device), torch.randint(0, 10, (n,), device=device)

    return model, optimizer, make_batch, torch.nn.functional.cross_entropy


def convnet(device: torch.device) -> Setup:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(32, 64, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(64 * 8 * 8, 10),
    ).to(device)  # fmt: skip
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def make_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(n, 3, 32, 32, device=device), torch.randint(0, 10, (n,), device=device)

    return model, optimizer, make_batch, torch.nn.functional.cross_entropy


MODELS: dict[str, Callable[[torch.device], Setup]] = {"mlp": mlp, "convnet": convnet}


def exhaustive(
    setup: Setup, global_batch: int, steps: int, device: torch.device
) -> dict[int, float]:
    """Median seconds per sample of every micro-batch, timed in rotation."""
    model, optimizer, make_batch, loss_fn = setup
    options = candidates(global_batch)
    times: dict[int, list[float]] = {m: [] for m in options}
    for round_ in range(steps + 1):
        for micro in options:
            started = time.perf_counter()
            accumulated_step(
                model, optimizer, make_batch, loss_fn,
                per_device=global_batch, micro_batch=micro, device=device,
            )  # fmt: skip
            if round_:  # the first round warms up
                times[micro].append((time.perf_counter() - started) / global_batch)
    return {m: statistics.median(v) for m, v in times.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--global-batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20, help="exhaustive steps per micro-batch")
    parser.add_argument("--budget", type=int, default=30, help="the exploration's step budget")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--threads", type=int, help="torch's CPU threads (default: its own)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(f"global batch {args.global_batch} on {device}; torch threads {torch.get_num_threads()}")
    for name in args.models.split(","):
        setup = MODELS[name](device)
        truth = exhaustive(setup, args.global_batch, args.steps, device)
        fastest = min(truth, key=lambda m: truth[m])
        print(f"\n{name}: exhaustive, {args.steps} steps each (median ms per sample)")
        for micro, seconds in sorted(truth.items(), reverse=True):
            mark = "  fastest" if micro == fastest else ""
            print(f"  {micro:>5} {seconds * 1000:>9.4f}  {truth[fastest] / seconds:>6.1%}{mark}")
        shares = []
        for repeat in range(args.repeats):
            model, optimizer, make_batch, loss_fn = setup
            found = explore_micro_batch(
                model, optimizer, make_batch, loss_fn,
                global_batch=args.global_batch, budget_steps=args.budget, device=args.device,
            )  # fmt: skip
            choice = found.choice()
            share = truth[fastest] / truth[choice.micro_batch]
            shares.append(share)
            print(
                f"  repeat {repeat + 1}: picked {choice.micro_batch} at confidence "
                f"{choice.score}, {found.steps_taken} steps of {args.budget}; "
                f"{share:.1%} of the fastest's throughput"
            )
        print(
            f"{name}: worst pick {min(shares):.1%} of the fastest's throughput, "
            f"mean {statistics.fmean(shares):.1%} ({args.repeats} repeats)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
