"""The metric a script hands ``on_evaluate``: what is accepted, and a warning when the
first epoch already meets the target.

**Types.**  A number: a Python ``int`` or ``float``, a numpy scalar or an array of
one value, a torch tensor of one value (``torch.tensor(0.9)`` or ``[0.9]``: any
array with ``.item()`` and one element, as ``float()`` took them before), a
``Decimal``.  Anything else (a string, None, a dict of metrics, a tensor of
several values, a bool) is refused
with :class:`~bso_client.errors.MetricTypeError`, a ``TypeError`` that says what
came: ``float("0.85")`` would be accepted by ``float()``, and ``float(None)``
fails with a message about ``float()`` from inside the client.  Nothing here
imports torch or numpy: a tensor is known by its shape and ``.item()``.

**The first epoch.**  A run whose first epoch already meets ``target_metric``
converges at once, and likely so does every run at every size: bso cannot tell sizes
apart and learns nothing.  The usual cause is a metric of the other direction (a
validation loss with ``higher_is_better_metric`` left True: any loss is above a
target of 0.35), else a target too easy to discriminate.  Rank 0 logs one
WARNING per run naming the metric, the target and the setting.
"""

from __future__ import annotations

import logging
import math
import numbers
from decimal import Decimal
from typing import SupportsFloat, cast

from bso.spec import JobSpec
from bso_client.errors import MetricTypeError

logger = logging.getLogger("bso_client.optimizer")
"""The optimizer's logger: users configure one name for everything a run says."""

EXPECTED = "a number (int, float, or a numpy array or torch tensor of one value)"

HINTS: dict[str, str] = {
    "str": "convert it with float() where it is read, if it is the metric",
    "None": "did the validation function return its value?",
    "dict": "pass the one metric the target applies to, e.g. metrics['accuracy']",
    "bool": "pass the metric itself, not whether it passed",
}


def metric_value(metric: object) -> float:
    """``metric`` as a float, or :class:`MetricTypeError` naming what came."""
    if _is_number(metric):
        return float(cast(SupportsFloat, metric))
    item = getattr(metric, "item", None)
    shape = getattr(metric, "shape", None)
    if isinstance(shape, tuple) and math.prod(shape) == 1 and callable(item):
        value = item()  # a tensor or array of one value: one number, moved to the host
        if _is_number(value):
            return float(cast(SupportsFloat, value))
    what = described(metric)
    hint = HINTS.get(what.split(" ")[0])
    raise MetricTypeError(
        f"on_evaluate expects {EXPECTED}, got {what}" + (f" ({hint})" if hint else "")
    )


def _is_number(value: object) -> bool:
    """A real number, not a bool (an ``int`` to Python, never a metric)."""
    return not isinstance(value, bool) and isinstance(value, numbers.Real | Decimal)


def described(metric: object) -> str:
    """What ``metric`` is, in a few words: its type, an array's shape, a short
    string's start (never more of the value than that)."""
    if metric is None:
        return "None"
    kind = type(metric)
    name = kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__name__}"
    if isinstance(metric, str):
        return f"str {metric[:20]!r}" + ("..." if len(metric) > 20 else "")
    shape = getattr(metric, "shape", None)
    if isinstance(shape, tuple):  # numpy's shapes; torch.Size is a tuple too
        return f"{name} of shape {tuple(shape)}"
    return name


class FirstEpochCheck:
    """One WARNING per run when its first epoch already meets the target."""

    def __init__(self) -> None:
        self.done = False

    def __call__(
        self, spec: JobSpec, job_id: str | None, trial_number: int | None, epoch: int, value: float
    ) -> None:
        if self.done or epoch != 1:
            return
        self.done = True
        if not (math.isfinite(value) and spec.metric_reached(value)):
            return
        higher = spec.higher_is_better_metric
        other = (
            "if the metric is a loss or an error (lower is better), set "
            "higher_is_better_metric=False"
            if higher
            else "if the metric is an accuracy or a score (higher is better), set "
            "higher_is_better_metric=True"
        )
        trial = f"trial {trial_number} of " if trial_number is not None else ""
        logger.warning(
            "bso: %sjob %s met its target at its first epoch (metric %s, target_metric %s, "
            "higher_is_better_metric=%s): a run that converges at once tells bso nothing "
            "about batch sizes. %s in the JobSpec (a new configuration: bso jobs delete %s "
            "first), or set a target that takes several epochs to reach",
            trial,
            job_id,
            f"{value:g}",
            f"{spec.target_metric:g}",
            higher,
            other[0].upper() + other[1:],
            job_id,
        )


def diverged_message(epoch: int, metric: float) -> str:
    """What a run whose metric is NaN or infinite is told.  At epoch 1 the script may
    never compute a number (an empty validation set, a division by zero): bso holds
    that against the size only when it repeats (``bso.core.outcomes``), and the user
    should hear both causes, not only the learning rate's."""
    message = f"the metric of epoch {epoch} is {metric}: training diverged"
    if epoch == 1:
        message += (
            ", or the validation code computes no number (an empty validation set, "
            "a division by zero)"
        )
    return message
