"""Time and energy per epoch, summed over GPUs and ranks (bso_client.epoch_meter)."""

from __future__ import annotations

import pytest

from bso.errors import ServiceUnavailable
from bso.spec import Hardware
from bso_client.distributed import SingleProcess
from bso_client.energy.nvml import NvmlMonitor
from bso_client.energy.time_only import TimeOnlyMonitor
from bso_client.epoch_meter import EpochMeter, TrialTotals
from bso_client.testing import ConstantLoad, FakeClock, FakeGpu, FakeNvml
from tests.test_optimizer import RecordingService, make


def test_time_and_energy_are_cumulative_over_every_gpu() -> None:
    clock = FakeClock()
    nvml = FakeNvml([FakeGpu(load=ConstantLoad(0.5))] * 2, clock=clock)
    monitor = NvmlMonitor(nvml=nvml, clock=clock, environ={})
    service = RecordingService()
    bso = make(service, monitor=monitor)
    # Hardware comes from NVML: model, count and the per-GPU max power limit.
    assert bso.hardware == Hardware(gpu_model="NVIDIA A100-SXM4-40GB", gpu_count=2, max_power_w=400)
    assert bso.spec.hardware == bso.hardware
    bso.get_batch_size()
    bso.on_train_begin()
    clock.advance(10)
    bso.on_evaluate(0.1)
    clock.advance(100)
    bso.on_evaluate(0.2)
    reports = [kw for m, _, kw in service.calls if m == "report_epoch"]
    per_gpu_w = 60 + (400 - 60) * 0.5
    assert [r["time_s"] for r in reports] == pytest.approx([10, 110])
    assert [r["energy_j"] for r in reports] == pytest.approx(
        [2 * per_gpu_w * 10, 2 * per_gpu_w * 110], abs=0.01
    )
    next_trial = next(kw for m, _, kw in service.calls if m == "next_trial")
    assert next_trial["hardware"] == bso.hardware
    bso.close()
    assert nvml.initialized  # a monitor passed in belongs to the caller
    monitor.close()


def test_a_retried_report_reuses_its_event_id_and_measurement() -> None:
    # Call 4 (the second report) reaches the service but its reply is lost.
    service = RecordingService(fail_after={4})
    clock = FakeClock()
    bso = make(service, monitor=TimeOnlyMonitor(clock=clock), on_unavailable="raise")
    bso.get_batch_size()
    bso.on_train_begin()
    clock.advance(5)
    bso.on_evaluate(0.1)
    clock.advance(5)
    with pytest.raises(ServiceUnavailable, match="timeout_s"):
        bso.on_evaluate(0.2)
    clock.advance(30)  # time spent waiting for the service is not training
    assert not bso.on_evaluate(0.2).stop
    clock.advance(5)
    bso.on_evaluate(0.3)
    reports = [(eid, kw) for m, eid, kw in service.calls if m == "report_epoch"]
    assert [kw["epoch"] for _, kw in reports] == [1, 2, 2, 3]
    assert reports[1][0] == reports[2][0]
    assert reports[1][1] == reports[2][1]
    assert len({eid for eid, _ in reports}) == 3
    assert [kw["time_s"] for _, kw in reports] == [5, 10, 10, 15]
    assert service.trial(1).epochs == 3
    bso.close()


def test_training_before_the_first_window_is_counted_once_in_the_next_epoch() -> None:
    # A micro-batch exploration run before on_train_begin (bso_client.micro_batch_run).
    clock = FakeClock()
    monitor = TimeOnlyMonitor(clock=clock)
    meter = EpochMeter(SingleProcess(), monitor)
    meter.carry(2.0, 50.0)
    meter.start_epoch()
    clock.advance(3.0)
    assert meter.end_epoch() == TrialTotals(1, 5.0, 50.0)
    meter.reported()
    meter.start_epoch()
    clock.advance(1.0)
    assert meter.end_epoch() == TrialTotals(2, 6.0, 50.0)
