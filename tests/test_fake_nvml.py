"""The fake NVML behaves like the real one (bso_client.testing.fake_nvml)."""

from __future__ import annotations

import pynvml
import pytest

from bso_client.testing import ConstantLoad, FakeClock, FakeGpu, FakeNvml, SineLoad
from tests.fixtures.energy import gpu, old_gpu


def test_fake_raises_real_nvml_errors() -> None:
    nvml = FakeNvml([gpu(), old_gpu()])
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nvml.nvmlDeviceGetCount()
    nvml.nvmlInit()
    assert nvml.nvmlDeviceGetCount() == 2
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlDeviceGetHandleByIndex(2)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlDeviceGetName(object())
    old = nvml.nvmlDeviceGetHandleByIndex(1)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceGetTotalEnergyConsumption(old)
    nvml.nvmlShutdown()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nvml.nvmlDeviceGetPowerUsage(old)
    with pytest.raises(pynvml.NVMLError_LibraryNotFound):
        FakeNvml.without_driver().nvmlInit()
    with pytest.raises(pynvml.NVMLError_DriverNotLoaded):
        FakeNvml.without_driver(pynvml.NVML_ERROR_DRIVER_NOT_LOADED).nvmlInit()


def test_fake_counter_is_the_integral_of_its_power() -> None:
    clock = FakeClock()
    nvml = FakeNvml([FakeGpu(load=SineLoad(0.5, 0.4, period_s=3.0))], clock=clock)
    nvml.nvmlInit()
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    start_mj = nvml.nvmlDeviceGetTotalEnergyConsumption(handle)
    assert start_mj > 0  # counts from the driver's load, not from 0
    dt, riemann_j = 0.001, 0.0
    for _ in range(2000):
        riemann_j += nvml.nvmlDeviceGetPowerUsage(handle) / 1000 * dt
        clock.advance(dt)
    counted_j = (nvml.nvmlDeviceGetTotalEnergyConsumption(handle) - start_mj) / 1000
    assert counted_j == pytest.approx(riemann_j, rel=1e-3)
    nvml.set_load(0, ConstantLoad(1.0))
    clock.advance(1.0)
    assert nvml.nvmlDeviceGetPowerUsage(handle) == 400_000
