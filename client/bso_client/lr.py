"""Opt-in learning-rate scaling for a batch size other than the job's default.

A learning rate tuned for the default batch size is usually too small for a
larger batch (fewer, less noisy steps per epoch) and too large for a smaller
one.  bso never changes it by itself: the user calls one of these helpers with
the batch size bso chose, because a rule that suits one model can hurt another.

Rules, by optimizer family (``factor = batch_size / default_batch_size``):

* **linear** (``lr * factor``, Goyal et al. 2017) for plain stochastic
  gradient methods, whose step is proportional to the gradient: ``SGD``
  (with or without momentum / Nesterov) and ``ASGD``.
* **sqrt** (``lr * sqrt(factor)``, Malladi et al. 2022, "On the SDEs and
  Scaling Rules for Adaptive Gradient Algorithms") for adaptive methods, which
  divide the gradient by a running estimate of its magnitude, so that a larger
  batch's smaller gradient noise shrinks the effective step less than
  linearly: ``Adam``, ``AdamW``, ``Adamax``, ``NAdam``, ``RAdam``,
  ``SparseAdam``, ``RMSprop``, ``Adagrad``, ``Adadelta`` and ``Adafactor``.
  ``Adagrad`` belongs here too: its accumulated squared gradients normalise
  the step like Adam's second moment, only without decay.
* **none** where the step does not scale with the gradient noise at all:
  ``Rprop`` (sign of the gradient only) and ``LBFGS`` (full-batch line search).

Other optimizers (``Muon``, third-party ones) have no agreed rule: pass
``rule=`` explicitly.  Only the learning rate is scaled; Malladi et al. also
adjust Adam's betas and epsilon, which is left to the user.
"""

from __future__ import annotations

import math
from collections.abc import MutableMapping, Sequence
from enum import StrEnum
from typing import Any, Protocol


class ScalingRule(StrEnum):
    LINEAR = "linear"
    SQRT = "sqrt"
    NONE = "none"


_RULES: dict[str, ScalingRule] = {
    "SGD": ScalingRule.LINEAR,
    "ASGD": ScalingRule.LINEAR,
    **dict.fromkeys(
        (
            "Adam",
            "AdamW",
            "Adamax",
            "NAdam",
            "RAdam",
            "SparseAdam",
            "RMSprop",
            "Adagrad",
            "Adadelta",
            "Adafactor",
        ),
        ScalingRule.SQRT,
    ),
    "Rprop": ScalingRule.NONE,
    "LBFGS": ScalingRule.NONE,
}

UNSCALED_LR_KEY = "bso_unscaled_lr"
"""Param-group key keeping the learning rate from before scaling, so scaling is idempotent."""


class OptimizerLike(Protocol):
    """Anything with torch-style ``param_groups`` (dicts holding an ``"lr"``)."""

    @property
    def param_groups(self) -> Sequence[MutableMapping[str, Any]]: ...


def rule_for(optimizer: object) -> ScalingRule:
    """The rule of an optimizer instance, class or class name (subclasses inherit theirs).

    Matching by class name keeps torch out of the import and accepts
    look-alikes from other libraries that reuse torch's names.
    """
    if isinstance(optimizer, str):
        names = [optimizer]
    else:
        cls = optimizer if isinstance(optimizer, type) else type(optimizer)
        names = [klass.__name__ for klass in cls.__mro__]
    for name in names:
        if name in _RULES:
            return _RULES[name]
    raise ValueError(
        f"no known learning-rate scaling rule for {names[0]}: pass rule='linear', 'sqrt' "
        "or 'none' explicitly"
    )


def scale_factor(batch_size: int, default_batch_size: int, rule: ScalingRule | str) -> float:
    """How much to multiply a learning rate tuned at ``default_batch_size`` by."""
    if batch_size <= 0 or default_batch_size <= 0:
        raise ValueError(f"batch sizes must be positive, got {batch_size} and {default_batch_size}")
    ratio = batch_size / default_batch_size
    match ScalingRule(rule):
        case ScalingRule.LINEAR:
            return ratio
        case ScalingRule.SQRT:
            return math.sqrt(ratio)
        case ScalingRule.NONE:
            return 1.0


def scale_lr(lr: float, batch_size: int, default_batch_size: int, rule: ScalingRule | str) -> float:
    """``lr`` (tuned at ``default_batch_size``) adjusted for ``batch_size``."""
    return lr * scale_factor(batch_size, default_batch_size, rule)


def scale_optimizer_lr(
    optimizer: OptimizerLike,
    batch_size: int,
    default_batch_size: int,
    rule: ScalingRule | str | None = None,
) -> float:
    """Scale every param group's ``lr`` in place; returns the factor applied.

    ``rule=None`` picks it from the optimizer's class (see :func:`rule_for`).
    Each group remembers its unscaled rate under :data:`UNSCALED_LR_KEY`, so
    calling this again (a new batch size, a retry) scales from the original
    rate instead of compounding.  Call it before creating any LR scheduler:
    schedulers copy the groups' rates into ``initial_lr`` when created and
    would undo the scaling, so a group that already has one is refused.
    A tensor ``lr`` (capturable or fused optimizers) is updated in place,
    keeping the tensor the optimizer's kernels hold.
    """
    factor = scale_factor(
        batch_size, default_batch_size, rule_for(optimizer) if rule is None else rule
    )
    groups = optimizer.param_groups
    if any("initial_lr" in group for group in groups):
        raise ValueError(
            "an LR scheduler was already created on this optimizer: it would undo the "
            "scaling, so scale the learning rate before creating the scheduler"
        )
    for group in groups:
        lr = group["lr"]
        unscaled = float(group.setdefault(UNSCALED_LR_KEY, float(lr)))
        if isinstance(lr, int | float):
            group["lr"] = unscaled * factor
        else:
            lr.fill_(unscaled * factor)
    return factor


def grow_optimizer_lr(
    optimizer: OptimizerLike, old_batch_size: int, new_batch_size: int, rule: ScalingRule | str
) -> float:
    """Rescale a running optimizer's ``lr`` for a batch that grew mid-training; the factor.

    Unlike :func:`scale_optimizer_lr`, which sets the rate of a run about to
    start, this multiplies the rate where training has taken it (warm-up and
    decay included), and a scheduler's ``initial_lr`` with it, so that a
    scheduler that multiplies in place (StepLR, ExponentialLR, cosine's
    recursive form) carries on from the rescaled rate.
    """
    factor = scale_factor(new_batch_size, old_batch_size, rule)
    for group in optimizer.param_groups:
        lr = group["lr"]
        if isinstance(lr, int | float):
            group["lr"] = lr * factor
        else:
            lr.mul_(factor)
        if "initial_lr" in group:
            group["initial_lr"] = group["initial_lr"] * factor
    return factor
