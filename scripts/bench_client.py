"""Cost of the client's per-epoch work in the training loop.

Parts, each run by name (all by default)::

    .venv/bin/python scripts/bench_client.py [energy] [optimizer] [--epochs N]

* ``energy``: one epoch's ``begin_window`` + ``end_window`` for every energy
  monitor (target: a median under 1 ms per epoch; the p99 mostly shows how
  busy the machine is), with the fake NVML, a fake RAPL
  tree, and the real NVML / RAPL where this machine has them; then the CPU the
  background power-sampling thread takes.

* ``optimizer``: the client-side cost of one ``BatchSizeOptimizer.on_evaluate``
  (see the section's docstring), target: a median under 1 ms.

Figures with the fake NVML include the fake's own Python work (a lock and the
exact energy integral per call), so they bound what the monitor adds; a real
NVML call is a driver round trip of a few to some tens of microseconds.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bso.core.vocabulary import TrialPhase
from bso.service import BsoService
from bso.spec import Hardware, JobSpec
from bso.storage.memory import MemoryStore
from bso.wire.events import EpochDecision, JobRegistered, TrialAssigned, TrialEnded
from bso_client.energy.base import EnergyMonitor
from bso_client.energy.nvml import NvmlMonitor
from bso_client.energy.rapl import RaplMonitor
from bso_client.energy.time_only import TimeOnlyMonitor
from bso_client.errors import NvmlUnavailableError, RaplUnavailableError
from bso_client.optimizer import BatchSizeOptimizer
from bso_client.service_calls import BsoServiceLike
from bso_client.testing import ConstantLoad, FakeGpu, FakeNvml, SineLoad

TARGET_US = 1000.0
NO_ENV: dict[str, str] = {}


def _epoch_costs_us(monitor: EnergyMonitor, epochs: int) -> list[float]:
    """Microseconds spent in begin_window + end_window, per epoch."""
    costs = []
    for _ in range(epochs):
        start = time.perf_counter_ns()
        monitor.begin_window()
        monitor.end_window()
        costs.append((time.perf_counter_ns() - start) / 1000)
    return costs


def _report(label: str, monitor: EnergyMonitor, epochs: int) -> None:
    with monitor:
        _epoch_costs_us(monitor, min(epochs, 100))  # warm up
        costs = sorted(_epoch_costs_us(monitor, epochs))
    median = statistics.median(costs)
    p99 = costs[min(len(costs) - 1, int(0.99 * len(costs)))]
    verdict = "ok" if median < TARGET_US else "OVER TARGET"
    print(
        f"  {label:<44} median {median:7.1f} us  mean {statistics.fmean(costs):7.1f} us  "
        f"p99 {p99:8.1f} us  {verdict}"
    )


def _fake_gpus(count: int, counter: bool) -> list[FakeGpu]:
    return [
        FakeGpu(load=SineLoad(0.5, 0.3, period_s=2.0), energy_counter=counter) for _ in range(count)
    ]


def _fake_rapl(root: Path, packages: int) -> None:
    for i in range(packages):
        domain = root / f"intel-rapl:{i}"
        domain.mkdir()
        (domain / "name").write_text(f"package-{i}\n")
        (domain / "energy_uj").write_text("123456789\n")
        (domain / "max_energy_range_uj").write_text("262143328850\n")
        (domain / "constraint_0_power_limit_uw").write_text("150000000\n")


def _sampling_cpu_share(gpus: int, interval_s: float, seconds: float = 1.0) -> float:
    """Share of one core the sampling thread takes while the training loop sleeps."""
    nvml = FakeNvml(_fake_gpus(gpus, counter=False))
    with NvmlMonitor(nvml=nvml, environ=NO_ENV, sample_interval_s=interval_s):
        cpu = time.process_time()
        time.sleep(seconds)
        return (time.process_time() - cpu) / seconds


def bench_energy(epochs: int) -> None:
    print(f"energy monitor, begin_window + end_window per epoch ({epochs} epochs):")
    for label, gpus in (
        ("fake NVML, 1 GPU, energy counter", [FakeGpu(load=ConstantLoad(0.7))]),
        ("fake NVML, 8 GPUs, energy counters", _fake_gpus(8, counter=True)),
        ("fake NVML, 8 GPUs, power sampling", _fake_gpus(8, counter=False)),
        ("fake NVML, 8 GPUs, 4 counters + 4 sampled", _fake_gpus(4, True) + _fake_gpus(4, False)),
    ):
        nvml = FakeNvml(gpus)
        _report(label, NvmlMonitor(nvml=nvml, environ=NO_ENV), epochs)
    with tempfile.TemporaryDirectory() as tmp:
        _fake_rapl(Path(tmp), packages=2)
        _report("RAPL on a fake sysfs tree, 2 packages", RaplMonitor(Path(tmp)), epochs)
    _report("time only", TimeOnlyMonitor(), epochs)

    real: list[tuple[str, Callable[[], EnergyMonitor]]] = [
        ("real NVML, all visible GPUs", NvmlMonitor),
        ("real RAPL", RaplMonitor),
    ]
    for label, make in real:
        try:
            monitor = make()
        except (NvmlUnavailableError, RaplUnavailableError) as err:
            print(f"  {label:<44} not available here: {err}")
            continue
        _report(f"{label} ({monitor.description})", monitor, epochs)

    print("power-sampling thread, CPU share of one core while the loop sleeps:")
    for count, interval_s in ((1, 0.1), (8, 0.1), (8, 0.01)):
        share = _sampling_cpu_share(count, interval_s)
        print(f"  fake NVML, {count} sampled GPU(s), every {interval_s:g} s: {share:.2%}")


# --- optimizer: the client's own work per on_evaluate ----------------------------------
#
# What one on_evaluate costs the training loop besides the service's answer: the
# monitor's window (end + begin), the event id, building the report, the state
# machine, and (not distributed here) the collectives' single-process no-ops.  The
# service call is excluded by timing every call into the service and subtracting
# it: once with a service that answers at once with a fixed reply (the floor), once
# with the real in-process BsoService (whose decision time is then left out too).


class _InstantService:
    """Answers every call at once with a fixed reply: no decision, no store."""

    def register(self, spec: JobSpec, *, event_id: str) -> JobRegistered:
        return JobRegistered(event_id=event_id, job_id=spec.job_id or "bench", created=True)

    def next_trial(
        self, job_id: str, hardware: Hardware | None = None, *, event_id: str
    ) -> TrialAssigned:
        return TrialAssigned(
            event_id=event_id,
            job_id=job_id,
            trial_number=1,
            batch_size=64,
            phase=TrialPhase.EXPLORATION,
        )

    def report_epoch(
        self, job_id: str, trial_number: int, *, epoch: int, event_id: str, **report: Any
    ) -> EpochDecision:
        return EpochDecision(
            event_id=event_id,
            job_id=job_id,
            trial_number=trial_number,
            epoch=epoch,
            stop=False,
            converged=False,
            reason=None,
            cost=0.0,
        )

    def end_trial(self, job_id: str, trial_number: int, *, event_id: str) -> TrialEnded:
        raise AssertionError("the bench never ends its trial")


class _TimedService:
    """Forwards to ``inner`` and adds up the nanoseconds spent inside each call."""

    def __init__(self, inner: BsoServiceLike) -> None:
        self.inner = inner
        self.inside_ns = 0

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method: Callable[..., Any] = getattr(self.inner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter_ns()
            try:
                return method(*args, **kwargs)
            finally:
                self.inside_ns += time.perf_counter_ns() - start

        return timed


def _client_costs_us(bso: BatchSizeOptimizer, service: _TimedService, epochs: int) -> list[float]:
    """Microseconds per on_evaluate, minus the time spent inside the service."""
    costs = []
    for epoch in range(epochs):
        service.inside_ns = 0
        start = time.perf_counter_ns()
        bso.on_evaluate(epoch / (10 * epochs))
        costs.append((time.perf_counter_ns() - start - service.inside_ns) / 1000)
    return costs


def _report_optimizer(
    label: str, inner: BsoServiceLike, monitor: EnergyMonitor, epochs: int
) -> None:
    spec = JobSpec(
        job_id="bench",
        batch_sizes=[32, 64, 128],
        default_batch_size=64,
        target_metric=1.0,  # never reached: the trial runs as long as the bench
        max_epochs=100_000,
    )
    service = _TimedService(inner)
    with monitor:
        bso = BatchSizeOptimizer(spec, service=service, monitor=monitor, environ=NO_ENV)
        bso.get_batch_size()
        bso.on_train_begin()
        _client_costs_us(bso, service, min(epochs, 100))  # warm up
        costs = sorted(_client_costs_us(bso, service, epochs))
    median = statistics.median(costs)
    p99 = costs[min(len(costs) - 1, int(0.99 * len(costs)))]
    verdict = "ok" if median < TARGET_US else "OVER TARGET"
    print(
        f"  {label:<52} median {median:7.1f} us  mean {statistics.fmean(costs):7.1f} us  "
        f"p99 {p99:8.1f} us  {verdict}"
    )


def bench_optimizer(epochs: int) -> None:
    print(f"optimizer, client side of on_evaluate, service time excluded ({epochs} epochs):")
    for service_label, make_service in (
        ("instant service", _InstantService),
        ("in-process BsoService", lambda: BsoService(MemoryStore())),
    ):
        _report_optimizer(f"{service_label}, time only", make_service(), TimeOnlyMonitor(), epochs)
        nvml = FakeNvml(_fake_gpus(8, counter=True))
        monitor = NvmlMonitor(nvml=nvml, environ=NO_ENV)
        _report_optimizer(f"{service_label}, fake NVML 8 GPUs", make_service(), monitor, epochs)


PARTS: dict[str, Callable[[int], None]] = {"energy": bench_energy, "optimizer": bench_optimizer}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("parts", nargs="*", help=f"any of {', '.join(PARTS)} (default: all)")
    parser.add_argument("--epochs", type=int, default=2000)
    args = parser.parse_args()
    unknown = sorted(set(args.parts) - set(PARTS))
    if unknown:
        parser.error(f"unknown parts {unknown}; choose from {', '.join(PARTS)}")
    for name in args.parts or PARTS:
        PARTS[name](args.epochs)


if __name__ == "__main__":
    main()
