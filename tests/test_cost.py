"""The one cost function: ``eta * ETA + (1 - eta) * MaxPower * TTA``."""

from __future__ import annotations

from typing import Any

import pytest

from bso.core.cost import cost
from bso.spec import JobSpec


def make(**overrides: Any) -> JobSpec:
    fields: dict[str, Any] = {
        "job_id": "j",
        "batch_sizes": [32, 64],
        "default_batch_size": 32,
        "target_metric": 0.5,
    }
    return JobSpec(**{**fields, **overrides})


def test_cost_formula_uses_per_gpu_limit_times_count() -> None:
    hw = {"gpu_model": "V100", "gpu_count": 4, "max_power_w": 250.0}
    spec = make(eta_knob=0.3, hardware=hw)
    energy, time = 2_000_000.0, 3_600.0
    expected = 0.3 * energy + 0.7 * (250.0 * 4) * time
    assert spec.hardware.total_max_power_w == 1000.0
    assert cost(energy, time, spec.eta_knob, spec.hardware.total_max_power_w) == pytest.approx(
        expected
    )


def test_cost_extremes_of_eta() -> None:
    hw = {"gpu_model": "V100", "gpu_count": 2, "max_power_w": 300.0}
    power = make(hardware=hw).hardware.total_max_power_w
    assert cost(5000.0, 10.0, 1.0, power) == pytest.approx(5000.0)
    assert cost(5000.0, 10.0, 0.0, power) == pytest.approx(600.0 * 10.0)
