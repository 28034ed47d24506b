"""A job's candidate batch sizes and its default, from the largest batch that fits.

:func:`~bso_client.batch_search.find_max_batch_size` measures the largest
batch size the hardware can run; :func:`candidate_batch_sizes`,
:func:`default_batch_size` and :func:`auto_batch_sizes` turn that maximum into
``batch_sizes`` and ``default_batch_size`` for a :class:`~bso.spec.JobSpec`
("batch sizes: auto").  Plain arithmetic: no probe, no torch.
"""

from __future__ import annotations

from typing import NamedTuple

from bso.errors import InvalidSpec
from bso.spec import MAX_BATCH_SIZE

__all__ = [
    "AutoBatchSizes",
    "auto_batch_sizes",
    "candidate_batch_sizes",
    "default_batch_size",
]

DEFAULT_MIN_BATCH_SIZE = 8
"""Smallest candidate :func:`candidate_batch_sizes` proposes by default.

Below 8 a step rarely uses the accelerator well (the cost per sample is
dominated by fixed per-step overheads), so such sizes are almost never the
cheapest, and every candidate costs the job exploration runs.
"""


def candidate_batch_sizes(
    max_batch_size: int,
    *,
    min_batch_size: int = DEFAULT_MIN_BATCH_SIZE,
    include_max: bool = True,
    step: int = 1,
) -> list[int]:
    """Candidate ``batch_sizes`` for a JobSpec: powers of two up to the maximum, and the maximum.

    Rationale:

    * Powers of two space the candidates evenly on a log scale, which is the
      scale on which time and energy to accuracy change with the batch size;
      a linear grid would spend most of its candidates on large sizes that
      differ little from each other.  Every candidate costs the job exploration
      runs, so few well-spread candidates beat many close ones.
    * They match what kernels, tensor-core tiles and data-parallel splits work
      best with, and what learning-rate recipes are usually given for.
    * The maximum itself (the largest size that fits, from
      :func:`~bso_client.batch_search.find_max_batch_size`) is added when it is
      not a power of two, so that bso can still discover that filling the
      device is cheapest.  Pass ``include_max=False`` to leave it out, e.g. to
      keep memory headroom for variable-length inputs.

    ``min_batch_size`` need not be a power of two: the list starts at the first
    power of two at or above it.  ``step``: every candidate is a multiple of it
    (a micro-batch): the candidates are then ``step`` times powers of two, and
    the maximum is rounded down to a multiple of ``step``.  Raises
    :class:`~bso.errors.InvalidSpec` when ``max_batch_size`` is below
    ``min_batch_size`` or above what a JobSpec accepts.
    """
    _check_max(max_batch_size)
    if min_batch_size < 1:
        raise ValueError(f"min_batch_size must be positive, got {min_batch_size}")
    if max_batch_size < min_batch_size:
        raise InvalidSpec(
            f"the largest batch size that fits ({max_batch_size}) is below min_batch_size "
            f"{min_batch_size}: lower min_batch_size, or give the job more memory"
        )
    if step < 1:
        raise ValueError(f"step must be positive, got {step}")
    sizes: list[int] = []
    size = step << max(-(-min_batch_size // step) - 1, 0).bit_length()  # first >= min
    while size <= max_batch_size:
        sizes.append(size)
        size *= 2
    top = max_batch_size - max_batch_size % step
    if include_max and top >= min_batch_size and top not in sizes:
        sizes.append(top)
    if not sizes:
        raise InvalidSpec(
            f"no power of two lies between min_batch_size {min_batch_size} and the maximum "
            f"{max_batch_size}, and include_max is False: there is no candidate left"
        )
    return sizes


def default_batch_size(
    max_batch_size: int,
    *,
    cap: int | None = None,
    min_batch_size: int = DEFAULT_MIN_BATCH_SIZE,
    step: int = 1,
) -> int:
    """The batch size a job starts from: the largest power of two within the maximum and ``cap``.

    bso runs the default first, and the user's learning rate and other
    hyperparameters are tuned for it, so it should be a size the job is known
    to train well at: set ``cap`` to the batch size those hyperparameters were
    tuned for (if they were tuned at 256, start there even if 2048 fits).
    Without ``cap`` the largest power of two that fits is taken.  A power of
    two is chosen rather than the maximum itself because the maximum sits
    right at the memory limit, where allocator fragmentation or a longer input
    can still tip a real run over.

    The result is always in :func:`candidate_batch_sizes` with the same
    ``max_batch_size``, ``min_batch_size`` and ``step`` (then it is ``step``
    times a power of two).  Raises
    :class:`~bso.errors.InvalidSpec` when no power of two lies between
    ``min_batch_size`` and ``min(max_batch_size, cap)``.
    """
    _check_max(max_batch_size)
    if cap is not None and cap < 1:
        raise ValueError(f"cap must be a positive batch size, got {cap}")
    bound = max_batch_size if cap is None else min(max_batch_size, cap)
    if bound < step:
        raise InvalidSpec(f"no multiple of {step} lies within min(max_batch_size, cap) = {bound}")
    size = step << ((bound // step).bit_length() - 1)  # largest step * 2^k <= bound
    if size < min_batch_size:
        raise InvalidSpec(
            f"no power of two lies between min_batch_size {min_batch_size} and "
            f"min(max_batch_size, cap) = {bound}: lower min_batch_size or raise the cap"
        )
    return size


class AutoBatchSizes(NamedTuple):
    """``batch_sizes`` and ``default_batch_size`` for a JobSpec, derived from the maximum."""

    batch_sizes: list[int]
    default_batch_size: int


def auto_batch_sizes(
    max_batch_size: int,
    *,
    min_batch_size: int = DEFAULT_MIN_BATCH_SIZE,
    default_cap: int | None = None,
    include_max: bool = True,
    step: int = 1,
) -> AutoBatchSizes:
    """Batch sizes "auto": :func:`candidate_batch_sizes` plus :func:`default_batch_size`.

    The two fields are consistent (the default is one of the candidates), so
    they can go straight into a :class:`~bso.spec.JobSpec`.
    """
    sizes = candidate_batch_sizes(
        max_batch_size, min_batch_size=min_batch_size, include_max=include_max, step=step
    )
    default = default_batch_size(
        max_batch_size, cap=default_cap, min_batch_size=min_batch_size, step=step
    )
    return AutoBatchSizes(batch_sizes=sizes, default_batch_size=default)


def _check_max(max_batch_size: int) -> None:
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be positive, got {max_batch_size}")
    if max_batch_size > MAX_BATCH_SIZE:
        raise InvalidSpec(
            f"max_batch_size {max_batch_size} is above {MAX_BATCH_SIZE}, the largest batch "
            "size a JobSpec accepts: pass a limit to the search"
        )
