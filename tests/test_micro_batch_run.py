"""bso_client.micro_batch_run: the micro-batch exploration inside a real run, as a
training script drives it through BatchSizeOptimizer, against the in-process service.

Step times come from a fake clock that the model's forward pass advances by a
known per-sample cost of its pass size (fastest at 12 samples per pass), so what
the exploration should pick is known; the training itself is real torch."""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from bso.core.micro_batch import STOP_CONFIDENCE, MicroBatchChoice
from bso.service import BsoService
from bso.spec import Hardware, JobSpec
from bso.storage.memory import MemoryStore
from bso_client import BatchSizeOptimizer, reattachment
from bso_client import micro_batch_probe as probe_module
from bso_client import micro_batch_run as run_module
from bso_client.discovery import Discovery
from bso_client.energy.base import EnergyMonitor
from bso_client.energy.time_only import TimeOnlyMonitor
from bso_client.errors import OperationOrderError
from bso_client.integrations.batch_check import check_global_batch
from bso_client.integrations.hf import BsoHfCallback
from bso_client.integrations.lightning import BsoLightningCallback
from tests.test_fail_open import Switch
from tests.test_integrations import ScriptedModule, lightning_trainer

BATCH = 48
FASTEST = 12
SPEC = JobSpec(
    job_id="micro",
    batch_sizes=[BATCH],
    default_batch_size=BATCH,
    target_metric=0.9,
    max_epochs=3,
    mab_seed=1,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0
        self.rng = random.Random(5)

    def perf_counter(self) -> float:
        return self.now

    def pass_of(self, rows: int) -> None:
        """A pass of ``rows`` samples: per-sample time lowest at :data:`FASTEST`."""
        per_sample = 1e-3 * (1.0 + 0.3 * abs(math.log2(rows / FASTEST)))
        self.now += rows * per_sample * math.exp(self.rng.gauss(0, 0.02))


class TimedModel(torch.nn.Module):
    """A small MLP (no batch-dependent layers) whose passes advance the fake clock."""

    def __init__(self, clock: FakeClock | None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)
        )
        self.clock = clock

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.clock is not None:
            self.clock.pass_of(len(x))
        return self.net(x)  # type: ignore[no-any-return]


Batch = tuple[torch.Tensor, torch.Tensor]


def loader(steps: int = 400) -> Iterator[Batch]:
    """Per-device batches of :data:`BATCH` rows, the same on every call."""
    generator = torch.Generator().manual_seed(3)
    for _ in range(steps):
        yield (
            torch.randn(BATCH, 8, generator=generator),
            torch.randint(0, 3, (BATCH,), generator=generator),
        )


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(run_module, "time", SimpleNamespace(perf_counter=fake.perf_counter))
    return fake


@pytest.fixture
def service() -> BsoService:
    return BsoService(MemoryStore())


def optimizer_for(service: BsoService, **options: Any) -> BatchSizeOptimizer:
    return BatchSizeOptimizer(
        SPEC, service=service, monitor=TimeOnlyMonitor(), environ={}, **options
    )


def explore(
    bso: BatchSizeOptimizer, clock: FakeClock | None, batches: Iterator[Batch]
) -> MicroBatchChoice:
    model = TimedModel(clock)
    sgd = torch.optim.SGD(model.parameters(), lr=0.05)
    return bso.explore_micro_batch(
        model, sgd, torch.nn.functional.cross_entropy, batches, budget_steps=80
    )


def explored_run(service: BsoService, clock: FakeClock) -> None:
    """One run that explores with its whole budget and converges at its first epoch."""
    with optimizer_for(service) as first:
        first.get_batch_size()
        first.on_train_begin()
        explore(first, clock, loader())
        first.on_evaluate(0.95)


def test_a_run_finds_the_fastest_micro_batch_and_trains_at_it(
    service: BsoService, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="bso_client")
    batches = loader()
    with optimizer_for(service) as bso:
        assert bso.get_batch_size() == BATCH
        assert (bso.micro_batch_size, bso.accumulation_steps) == (BATCH, 1)
        bso.on_train_begin()
        choice = explore(bso, clock, batches)
        assert choice.micro_batch == FASTEST
        assert choice.confidence >= STOP_CONFIDENCE
        assert (bso.micro_batch_size, bso.accumulation_steps) == (FASTEST, BATCH // FASTEST)
        assert bso.per_device_batch_size == BATCH  # the global batch is untouched
        taken = 400 - sum(1 for _ in batches)
        assert 0 < taken <= 80
        bso.on_evaluate(0.5)
    interim = [
        r.getMessage() for r in caplog.records if "recommended micro_batch_size" in r.message
    ]
    assert interim
    assert all("x base, confidence score:" in line for line in interim)
    assert f"current recommended micro_batch_size: {FASTEST}" in interim[-1]
    final = [r.getMessage() for r in caplog.records if r.getMessage().startswith("bso micro-batch")]
    assert final == [
        f"bso micro-batch for batch size {BATCH}: {FASTEST} per pass x 4 pass(es), "
        f"{choice.performance:.2f}x the base {BATCH}, confidence {choice.score} (out of 100), "
        f"after {taken} step(s) this run and 0 before"
    ]
    # The timings went to the service with the epoch report.
    (lane,) = service.status("micro").lanes
    assert [(m.batch_size, m.micro_batch_size, m.runs) for m in lane.micro_batches] == [
        (BATCH, FASTEST, 1)
    ]


def test_a_run_detached_at_its_first_report_sends_the_timings_when_it_goes_back(
    clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The service was lost at the report that carried the exploration: the timings
    wait with the journal, and go with the first journaled epoch once the run is
    back (they used to be dropped)."""
    monkeypatch.setattr(reattachment, "LOOK_COST_SHARE", float("inf"))  # look every epoch
    switch = Switch()
    with BatchSizeOptimizer(
        SPEC, service=switch, monitor=TimeOnlyMonitor(), environ={}, heartbeat_interval_s=None
    ) as bso:
        bso.get_batch_size()
        bso.on_train_begin()
        explore(bso, clock, loader())
        switch.up = False
        bso.on_evaluate(0.5)
        assert bso.detached
        switch.up = True
        bso.on_evaluate(0.6)
        assert not bso.detached
    (lane,) = switch.service.status("micro").lanes
    assert [(m.batch_size, m.micro_batch_size, m.runs) for m in lane.micro_batches] == [
        (BATCH, FASTEST, 1)
    ]


def test_the_next_run_takes_the_learned_choice_without_exploring(
    service: BsoService, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    explored_run(service, clock)
    caplog.set_level(logging.INFO, logger="bso_client")
    with optimizer_for(service, explore_micro_batch=True) as second:
        second.get_batch_size()
        # Before any step: the split a DataLoader or a Trainer is built with.
        assert (second.micro_batch_size, second.accumulation_steps) == (FASTEST, 4)
        second.on_train_begin()
        batches = loader()
        again = explore(second, clock, batches)
        assert sum(1 for _ in batches) == 400  # not one batch taken
        assert again.micro_batch == FASTEST
        second.on_evaluate(0.95)
    assert any("learned from earlier runs" in r.getMessage() for r in caplog.records)
    # Without the setting, a run keeps the lane's split until it explores.
    with optimizer_for(service) as third:
        third.get_batch_size()
        assert third.micro_batch_size == BATCH


def test_discovery_turns_the_learned_choice_on(service: BsoService, clock: FakeClock) -> None:
    explored_run(service, clock)
    assert Discovery(factory=lambda: (None, None, None, None)).explore_micro_batch is False
    # A job that lists its sizes ignores the factory; the setting still applies.
    discovery = Discovery(factory=lambda: (None, None, None, None), explore_micro_batch=True)
    with optimizer_for(service, discovery=discovery) as second:
        second.get_batch_size()
        assert second.micro_batch_size == FASTEST


def test_training_through_the_exploration_matches_training_at_the_choice() -> None:
    """No batch-dependent layers: every exploration step is the update of one pass
    over the batch, so the weights end where a run at the choice from the start ends."""
    service = BsoService(MemoryStore())
    with optimizer_for(service) as bso:
        bso.get_batch_size()
        bso.on_train_begin()
        model = TimedModel(None)
        sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        batches = loader(30)
        bso.explore_micro_batch(
            model, sgd, torch.nn.functional.cross_entropy, batches, budget_steps=20
        )
        for batch in batches:  # the rest of the epoch at the choice
            run_module.accumulate(
                model, sgd, torch.nn.functional.cross_entropy, batch, micro=bso.micro_batch_size
            )
    reference = TimedModel(None)
    sgd = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    for batch in loader(30):
        run_module.accumulate(reference, sgd, torch.nn.functional.cross_entropy, batch, micro=BATCH)
    for mine, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.allclose(mine, theirs, atol=1e-5)


def test_it_is_refused_out_of_order_and_on_batches_of_another_size(clock: FakeClock) -> None:
    # A fresh service per case: each run that ends before an epoch is abandoned.
    bso = optimizer_for(BsoService(MemoryStore()))
    with bso, pytest.raises(OperationOrderError, match="after get_batch_size"):
        explore(bso, clock, loader())
    with optimizer_for(BsoService(MemoryStore())) as bso:
        bso.get_batch_size()
        bso.on_train_begin()
        wrong = iter([(torch.randn(64, 8), torch.randint(0, 3, (64,)))])
        with pytest.raises(ValueError, match=r"per-device batches of bso\.per_device_batch_size"):
            explore(bso, clock, wrong)
    with optimizer_for(BsoService(MemoryStore())) as bso:
        bso.get_batch_size()
        bso.on_train_begin()
        bso.on_evaluate(0.5)
        with pytest.raises(OperationOrderError, match="once, at the start of a run"):
            explore(bso, clock, loader())
    with optimizer_for(BsoService(MemoryStore())) as bso:
        bso.get_batch_size()
        model = TimedModel(clock)
        with pytest.raises(ValueError, match="expected_steps"):
            bso.explore_micro_batch(
                model,
                torch.optim.SGD(model.parameters(), lr=0.1),
                torch.nn.functional.cross_entropy,
                loader(),
            )


def test_a_short_loader_ends_the_exploration_with_what_was_timed(
    service: BsoService, clock: FakeClock
) -> None:
    with optimizer_for(service) as bso:
        bso.get_batch_size()
        bso.on_train_begin()
        choice = explore(bso, clock, loader(6))
        assert choice.micro_batch in (BATCH, 24)
        assert bso.micro_batch_size == choice.micro_batch


def test_the_hf_callback_splits_the_batch_as_learned(service: BsoService, clock: FakeClock) -> None:
    explored_run(service, clock)
    callback = BsoHfCallback(
        SPEC, service=service, metric="accuracy", monitor=TimeOnlyMonitor(), environ={},
        explore_micro_batch=True,
    )  # fmt: skip
    with callback:
        assert callback.per_device_train_batch_size == FASTEST
        assert callback.gradient_accumulation_steps == BATCH // FASTEST
        check_global_batch(
            callback.batch_size, FASTEST, BATCH // FASTEST, 1, "per_device_train_batch_size=..."
        )
        with pytest.raises(ValueError, match="per_device_train_batch_size"):
            check_global_batch(callback.batch_size, FASTEST, 1, 1, "per_device_train_batch_size")


def test_a_lightning_fit_trains_at_the_learned_split(service: BsoService, clock: FakeClock) -> None:
    explored_run(service, clock)
    callback = BsoLightningCallback(
        SPEC, service=service, metric="score", monitor=TimeOnlyMonitor(), environ={},
        explore_micro_batch=True,
    )  # fmt: skip
    module = ScriptedModule(callback)
    trainer = lightning_trainer(callback, max_epochs=1)
    trainer.fit(module)
    assert module.loader_batch_size == FASTEST
    assert trainer.accumulate_grad_batches == BATCH // FASTEST


def test_the_epochs_short_last_batch_is_trained_and_ends_the_exploration(clock: FakeClock) -> None:
    """A DataLoader without drop_last ends its epoch with fewer rows: that step is
    trained (passes weighted by their rows), not timed, and nothing is lost."""
    full = list(loader(5))
    short = (full[0][0][:20], full[0][1][:20])
    service = BsoService(MemoryStore())
    with optimizer_for(service) as bso:
        bso.get_batch_size()
        bso.on_train_begin()
        model = TimedModel(clock)
        sgd = torch.optim.SGD(model.parameters(), lr=0.05)
        choice = bso.explore_micro_batch(
            model, sgd, torch.nn.functional.cross_entropy, iter([*full, short]), budget_steps=80
        )
        assert bso.micro_batch_size == choice.micro_batch
    reference = TimedModel(None)
    sgd = torch.optim.SGD(reference.parameters(), lr=0.05)
    for batch in [*full, short]:
        run_module.accumulate(reference, sgd, torch.nn.functional.cross_entropy, batch, micro=64)
    for mine, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.allclose(mine, theirs, atol=1e-5)


def test_the_base_is_the_largest_pass_that_fits(
    service: BsoService, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="bso_client")
    with optimizer_for(service) as bso:
        bso.get_batch_size()
        bso.on_train_begin()
        model = TimedModel(clock)
        choice = bso.explore_micro_batch(
            model, torch.optim.SGD(model.parameters(), lr=0.05),
            torch.nn.functional.cross_entropy, loader(), budget_steps=0, largest_fitting=8,
        )  # fmt: skip
        assert choice.micro_batch == 8  # nothing timed: the base
        assert (bso.micro_batch_size, bso.accumulation_steps) == (8, 6)
    assert any("the base 8," in r.getMessage() for r in caplog.records)


def test_steps_before_on_train_begin_are_charged_to_the_first_epoch(clock: FakeClock) -> None:
    service = BsoService(MemoryStore())
    with optimizer_for(service) as bso:
        bso.get_batch_size()
        explore(bso, clock, loader())  # before on_train_begin: no epoch window open
        spent = clock.now
        bso.on_train_begin()
        bso.on_evaluate(0.5)
        with service.store.read("micro") as tx:
            (trial,) = tx.trials()
    assert trial.time_s >= spent > 0


def test_what_the_batches_must_be(clock: FakeClock) -> None:
    with optimizer_for(BsoService(MemoryStore())) as bso:
        bso.get_batch_size()
        bso.on_train_begin()
        with pytest.raises(TypeError, match=r"pass iter\(loader\)"):
            explore(bso, clock, list(loader(3)))  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="tuple or list"):
            explore(bso, clock, iter([{"x": torch.randn(BATCH, 8)}]))  # type: ignore[list-item]
        model = TimedModel(clock)
        with pytest.raises(ValueError, match="largest_fitting"):
            bso.explore_micro_batch(
                model, torch.optim.SGD(model.parameters(), lr=0.1),
                torch.nn.functional.cross_entropy, loader(), budget_steps=5, largest_fitting=0,
            )  # fmt: skip
        with pytest.raises(ValueError, match="budget_steps must be 0 or more"):
            bso.explore_micro_batch(
                model, torch.optim.SGD(model.parameters(), lr=0.1),
                torch.nn.functional.cross_entropy, loader(), budget_steps=-3,
            )  # fmt: skip


class PassEnergy(EnergyMonitor):
    """Energy per pass, lowest per sample at whole passes of the batch (power that
    rises faster than throughput at small passes), counted as the model runs them."""

    kind = "nvml"

    def __init__(self) -> None:
        super().__init__(
            Hardware(gpu_model="Fake GPU", gpu_count=1, max_power_w=300.0), time.monotonic
        )
        self.joules = 0.0

    @property
    def description(self) -> str:
        return "energy per pass, scripted"

    def pass_of(self, rows: int) -> None:
        self.joules += rows * (1.0 + 0.5 * abs(math.log2(rows / BATCH)))

    def _energy_j(self) -> float:
        return self.joules

    def _release(self) -> None:
        pass


class MeteredModel(TimedModel):
    def __init__(self, clock: FakeClock, monitor: PassEnergy) -> None:
        super().__init__(clock)
        self.monitor = monitor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.monitor.pass_of(len(x))
        return super().forward(x)


@pytest.mark.parametrize(("eta", "expected"), [(0.0, FASTEST), (1.0, BATCH)])
def test_the_choice_minimises_the_jobs_own_cost(
    clock: FakeClock, eta: float, expected: int
) -> None:
    """Time favours passes of 12, energy whole passes of 48: the job's eta decides."""
    monitor = PassEnergy()
    spec = SPEC.model_copy(update={"eta_knob": eta})
    with BatchSizeOptimizer(
        spec, service=BsoService(MemoryStore()), monitor=monitor, environ={}
    ) as bso:
        bso.get_batch_size()
        bso.on_train_begin()
        model = MeteredModel(clock, monitor)
        choice = bso.explore_micro_batch(
            model, torch.optim.SGD(model.parameters(), lr=0.05),
            torch.nn.functional.cross_entropy, loader(), budget_steps=80,
        )  # fmt: skip
    assert choice.micro_batch == expected


def test_a_discovery_factory_explores_before_training_until_settled(
    service: BsoService,
    clock: FakeClock,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """For trainers that own their loop: the exploration runs on the factory's model at
    get_batch_size (its steps are not the run's), and the split is the choice from the
    first step of training; the timings reach the service and settle later runs."""
    monkeypatch.setattr(probe_module, "time", SimpleNamespace(perf_counter=clock.perf_counter))
    caplog.set_level(logging.INFO, logger="bso_client")
    built: list[TimedModel] = []

    def factory() -> tuple[Any, ...]:
        model = TimedModel(clock)
        built.append(model)
        data = next(loader(1))
        return (
            model,
            torch.optim.SGD(model.parameters(), lr=0.05),
            lambda n: (data[0][:n], data[1][:n]),
            torch.nn.functional.cross_entropy,
        )

    discovery = Discovery(factory=factory, explore_micro_batch=True)
    callback = BsoHfCallback(
        SPEC, service=service, metric="accuracy", monitor=TimeOnlyMonitor(), environ={},
        discovery=discovery,
    )  # fmt: skip
    with callback:  # a Trainer's arguments are built from these, before training
        hf_split = (callback.per_device_train_batch_size, callback.gradient_accumulation_steps)
        callback.bso.on_train_begin()
        callback.bso.on_evaluate(0.95)
    assert hf_split == (FASTEST, BATCH // FASTEST)
    runs = []
    for _ in range(3):
        with optimizer_for(service, discovery=discovery) as bso:
            bso.get_batch_size()
            runs.append((bso.micro_batch_size, bso.accumulation_steps, len(built)))
            bso.on_train_begin()
            bso.on_evaluate(0.95)
    assert runs[0][:2] == runs[-1][:2] == (FASTEST, BATCH // FASTEST)
    assert runs[-1][2] == len(built) <= 3  # settled: the last run builds no model
    assert any("on the Discovery factory's model" in r.getMessage() for r in caplog.records)
    (lane,) = service.status("micro").lanes
    assert lane.micro_batches[0].micro_batch_size == FASTEST


def test_a_failing_factory_costs_the_run_nothing_but_its_exploration(
    service: BsoService, caplog: pytest.LogCaptureFixture
) -> None:
    def factory() -> tuple[Any, ...]:
        raise RuntimeError("the user's factory has a bug")

    with optimizer_for(
        service, discovery=Discovery(factory=factory, explore_micro_batch=True)
    ) as bso:
        assert bso.get_batch_size() == BATCH
        assert bso.micro_batch_size == BATCH  # the lane's split
        bso.on_train_begin()
        bso.on_evaluate(0.95)
    assert any(
        "exploration on the Discovery factory failed (RuntimeError" in r.getMessage()
        for r in caplog.records
    )


def test_the_factory_exploration_leaves_the_runs_random_state_and_the_loop_goes_on(
    service: BsoService, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plain loop with a Discovery: the factory's exploration at get_batch_size (which
    seeds and initialises a model) moves no random state of the run, and the loop's
    own exploration then goes on from it; the run reports both."""
    monkeypatch.setattr(probe_module, "time", SimpleNamespace(perf_counter=clock.perf_counter))

    def factory() -> tuple[Any, ...]:
        torch.manual_seed(1234)  # as factories do
        model = TimedModel(clock)
        data = next(loader(1))
        return (
            model, torch.optim.SGD(model.parameters(), lr=0.05),
            lambda n: (data[0][:n], data[1][:n]), torch.nn.functional.cross_entropy,
        )  # fmt: skip

    torch.manual_seed(0)
    expected = torch.rand(1)
    torch.manual_seed(0)
    with optimizer_for(
        service, discovery=Discovery(factory=factory, explore_micro_batch=True)
    ) as bso:
        bso.get_batch_size()
        assert torch.equal(torch.rand(1), expected)
        factory_steps = sum(t.steps for t in run_module.timings_from_wire(
            bso._running.unsent_timings if bso._running else None
        ).values())  # fmt: skip
        assert factory_steps > 0
        bso.on_train_begin()
        explore(bso, clock, loader())  # not refused: the loop's own exploration
        bso.on_evaluate(0.5)
    with service.store.read("micro") as tx:
        (trial,) = tx.trials()
    assert sum(t.steps for _, t in trial.micro_batches) >= factory_steps
