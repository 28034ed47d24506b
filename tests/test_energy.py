"""Energy monitors against the fake NVML and a fake sysfs powercap tree."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pynvml
import pytest

from bso.errors import InvalidSpec
from bso_client.energy import (
    RAPL_MODEL,
    TIME_ONLY_MODEL,
    EnergyFallbackWarning,
    Measurement,
    PeriodicThread,
    RaplMonitor,
    RaplUnavailableError,
    TimeOnlyMonitor,
    detect_monitor,
    find_rapl_packages,
)
from bso_client.nvml import (
    MixedGpuModels,
    NvmlMonitor,
    NvmlUnavailableError,
    discover_hardware,
    select_gpus,
    visible_gpus,
)
from bso_client.testing import (
    ConstantLoad,
    FakeClock,
    FakeGpu,
    FakeNvml,
    PiecewiseLinearLoad,
    SineLoad,
)

NO_ENV: dict[str, str] = {}
A100 = "NVIDIA A100-SXM4-40GB"
V100 = "Tesla V100-SXM2-16GB"
P100 = "Tesla P100-PCIE-16GB"


def gpu(load: float = 0.5, name: str = A100, uuid: str | None = None) -> FakeGpu:
    """60 W idle, 400 W flat out: ``load`` 0.5 draws 230 W."""
    return FakeGpu(name=name, load=ConstantLoad(load), uuid=uuid)


def old_gpu(load: float = 0.5) -> FakeGpu:
    """A Pascal GPU: power readings, but no total-energy counter."""
    return FakeGpu(name=P100, load=ConstantLoad(load), energy_counter=False)


def bso_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("bso-")]


# --- the fake itself behaves like NVML ------------------------------------


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


def test_windows_overlap_restart_and_must_be_open() -> None:
    clock = FakeClock()
    nvml = FakeNvml([gpu(0.5)], clock=clock)
    with NvmlMonitor(nvml=nvml, environ=NO_ENV, clock=clock) as monitor:
        monitor.begin_window("trial")
        monitor.begin_window()
        clock.advance(1.0)
        monitor.begin_window()  # an abandoned epoch restarts
        clock.advance(2.0)
        epoch = monitor.end_window()
        trial = monitor.end_window("trial")
        with pytest.raises(RuntimeError, match="no measurement window 'epoch'"):
            monitor.end_window()
    assert epoch.elapsed_s == 2.0
    assert epoch.energy_j == pytest.approx(460.0, abs=1e-2)
    assert trial.elapsed_s == 3.0
    assert trial.energy_j == pytest.approx(690.0, abs=1e-2)


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


# --- fallbacks -----------------------------------------------------------------


def write_rapl(root: Path, domain: str, name: str, energy_uj: int, **extra: int) -> Path:
    path = root / domain
    path.mkdir(parents=True, exist_ok=True)
    (path / "name").write_text(name + "\n")
    (path / "energy_uj").write_text(f"{energy_uj}\n")
    (path / "max_energy_range_uj").write_text(f"{extra.pop('max_range', 1_000_000)}\n")
    for key, value in extra.items():
        (path / key).write_text(f"{value}\n")
    return path / "energy_uj"


@pytest.mark.parametrize(
    "nvml",
    [
        FakeNvml.without_driver(),
        FakeNvml.without_driver(pynvml.NVML_ERROR_DRIVER_NOT_LOADED),
        FakeNvml([]),
    ],
    ids=["no-library", "no-driver", "no-gpu"],
)
def test_no_gpu_falls_back_to_time_only_with_a_warning(nvml: FakeNvml, tmp_path: Path) -> None:
    clock = FakeClock()
    with pytest.warns(EnergyFallbackWarning, match="measuring time only") as caught:
        monitor = detect_monitor(nvml=nvml, environ=NO_ENV, rapl_root=tmp_path, clock=clock)
    message = str(caught[0].message)
    assert "NVML" in message
    assert "eta_knob below 1" in message
    assert isinstance(monitor, TimeOnlyMonitor)
    assert (monitor.kind, monitor.measures_energy) == ("time", False)
    assert monitor.hardware.gpu_model == TIME_ONLY_MODEL
    with monitor:
        monitor.begin_window()
        clock.advance(4.0)
        assert monitor.end_window() == Measurement(4.0, 0.0)


def test_real_pynvml_with_no_visible_gpu_falls_back(tmp_path: Path) -> None:
    """Whatever this machine has, hiding every GPU leaves only the fallback."""
    with pytest.warns(EnergyFallbackWarning):
        monitor = detect_monitor(environ={"CUDA_VISIBLE_DEVICES": ""}, rapl_root=tmp_path)
    monitor.close()
    assert monitor.kind == "time"


def test_naming_gpus_without_nvml_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(NvmlUnavailableError, match="NVML Shared Library Not Found"):
        detect_monitor([0], nvml=FakeNvml.without_driver(), environ=NO_ENV, rapl_root=tmp_path)


def test_detect_picks_nvml_silently_when_it_works(tmp_path: Path) -> None:
    write_rapl(tmp_path, "intel-rapl:0", "package-0", 5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        monitor = detect_monitor(nvml=FakeNvml([gpu()]), environ=NO_ENV, rapl_root=tmp_path)
    with monitor:
        assert monitor.kind == "nvml"
        assert monitor.hardware.gpu_model == A100


def test_rapl_sums_packages_and_handles_wrap_around(tmp_path: Path) -> None:
    pkg0 = write_rapl(
        tmp_path,
        "intel-rapl:0",
        "package-0",
        900,
        max_range=1000,
        constraint_0_max_power_uw=0,
        constraint_0_power_limit_uw=125_000_000,
    )
    pkg1 = write_rapl(
        tmp_path, "intel-rapl:1", "package-1", 10, constraint_0_max_power_uw=150_000_000
    )
    write_rapl(tmp_path, "intel-rapl:0:0", "core", 0)  # part of package-0
    write_rapl(tmp_path, "intel-rapl:2", "psys", 0)  # the whole platform: would count twice
    clock = FakeClock()
    with pytest.warns(EnergyFallbackWarning, match="RAPL instead"):
        monitor = detect_monitor(nvml=FakeNvml([]), environ=NO_ENV, rapl_root=tmp_path, clock=clock)
    assert isinstance(monitor, RaplMonitor)
    with monitor:
        assert (monitor.hardware.gpu_model, monitor.hardware.gpu_count) == (RAPL_MODEL, 2)
        assert monitor.hardware.max_power_w == 150.0
        monitor.begin_window()
        pkg0.write_text("400\n")  # wrapped once: +500
        pkg1.write_text("20\n")
        monitor.begin_window("probe")  # any read accumulates, as the poll thread does
        pkg0.write_text("300\n")  # wrapped again: +900
        clock.advance(2.0)
        measured = monitor.end_window()
    assert measured.elapsed_s == 2.0
    assert measured.energy_j == pytest.approx((500 + 900 + 10) / 1e6)


def test_rapl_without_limits_uses_the_default_max_power(tmp_path: Path) -> None:
    write_rapl(tmp_path, "intel-rapl:0", "package-0", 1)
    with RaplMonitor(tmp_path, default_max_power_w=80.0) as monitor:
        assert monitor.hardware.max_power_w == 80.0


def test_unreadable_rapl_falls_back_to_time_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_rapl(tmp_path, "intel-rapl:0", "package-0", 1)
    real_read_text = Path.read_text

    def kernel_read_text(path: Path, encoding: str | None = None, errors: str | None = None) -> str:
        # energy_uj is 0400 root-only since Linux 5.10; root ignores file modes, so say it.
        if path.name == "energy_uj":
            raise PermissionError(13, "Permission denied", str(path))
        return real_read_text(path, encoding, errors)

    monkeypatch.setattr(Path, "read_text", kernel_read_text)
    with pytest.raises(RaplUnavailableError, match="Permission denied"):
        find_rapl_packages(tmp_path)
    with pytest.warns(EnergyFallbackWarning, match=r"RAPL: intel-rapl:0: .*Permission denied"):
        monitor = detect_monitor(nvml=FakeNvml([]), environ=NO_ENV, rapl_root=tmp_path)
    assert monitor.kind == "time"
    with pytest.raises(RaplUnavailableError, match="no CPU package domain"):
        find_rapl_packages(tmp_path / "absent")


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


def test_rapl_poll_thread_stops_on_close(tmp_path: Path) -> None:
    write_rapl(tmp_path, "intel-rapl:0", "package-0", 1)
    before = bso_threads()
    with RaplMonitor(tmp_path, poll_interval_s=0.001):
        assert len(bso_threads()) == len(before) + 1
    assert bso_threads() == before


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


def test_periodic_thread_needs_a_positive_interval() -> None:
    with pytest.raises(ValueError, match="positive"):
        PeriodicThread(lambda: None, 0.0, "bso-test")


def test_importing_the_client_pulls_in_neither_torch_nor_pynvml() -> None:
    code = (
        "import sys, bso_client.energy, bso_client.nvml, bso_client.lr; "
        "print(sorted({'torch', 'pynvml'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
