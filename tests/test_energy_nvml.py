"""GPU energy and hardware through NVML, against the fake NVML (bso_client.energy.nvml)."""

from __future__ import annotations

import time
import warnings

import pynvml
import pytest

from bso.errors import InvalidSpec
from bso_client.energy.base import EnergyFallbackWarning
from bso_client.energy.detect import detect_monitor
from bso_client.energy.nvml import NvmlMonitor, discover_hardware, select_gpus, visible_gpus
from bso_client.errors import MixedGpuModels, NvmlUnavailableError
from bso_client.testing import (
    ConstantLoad,
    FakeClock,
    FakeGpu,
    FakeNvml,
    PiecewiseLinearLoad,
    SineLoad,
)
from tests.fixtures.energy import A100, NO_ENV, P100, V100, bso_threads, gpu, old_gpu

# --- counter path ----------------------------------------------------------


def test_counter_path_measures_exact_energy_without_sampling() -> None:
    clock = FakeClock()
    nvml = FakeNvml([FakeGpu(load=SineLoad(0.5, 0.5, period_s=7.0))], clock=clock)
    with NvmlMonitor(nvml=nvml, environ=NO_ENV, clock=clock) as monitor:
        assert monitor.counter_gpus == [0]
        assert monitor.sampled_gpus == []
        assert not monitor.sampling_thread_alive
        clock.advance(2.0)
        start = clock()
        monitor.begin_window()
        clock.advance(10.0)
        elapsed_s, energy_j = monitor.end_window()
    assert elapsed_s == 10.0
    assert energy_j == pytest.approx(nvml.energy_j(0, start, start + 10.0), abs=2e-3)
    assert nvml.calls["nvmlDeviceGetPowerUsage"] == 0
    assert not nvml.initialized


# --- sampling path ----------------------------------------------------------


def test_sampling_path_integrates_by_trapezoids_between_reads() -> None:
    """Power ramps up for 100 s, then stays flat; window reads add samples too.

    The thread's interval is longer than the test, so only the reads at window
    boundaries sample: trapezoids over them are exact on each straight stretch.
    """
    clock = FakeClock()
    ramp = PiecewiseLinearLoad(((0.0, 0.0), (100.0, 1.0)))
    nvml = FakeNvml([FakeGpu(load=ramp, energy_counter=False)], clock=clock)
    with NvmlMonitor(nvml=nvml, environ=NO_ENV, clock=clock, sample_interval_s=60) as monitor:
        assert monitor.sampled_gpus == [0]
        clock.advance(20.0)
        start = clock()
        monitor.begin_window()
        clock.advance(80.0)
        monitor.begin_window("probe")  # a sample at the kink of the curve
        clock.advance(10.0)
        measured = monitor.end_window()
    assert measured.elapsed_s == 90.0
    # 60 W + 340 W * t / 100 s from 20 s to 100 s (4800 J + 16320 J), then 400 W for 10 s.
    assert measured.energy_j == pytest.approx(4800.0 + 16320.0 + 4000.0, abs=0.1)
    assert measured.energy_j == pytest.approx(nvml.energy_j(0, start, start + 90.0), abs=0.1)


def test_sampling_thread_integrates_a_curved_power_draw() -> None:
    """Real time: the window's ends alone would miss the pulse in the middle."""
    pulse = PiecewiseLinearLoad(((0.0, 0.0), (0.05, 0.0), (0.15, 1.0), (0.25, 0.0)))
    nvml = FakeNvml([FakeGpu(load=pulse, energy_counter=False)])
    with NvmlMonitor(nvml=nvml, environ=NO_ENV, sample_interval_s=0.002) as monitor:
        start = time.monotonic()
        monitor.begin_window()
        time.sleep(0.3)
        measured = monitor.end_window()
    truth = nvml.energy_j(0, start, start + measured.elapsed_s)
    ends_only = 60.0 * measured.elapsed_s
    assert truth - ends_only == pytest.approx(340.0 * 0.1, rel=0.05)  # the pulse: 34 J
    assert measured.energy_j == pytest.approx(truth, rel=0.05)
    assert nvml.calls["nvmlDeviceGetPowerUsage"] > 20


# --- several GPUs -------------------------------------------------------------


def test_mixed_support_counts_some_gpus_and_samples_others() -> None:
    clock = FakeClock()
    gpus = [gpu(1.0, name=P100), FakeGpu(name=P100, energy_counter=False, load=ConstantLoad(0.25))]
    nvml = FakeNvml(gpus, clock=clock)
    with NvmlMonitor(nvml=nvml, environ=NO_ENV, clock=clock, sample_interval_s=0.001) as monitor:
        assert (monitor.counter_gpus, monitor.sampled_gpus) == ([0], [1])
        assert monitor.sampling_thread_alive
        assert "energy counter on GPUs [0]" in monitor.description
        assert "power sampled every 0.001 s on GPUs [1]" in monitor.description
        monitor.begin_window()
        clock.advance(10.0)
        energy_j = monitor.end_window().energy_j
    assert energy_j == pytest.approx(4000.0 + 1450.0, abs=0.05)


def test_energy_of_all_gpus_is_summed() -> None:
    clock = FakeClock()
    loads = [0.0, 0.25, 0.5, 1.0]
    nvml = FakeNvml([gpu(load) for load in loads], clock=clock)
    with NvmlMonitor(nvml=nvml, environ=NO_ENV, clock=clock) as monitor:
        assert monitor.hardware.gpu_count == 4
        start = clock()
        monitor.begin_window()
        clock.advance(5.0)
        nvml.set_load(0, ConstantLoad(1.0))
        clock.advance(5.0)
        energy_j = monitor.end_window().energy_j
    truth = sum(nvml.energy_j(i, start, start + 10.0) for i in range(4))
    assert truth == pytest.approx(10 * (60 + 145 + 230 + 400) + 5 * 340)
    assert energy_j == pytest.approx(truth, abs=0.01)


def test_a_gpu_without_energy_or_power_is_left_out_with_a_warning() -> None:
    clock = FakeClock()
    blind = FakeGpu(energy_counter=False, power_sensor=False)
    nvml = FakeNvml([gpu(1.0), blind], clock=clock)
    with pytest.warns(EnergyFallbackWarning, match=r"GPUs \[1\] report neither"):
        monitor = NvmlMonitor(nvml=nvml, environ=NO_ENV, clock=clock)
    with monitor:
        assert monitor.unmeasured_gpus == [1]
        assert not monitor.sampling_thread_alive
        monitor.begin_window()
        clock.advance(1.0)
        assert monitor.end_window().energy_j == pytest.approx(400.0, abs=1e-2)
    # With no GPU measurable at all, NVML is no better than the fallbacks.
    all_blind = FakeNvml([blind, blind])
    with pytest.raises(NvmlUnavailableError, match="neither energy nor power"):
        NvmlMonitor(nvml=all_blind, environ=NO_ENV)
    assert not all_blind.initialized


def test_mixed_gpu_models_raise_a_typed_error_naming_them() -> None:
    nvml = FakeNvml([gpu(name=A100), gpu(name=V100)])
    with pytest.raises(MixedGpuModels) as caught:
        NvmlMonitor(nvml=nvml, environ=NO_ENV)
    assert isinstance(caught.value, InvalidSpec)
    assert A100 in caught.value.message
    assert V100 in caught.value.message
    assert not nvml.initialized  # the failed monitor gave its NVML reference back
    with pytest.raises(MixedGpuModels):
        detect_monitor(nvml=nvml, environ=NO_ENV)


# --- hardware and GPU selection ----------------------------------------------


def test_discover_hardware_reads_model_count_and_max_power_per_gpu() -> None:
    gpus = [FakeGpu(name=V100, power_limits_w=(150.0, 300.0))] * 3
    nvml = FakeNvml(gpus, names_as_bytes=True)
    hardware = discover_hardware(nvml=nvml, environ=NO_ENV)
    assert (hardware.gpu_model, hardware.gpu_count, hardware.max_power_w) == (V100, 3, 300.0)
    assert hardware.total_max_power_w == 900.0
    assert not nvml.initialized


def test_missing_power_limits_fall_back_to_the_default_with_a_warning() -> None:
    nvml = FakeNvml([FakeGpu(power_limits_w=None)])
    with pytest.warns(EnergyFallbackWarning, match="power limits"):
        hardware = discover_hardware(nvml=nvml, environ=NO_ENV, default_max_power_w=250.0)
    assert hardware.max_power_w == 250.0


def test_cuda_visible_devices_is_honoured() -> None:
    nvml = FakeNvml([gpu(), gpu(), gpu(), gpu(uuid="GPU-deadbeef-1234")])
    nvml.nvmlInit()
    assert visible_gpus(nvml, {}) == [0, 1, 2, 3]
    assert visible_gpus(nvml, {"CUDA_VISIBLE_DEVICES": "2, 0"}) == [2, 0]
    assert visible_gpus(nvml, {"CUDA_VISIBLE_DEVICES": "GPU-dead,1"}) == [3, 1]
    assert visible_gpus(nvml, {"CUDA_VISIBLE_DEVICES": "1,-1,2"}) == [1]  # stops like CUDA
    assert visible_gpus(nvml, {"CUDA_VISIBLE_DEVICES": "1,7"}) == [1]
    assert visible_gpus(nvml, {"CUDA_VISIBLE_DEVICES": "GPU-0"}) == []  # ambiguous prefix
    assert visible_gpus(nvml, {"CUDA_VISIBLE_DEVICES": ""}) == []
    with pytest.raises(NvmlUnavailableError, match="MIG"):
        visible_gpus(nvml, {"CUDA_VISIBLE_DEVICES": "MIG-4a2b"})
    # gpu_indices are CUDA ordinals: cuda:1 under CUDA_VISIBLE_DEVICES=2,3 is GPU 3.
    env = {"CUDA_VISIBLE_DEVICES": "2,3"}
    assert select_gpus(nvml, [1], env) == [3]
    with pytest.raises(ValueError, match="out of range"):
        select_gpus(nvml, [2], env)
    nvml.nvmlShutdown()
    with NvmlMonitor([1], nvml=nvml, environ=env) as monitor:
        assert monitor.counter_gpus == [3]
    with pytest.raises(NvmlUnavailableError, match="no GPU is visible"):
        NvmlMonitor(nvml=nvml, environ={"CUDA_VISIBLE_DEVICES": "-1"})
    assert not nvml.initialized


def test_picking_unlike_gpus_by_number_warns_about_cuda_ordering() -> None:
    nvml = FakeNvml([gpu(name=A100), gpu(name=V100)])
    nvml.nvmlInit()
    with pytest.warns(EnergyFallbackWarning, match="CUDA_DEVICE_ORDER"):
        assert select_gpus(nvml, None, {"CUDA_VISIBLE_DEVICES": "1"}) == [1]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        env = {"CUDA_VISIBLE_DEVICES": "1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
        assert select_gpus(nvml, None, env) == [1]


# --- threads --------------------------------------------------------------------


def test_close_stops_the_sampling_thread_and_releases_nvml() -> None:
    before = bso_threads()
    nvml = FakeNvml([old_gpu()])
    monitor = NvmlMonitor(nvml=nvml, environ=NO_ENV, sample_interval_s=0.001)
    running = monitor.sampling_thread_alive
    assert len(bso_threads()) == len(before) + 1
    monitor.close()
    monitor.close()
    assert (running, monitor.sampling_thread_alive) == (True, False)
    assert bso_threads() == before
    assert not nvml.initialized
    with pytest.raises(RuntimeError, match="closed"):
        monitor.begin_window()


def test_a_lost_gpu_surfaces_at_the_next_window_end() -> None:
    nvml = FakeNvml([old_gpu()])
    with NvmlMonitor(nvml=nvml, environ=NO_ENV, sample_interval_s=0.001) as monitor:
        monitor.begin_window()
        nvml.lose_gpu(0)
        deadline = time.monotonic() + 2.0
        while monitor.sampling_thread_alive and time.monotonic() < deadline:
            time.sleep(0.001)
        assert not monitor.sampling_thread_alive  # the failing tick ended the thread
        with pytest.raises(pynvml.NVMLError_GpuIsLost):
            monitor.end_window()
