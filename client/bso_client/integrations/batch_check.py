"""The one check both trainer callbacks make: the trainer runs the batch bso chose."""

from __future__ import annotations


def check_global_batch(
    bso_batch_size: int, per_pass: int, accumulation: int, world_size: int, fix: str
) -> None:
    """Raise ``ValueError`` unless ``per_pass x accumulation x world_size`` is bso's size.

    A trainer that runs another batch than bso chose (the per-device size set to
    bso's global one under data parallelism, accumulation forgotten) would have
    bso charge that run's cost to the wrong size and learn the wrong answer;
    failing before the first step costs the user one restart.
    """
    runs = per_pass * accumulation * world_size
    if runs != bso_batch_size:
        raise ValueError(
            f"the trainer would run batches of {runs} samples ({per_pass} per pass x "
            f"{accumulation} accumulated passes x {world_size} devices), but bso chose "
            f"{bso_batch_size} (a global batch, per optimizer step): set {fix}"
        )


def refuse_growth(options: dict[str, object]) -> None:
    """Trainers build their DataLoader once, so a callback cannot grow the batch: it
    would report sizes that never ran.  Refuse ``growth=`` rather than lie."""
    if options.get("growth") is not None:
        raise ValueError(
            "growth= is not supported by the trainer callbacks (the trainer keeps the batch "
            "size it built its DataLoader with); use BatchSizeOptimizer in your own loop"
        )
