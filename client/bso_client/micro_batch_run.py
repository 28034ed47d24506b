"""Micro-batch exploration inside a run: real training steps on the user's data.

:meth:`MicroBatchSteps.explore_micro_batch` (a method of
:class:`~bso_client.BatchSizeOptimizer`) runs the exploration of
:mod:`bso.core.micro_batch` at the start of a run: each step takes the next
per-device batch from the user's loader, runs it as passes of the micro-batch
being timed, accumulates their gradients (each pass's loss divided by the
passes) and steps the optimizer once.  So every step trains the model on the
user's global batch, whatever the micro-batch, and nothing is thrown away; the
update is the same up to float rounding and batch-dependent layers (BatchNorm's
statistics are per pass).

The steps are timed (and their energy read, where the run measures energy) and
costed with the job's eta, as everything in bso.  One log line per update gives
the recommendation, Cerebras-style; the run then trains at the choice
(:attr:`micro_batch_size` x :attr:`accumulation_steps`), and its timings go to
the service with the next epoch report.  The next run of the same lane and
global batch starts from every earlier run's timings, and with
``explore_micro_batch=True`` (or ``Discovery(explore_micro_batch=True)``) it
takes the learned micro-batch from its first call once the confidence reaches
:data:`~bso.core.micro_batch.STOP_CONFIDENCE`: the exploration is skipped, and
the Hugging Face and Lightning callbacks split the batch that way.

Data parallel: every rank runs the same exploration on rank 0's timings (and the
energy of every measuring rank), so all ranks take the same micro-batch at every
step; passes but the last run under the model's ``no_sync()`` where it has one.

Importing this module does not import torch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from bso.core.micro_batch import (
    DEFAULT_SHARE,
    STOP_CONFIDENCE,
    MicroBatchChoice,
    MicroBatchExploration,
    Timings,
    accumulation_steps,
    learned_choice,
    merge_timings,
    split_candidates,
    step_budget,
)
from bso.micro_batch_wire import timings_from_wire, timings_to_wire
from bso.spec import BatchSplit, Hardware, JobSpec
from bso.wire.events import TrialAssigned
from bso.wire.micro_batch_timings import MicroBatchTiming
from bso_client.call_order import CallOrder, Stage
from bso_client.discovery import Discovery
from bso_client.distributed import Collective, on_rank_zero
from bso_client.energy.base import EnergyMonitor
from bso_client.epoch_meter import EpochMeter
from bso_client.errors import OperationOrderError
from bso_client.global_state import preserved_global_state
from bso_client.micro_batch_probe import UPDATE_POINTS, explore_micro_batch
from bso_client.running_batch import RunningBatch

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

FACTORY_STEPS = 60
"""Optimizer steps a run may spend exploring on the Discovery factory's model (as
``bso probe --explore-micro-batch``'s default), until the choice is settled."""
WINDOW = "bso-micro-batch-step"
"""The energy monitor's window around one timed step, apart from the epoch's."""


class MicroBatchSteps:
    """The micro-batch half of :class:`~bso_client.BatchSizeOptimizer`."""

    spec: JobSpec
    hardware: Hardware
    _trial: TrialAssigned | None
    _running: RunningBatch | None
    _order: CallOrder
    _collective: Collective
    _monitor: EnergyMonitor | None
    _meter: EpochMeter
    _explore_micro: bool
    _discovery: Discovery | None

    def explore_micro_batch(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        batches: Iterator[Sequence[Any]],
        *,
        expected_steps: int | None = None,
        budget_steps: int | None = None,
        share: float = DEFAULT_SHARE,
        largest_fitting: int | None = None,
        device: str | torch.device | None = None,
    ) -> MicroBatchChoice:
        """Train the first steps of the run at candidate micro-batches; return the choice.

        ``batches``: an iterator over the run's per-device batches
        (``DataLoader(batch_size=bso.per_device_batch_size)``), each
        ``(inputs..., target)`` with :attr:`per_device_batch_size` rows; one is
        taken per step, so pass the iterator the epoch goes on with.
        ``expected_steps``: the run's optimizer steps (``len(loader) *
        max_epochs``), of which the exploration takes at most ``share``; or a
        fixed ``budget_steps``.  ``largest_fitting``: the largest pass that fits
        (``bso probe``'s maximum per device; by default the lane's pass).
        ``device``: where each batch is moved (None: left where it is).

        Afterwards :attr:`micro_batch_size` and :attr:`accumulation_steps` give
        the choice.  Call it once, after :meth:`get_batch_size` and before the
        first :meth:`on_evaluate` (steps taken before :meth:`on_train_begin`
        are added to the first epoch's time and energy); it takes no step when
        earlier runs already settled the choice.  The epoch's short last batch
        ends it: that step is trained, not timed.
        """
        running = self._micro_batch_stage()
        if not isinstance(batches, Iterator):
            raise TypeError(
                "batches must be an iterator: pass iter(loader) and go on with that iterator "
                "(a DataLoader itself would start the epoch over)"
            )
        earlier = timings_from_wire(self._trial.micro_batches if self._trial else None)
        # A Discovery factory's exploration at get_batch_size is this run's too: the
        # steps here go on from it, and the run reports both.
        factory = timings_from_wire(running.unsent_timings)
        known = merge_timings(earlier, factory)
        split = self.spec.split(running.start)
        exploration = MicroBatchExploration(
            *_options_and_base(split, largest_fitting),
            _budget(expected_steps, budget_steps, share),
            eta_knob=self.spec.eta_knob,
            max_power_w=self.hardware.total_max_power_w,
            known=known,
        )
        spent = (0.0, 0.0)
        last: MicroBatchChoice | None = None
        while (micro := exploration.next_micro_batch()) is not None:
            batch = next(batches, None)
            if batch is None:
                break  # the loader ran out: the epoch is over, keep what was timed
            rows = _rows(batch)
            if rows > split.per_device:
                raise ValueError(
                    f"a batch of {rows} rows is more than this device's share of batch size "
                    f"{running.start}: give per-device batches of bso.per_device_batch_size "
                    f"({split.per_device}) rows"
                )
            # The epoch's short last batch is trained at the choice so far, not timed:
            # a step of fewer samples costs otherwise.
            short = rows < split.per_device
            if short:
                micro = exploration.choice().micro_batch
            time_s, energy_j = self._timed_step(
                model, optimizer, loss_fn, batch, micro=micro, device=device
            )
            spent = (spent[0] + time_s, spent[1] + energy_j)
            if short:
                break
            exploration.record(micro, running.start, time_s, energy_j)
            choice = exploration.choice()
            if (
                last is None
                or choice.micro_batch != last.micro_batch
                or abs(choice.score - last.score) >= UPDATE_POINTS
            ):
                self._log("bso: %s", choice.log_line())
                last = choice
        if self._order.stage is Stage.ASSIGNED:  # before on_train_begin: no epoch is open
            self._meter.carry(*spent)
        choice = exploration.choice()
        running.micro_batch = choice.micro_batch
        running.explored = True
        running.unsent_timings = timings_to_wire(merge_timings(factory, exploration.run_timings()))
        self._log_choice(running.start, split, exploration, known, "this run")
        return choice

    def _settle_micro_batch(self) -> None:
        """At the start of a run with ``explore_micro_batch=True``: split the batch as
        earlier runs at this size settled, once they are sure enough (the rule that
        makes :meth:`explore_micro_batch` take no step); else, with a
        ``Discovery(explore_micro_batch=True)``, explore on its factory's model."""
        if not self._explore_micro or self._trial is None or self._running is None:
            return
        split = self.spec.split(self._running.start)
        known = timings_from_wire(self._trial.micro_batches)
        choice = learned_choice(known, split_candidates(split))
        if choice is not None and choice.confidence >= STOP_CONFIDENCE:
            self._running.micro_batch = choice.micro_batch
            self._log(
                "bso micro-batch for batch size %d: %d per pass x %d pass(es), learned from "
                "earlier runs (confidence %d); no exploration this run",
                self._running.start,
                choice.micro_batch,
                accumulation_steps(split.per_device, 1, choice.micro_batch),
                choice.score,
            )
        elif self._discovery is not None and self._discovery.explore_micro_batch:
            found = on_rank_zero(self._collective, lambda: self._explore_on_factory(split, known))
            if found is not None:
                self._running.micro_batch, self._running.unsent_timings = found

    def _explore_on_factory(
        self, split: BatchSplit, known: dict[int, Timings]
    ) -> tuple[int, list[MicroBatchTiming] | None] | None:
        """Rank 0: the exploration on the Discovery factory's model (its steps are not
        the run's training, and the model is the factory's own); None if it failed,
        which only costs the run the lane's split."""
        assert self._discovery is not None
        assert self._running is not None
        try:
            import torch

            # The factory seeds and initialises, the steps draw dropout: none of it
            # may move the run's own random state (the memory probe's rule).
            with preserved_global_state():
                model, optimizer, make_batch, loss_fn = self._discovery.factory()
                device = self._discovery.device or ("cuda" if torch.cuda.is_available() else "cpu")
                model.to(device)
                exploration = explore_micro_batch(
                    model, optimizer, make_batch, loss_fn,
                    global_batch=split.per_device, budget_steps=FACTORY_STEPS,
                    largest_fitting=split.micro_batch_size, base=split.micro_batch_size,
                    device=device, monitor=self._monitor, eta_knob=self.spec.eta_knob,
                    known=known, on_update=lambda c: self._log("bso: %s", c.log_line()),
                )  # fmt: skip
        except Exception as err:  # the exploration is optional: the run goes on
            logger.warning(
                "bso: the micro-batch exploration on the Discovery factory failed (%s: %s); "
                "this run trains at the lane's split",
                type(err).__name__,
                err,
            )
            return None
        self._log_choice(
            self._running.start, split, exploration, known, "on the Discovery factory's model"
        )
        return exploration.choice().micro_batch, timings_to_wire(exploration.run_timings())

    def _log_choice(
        self,
        batch_size: int,
        split: BatchSplit,
        exploration: MicroBatchExploration,
        known: dict[int, Timings],
        where: str,
    ) -> None:
        """The exploration's last line: the choice, against the base, and what it took."""
        choice = exploration.choice()
        self._log(
            "bso micro-batch for batch size %d: %d per pass x %d pass(es), %.2fx the base %d, "
            "confidence %d (out of 100), after %d step(s) %s and %d before",
            batch_size,
            choice.micro_batch,
            accumulation_steps(split.per_device, 1, choice.micro_batch),
            choice.performance,
            exploration.base,
            choice.score,
            exploration.steps_taken,
            where,
            sum(t.steps for t in known.values()),
        )

    def _micro_batch_stage(self) -> RunningBatch:
        if self._running is None or self._order.stage not in (Stage.ASSIGNED, Stage.TRAINING):
            raise OperationOrderError(
                "explore_micro_batch() comes after get_batch_size() and before the first "
                "on_evaluate()"
            )
        if self._running.explored or self._meter.epochs:
            raise OperationOrderError(
                "explore_micro_batch() runs once, at the start of a run (before the first "
                "on_evaluate())"
            )
        return self._running

    def _timed_step(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        batch: Sequence[Any],
        *,
        micro: int,
        device: str | torch.device | None,
    ) -> tuple[float, float]:
        """One optimizer step over ``batch`` in passes of ``micro``: rank 0's time and
        the energy of every measuring rank (each rank's own step, the same choice)."""
        if self._monitor is not None:
            self._monitor.begin_window(WINDOW)
        started = time.perf_counter()
        accumulate(model, optimizer, loss_fn, batch, micro=micro, device=device)
        elapsed = time.perf_counter() - started
        energy = self._monitor.end_window(WINDOW)[1] if self._monitor is not None else 0.0
        times = self._collective.all_gather(elapsed)
        return times[0], sum(self._collective.all_gather(energy))

    def _log(self, message: str, *args: object) -> None:
        if self._collective.rank == 0:
            logger.info(message, *args)


def _options_and_base(split: BatchSplit, largest_fitting: int | None) -> tuple[list[int], int]:
    """The candidates (divisors of the batch per device that fit) and the base: the
    lane's pass when it is one of them, else the largest."""
    if largest_fitting is not None and largest_fitting < 1:
        raise ValueError(f"largest_fitting must be a positive pass size, got {largest_fitting}")
    options = split_candidates(split, largest_fitting)
    lane_pass = split.micro_batch_size
    return options, lane_pass if lane_pass in options else max(options)


def _budget(expected_steps: int | None, budget_steps: int | None, share: float) -> int:
    if budget_steps is not None:
        if budget_steps < 0:
            raise ValueError(f"budget_steps must be 0 or more, got {budget_steps}")
        return budget_steps
    if expected_steps is None or expected_steps < 0:
        raise ValueError(
            "give expected_steps (the run's optimizer steps, e.g. len(loader) * max_epochs) "
            f"or budget_steps; got expected_steps={expected_steps}"
        )
    return step_budget(expected_steps, share)


def _rows(batch: Sequence[Any]) -> int:
    """Rows of a ``(inputs..., target)`` batch, every part having as many."""
    if not isinstance(batch, (tuple, list)) or len(batch) < 2:
        raise ValueError(
            "each batch must be a tuple or list (inputs..., target) of tensors with rows first, "
            f"got {type(batch).__name__}"
        )
    counts = {len(part) for part in batch}
    if len(counts) != 1:
        raise ValueError(f"the parts of a batch have {sorted(counts)} rows: they must agree")
    return counts.pop()


def accumulate(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    batch: Sequence[Any],
    *,
    micro: int,
    device: str | torch.device | None = None,
) -> None:
    """One optimizer step on ``batch`` (``(inputs..., target)``, rows first) as passes
    of ``micro`` rows (the last one shorter when ``micro`` does not divide them),
    each pass's loss weighted by its share of the rows: for a loss that averages
    over its batch, the update of one pass over the whole batch."""
    import contextlib

    import torch

    rows = _rows(batch)
    # Split where the batch is and move one pass at a time: a batch split because
    # it is large need not be on the device whole.
    chunks = list(zip(*(t.split(micro) for t in batch), strict=True))
    no_sync = getattr(model, "no_sync", None)
    optimizer.zero_grad(set_to_none=True)
    with torch.enable_grad():
        for index, chunk in enumerate(chunks):
            *inputs, target = (t.to(device) for t in chunk) if device is not None else chunk
            quiet = no_sync() if no_sync is not None and index < len(chunks) - 1 else None
            with quiet or contextlib.nullcontext():
                # Each pass's share of the rows: a mean loss over the whole batch.
                loss = loss_fn(model(*inputs), target) * (len(target) / rows)
                torch.autograd.backward(loss)
    optimizer.step()
    if isinstance(target, torch.Tensor) and target.device.type == "cuda":
        torch.cuda.synchronize(target.device)
