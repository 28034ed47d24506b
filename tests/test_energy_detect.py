"""Which source measures a job's energy: NVML, else RAPL, else time only (energy.detect)."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pynvml
import pytest

from bso_client.energy.base import EnergyFallbackWarning, Measurement
from bso_client.energy.detect import detect_monitor
from bso_client.energy.time_only import TIME_ONLY_MODEL, TimeOnlyMonitor
from bso_client.errors import NvmlUnavailableError
from bso_client.testing import FakeClock, FakeNvml
from tests.fixtures.energy import A100, NO_ENV, gpu, write_rapl


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


def test_importing_the_client_pulls_in_neither_torch_nor_pynvml() -> None:
    code = (
        "import sys, bso_client.energy.detect, bso_client.lr; "
        "print(sorted({'torch', 'pynvml'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
