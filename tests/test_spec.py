"""JobSpec validation (messages a user can act on), normalisation, fingerprint, cost."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from bso.core.cost import cost
from bso.spec import (
    MAX_BATCH_SIZE,
    MAX_BATCH_SIZES,
    MAX_BETA,
    MAX_COST,
    MAX_ENERGY_J,
    MAX_GPU_COUNT,
    MAX_POWER_W,
    MAX_TIME_S,
    Hardware,
    JobSpec,
)


def make(**changes: Any) -> JobSpec:
    fields: dict[str, Any] = {
        "job_id": "resnet-nightly",
        "batch_sizes": [32, 64, 128, 256],
        "default_batch_size": 128,
        "target_metric": 0.9,
    }
    fields.update(changes)
    return JobSpec.model_validate(fields)


def error_of(**changes: Any) -> str:
    with pytest.raises(ValidationError) as info:
        make(**changes)
    return str(info.value)


def test_a_minimal_spec_is_valid_with_zeus_defaults() -> None:
    spec = make()
    assert spec.eta_knob == 0.5
    assert spec.beta_knob == 2.0
    assert spec.higher_is_better_metric is True
    assert spec.max_epochs == 100
    assert spec.num_pruning_rounds == 2
    assert spec.window_size == 10
    assert spec.mab_num_explorations == 2
    assert spec.policy == "bso"
    assert spec.hardware == Hardware()


def test_batch_sizes_are_sorted() -> None:
    spec = make(batch_sizes=[256, 32, 1024, 64], default_batch_size=64)
    assert spec.batch_sizes == [32, 64, 256, 1024]


def test_default_not_in_list() -> None:
    message = error_of(default_batch_size=48)
    assert "default_batch_size 48 is not in batch_sizes [32, 64, 128, 256]" in message


@pytest.mark.parametrize("eta", [-0.01, 1.01, 5.0, math.nan])
def test_eta_outside_unit_interval(eta: float) -> None:
    assert "eta_knob must be within [0, 1]" in error_of(eta_knob=eta)


@pytest.mark.parametrize("eta", [0.0, 1.0, 0.25])
def test_eta_bounds_are_inclusive(eta: float) -> None:
    assert make(eta_knob=eta).eta_knob == eta


def test_empty_batch_sizes() -> None:
    assert "batch_sizes is empty: give at least one batch size" in error_of(batch_sizes=[])


def test_duplicate_batch_sizes_are_named() -> None:
    message = error_of(batch_sizes=[32, 64, 32, 128, 64], default_batch_size=32)
    assert "batch_sizes has duplicates: [32, 64]" in message


def test_non_positive_batch_sizes_are_named() -> None:
    message = error_of(batch_sizes=[0, 32, -8], default_batch_size=32)
    assert "batch sizes must be positive, got [0, -8]" in message


def test_absurd_batch_sizes_are_named() -> None:
    huge = MAX_BATCH_SIZE * 10
    message = error_of(batch_sizes=[32, huge], default_batch_size=32)
    assert f"batch sizes above {MAX_BATCH_SIZE} are not plausible, got [{huge}]" in message
    assert make(batch_sizes=[MAX_BATCH_SIZE], default_batch_size=MAX_BATCH_SIZE)


@pytest.mark.parametrize("beta", [1.0, 0.5, 0.0, -3.0, math.inf, math.nan])
def test_beta_must_be_finite_and_above_one(beta: float) -> None:
    message = error_of(beta_knob=beta)
    assert "beta_knob must be a finite number above 1" in message
    assert "None to disable early stop" in message


def test_beta_none_disables_the_bound() -> None:
    assert make(beta_knob=None).beta_knob is None
    assert make(beta_knob=1.01).beta_knob == 1.01


def test_neither_id_nor_prefix() -> None:
    message = error_of(job_id=None)
    assert "give job_id, or job_id_prefix to have one generated" in message


def test_prefix_alone_is_enough() -> None:
    spec = make(job_id=None, job_id_prefix="mnist")
    assert spec.job_id is None
    assert spec.job_id_prefix == "mnist"


@pytest.mark.parametrize(
    "bad_id", ["my job", "-leading-dash", "a/b", "", "x" * 129, "naïve", "semi;colon"]
)
@pytest.mark.parametrize("field", ["job_id", "job_id_prefix"])
def test_bad_id_characters(field: str, bad_id: str) -> None:
    message = error_of(**{field: bad_id})
    assert field in message
    assert "letters, digits, '.', '_', ':' or '-'" in message


@pytest.mark.parametrize("good_id", ["a", "team.job_1:v2-nightly", "9lives", "x" * 128])
def test_good_ids(good_id: str) -> None:
    assert make(job_id=good_id).job_id == good_id


@pytest.mark.parametrize("unknown", ["batch_size", "max_epoch", "learning_rate"])
def test_unknown_fields_are_rejected_by_name(unknown: str) -> None:
    message = error_of(**{unknown: 1})
    assert unknown in message
    assert "Extra inputs are not permitted" in message


def test_unknown_hardware_fields_are_rejected() -> None:
    message = error_of(hardware={"gpu_model": "A100", "gpus": 8})
    assert "gpus" in message


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("field", ["target_metric", "mab_prior_mean"])
def test_non_finite_numbers(field: str, value: float) -> None:
    message = error_of(**{field: value})
    assert field in message
    assert "must be a finite number" in message


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_epochs", 0),
        ("num_pruning_rounds", 0),
        ("window_size", -1),
        ("mab_prior_precision", -0.5),
        ("mab_num_explorations", -1),
        ("policy", "random"),
    ],
)
def test_knobs_out_of_range_name_the_field(field: str, value: object) -> None:
    assert field in error_of(**{field: value})


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("batch_sizes", [True, 32, 64, 128, 256]),
        ("max_epochs", True),
        ("micro_batch_size", True),
        ("window_size", False),
        ("mab_seed", True),
        ("hardware", {"gpu_count": True}),
        ("hardware", {"gpu_count": 2, "devices": True}),
    ],
)
def test_a_bool_where_a_count_belongs_is_refused_by_name(field: str, value: object) -> None:
    """pydantic alone read True as 1: a batch of one, a single epoch."""
    message = error_of(**{field: value})
    assert field in message
    assert "a whole number, not True or False" in message


def test_the_bool_refusal_names_the_item_and_echoes_no_input() -> None:
    """It runs before pydantic's own checks, on whatever an event carries, and its
    message goes into the caller's reply and the worker's log: with the list echoed
    whole, one event of 1 MB made each 5 MB (repr escapes a control character to 4)."""
    message = error_of(batch_sizes=[32, True, "\x7f" * 100_000])
    assert "got True (item 1)" in message
    assert len(message) < 1000


def test_a_count_written_as_a_float_or_from_json_still_validates() -> None:
    assert make(max_epochs=12.0).max_epochs == 12
    spec = JobSpec.model_validate_json(make(devices=2).model_dump_json())
    assert (spec.devices, spec.batch_sizes) == (2, [32, 64, 128, 256])


@pytest.mark.parametrize(
    "hardware",
    [{"gpu_count": 0}, {"max_power_w": 0.0}, {"max_power_w": -300.0}, {"gpu_model": ""}],
)
def test_invalid_hardware(hardware: dict[str, Any]) -> None:
    message = error_of(hardware=hardware)
    assert next(iter(hardware)) in message


def test_spec_is_immutable() -> None:
    spec = make()
    with pytest.raises(ValidationError):
        spec.eta_knob = 0.9  # type: ignore[misc]


def test_hardware_key_and_total_power() -> None:
    hw = Hardware(gpu_model="NVIDIA A100", gpu_count=8, max_power_w=400.0)
    assert hw.total_max_power_w == 3200.0
    assert hw.key == Hardware(gpu_model="NVIDIA A100", gpu_count=8, max_power_w=250.0).key
    assert hw.key != Hardware(gpu_model="NVIDIA A100", gpu_count=4, max_power_w=400.0).key
    assert hw.key != Hardware(gpu_model="NVIDIA H100", gpu_count=8, max_power_w=400.0).key


def test_data_parallel_devices_make_their_own_lane() -> None:
    one = Hardware(gpu_model="cpu-time-only")
    two = one.with_devices(2)
    assert (one.key, two.key) == ("cpu-time-only x1", "cpu-time-only x1 dp2")
    assert one.with_devices(1) == one.with_devices(None) == one
    # A single-process hardware is sent and stored as before devices existed.
    assert "devices" not in one.model_dump_json()
    assert Hardware.model_validate_json(two.model_dump_json()) == two
    with pytest.raises(ValidationError):
        Hardware(devices=1)  # one device is None: one key per lane


# -- config fingerprint -----------------------------------------------------------------


def test_fingerprint_ignores_ids_and_hardware() -> None:
    base = make().config_fingerprint()
    assert make(job_id="other-job").config_fingerprint() == base
    assert make(job_id=None, job_id_prefix="prefix").config_fingerprint() == base
    a100 = {"gpu_model": "NVIDIA A100", "gpu_count": 8, "max_power_w": 400.0}
    assert make(hardware=a100).config_fingerprint() == base


def test_fingerprint_ignores_the_batch_plan() -> None:
    base = make().config_fingerprint()
    assert make(batch_sizes=[256, 128, 64, 32]).config_fingerprint() == base


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("eta_knob", 0.6),
        ("beta_knob", 3.0),
        ("beta_knob", None),
        ("target_metric", 0.91),
        ("higher_is_better_metric", False),
        ("max_epochs", 99),
        ("num_pruning_rounds", 1),
        ("window_size", 0),
        ("mab_prior_mean", 1.0),
        ("mab_prior_precision", 1.0),
        ("mab_num_explorations", 3),
        ("mab_seed", 42),
        ("policy", "zeus"),
    ],
)
def test_fingerprint_changes_with_every_knob(field: str, value: object) -> None:
    assert make(**{field: value}).config_fingerprint() != make().config_fingerprint()


def test_fingerprint_is_stable_across_calls() -> None:
    assert make().config_fingerprint() == make().config_fingerprint()
    assert len(make().config_fingerprint()) == 64


# -- bounds: every number finite and physical, every integer storable ----------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("mab_prior_precision", math.inf),
        ("mab_prior_precision", math.nan),
        ("mab_prior_precision", 1e19),
        ("mab_prior_mean", 1e19),
        ("mab_prior_mean", -1e19),
        ("target_metric", 1e16),
        ("target_metric", -1e16),
        ("beta_knob", MAX_BETA * 2),
        ("mab_seed", -1),
        ("mab_seed", 2**63),
        ("mab_seed", 2**200),
        ("default_batch_size", 2**63),
        ("default_batch_size", 0),
        ("max_epochs", 2**64),
        ("window_size", 2**63),
        ("num_pruning_rounds", -(2**63) - 1),
        ("eta_knob", math.inf),
    ],
)
def test_numbers_beyond_their_bounds_name_the_field(field: str, value: object) -> None:
    assert field in error_of(**{field: value})


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("mab_prior_precision", 1e18),
        ("mab_prior_mean", -1e18),
        ("target_metric", 1e15),
        ("beta_knob", MAX_BETA),
        ("mab_seed", 0),
        ("mab_seed", 2**63 - 1),
    ],
)
def test_bounds_are_inclusive(field: str, value: object) -> None:
    assert getattr(make(**{field: value}), field) == value


def test_json_overflow_to_infinity_is_refused() -> None:
    # 1e999 is how an infinity reaches bso through JSON (json.loads gives inf).
    payload = json.loads(
        '{"job_id": "j", "batch_sizes": [8], "default_batch_size": 8, "target_metric": 1,'
        ' "mab_prior_precision": 1e999}'
    )
    with pytest.raises(ValidationError, match="mab_prior_precision"):
        JobSpec.model_validate(payload)


def test_huge_batch_sizes_are_refused_not_stored() -> None:
    message = error_of(batch_sizes=[32, 2**64], default_batch_size=32)
    assert "batch sizes above" in message


def test_too_many_batch_sizes_are_refused() -> None:
    sizes = list(range(1, MAX_BATCH_SIZES + 2))
    message = error_of(batch_sizes=sizes, default_batch_size=1)
    assert "batch_sizes" in message
    assert f"at most {MAX_BATCH_SIZES}" in message
    assert len(make(batch_sizes=sizes[:-1], default_batch_size=1).batch_sizes) == MAX_BATCH_SIZES


def test_messages_list_a_few_offenders_not_all_of_them() -> None:
    sizes = [-n for n in range(MAX_BATCH_SIZES)]
    message = error_of(batch_sizes=sizes, default_batch_size=1)
    assert "batch sizes must be positive, got [0, -1, -2," in message
    assert f"and {MAX_BATCH_SIZES - 10} more" in message
    assert len(message) < 1000
    many = list(range(1, 2001)) * 2
    message = error_of(batch_sizes=many, default_batch_size=1)
    assert "batch_sizes has duplicates: [1, 2, 3, 4, 5, 6, 7, 8, 9, 10] and 1990 more" in message
    message = error_of(batch_sizes=list(range(1, 3000)), default_batch_size=5000)
    assert "default_batch_size 5000 is not in batch_sizes [1, 2," in message
    assert len(message) < 1000


def test_duplicates_are_found_among_many_sizes() -> None:
    sizes = [*range(1, MAX_BATCH_SIZES), 4000]
    assert "batch_sizes has duplicates: [4000]" in error_of(batch_sizes=sizes, default_batch_size=1)


@pytest.mark.parametrize("bad_id", ["job\n", "job\x00", "\u202ejob", "job\u0085"])
@pytest.mark.parametrize("field", ["job_id", "job_id_prefix"])
def test_ids_with_control_characters_are_refused(field: str, bad_id: str) -> None:
    # "job\n" passed the old check: Python's "$" also matches before a final newline.
    assert field in error_of(**{field: bad_id})


@pytest.mark.parametrize(
    "hardware",
    [
        {"gpu_count": MAX_GPU_COUNT + 1},
        {"gpu_count": 2**63},
        {"max_power_w": math.inf},
        {"max_power_w": math.nan},
        {"max_power_w": MAX_POWER_W * 1.5},
        {"gpu_model": "A100\n"},
        {"gpu_model": "\x1b[31mA100"},
        {"gpu_model": "A100\u200b"},
        {"gpu_model": "x" * 129},
    ],
)
def test_hardware_beyond_its_bounds_names_the_field(hardware: dict[str, Any]) -> None:
    assert next(iter(hardware)) in error_of(hardware=hardware)


@pytest.mark.parametrize("model", ["NVIDIA A100-SXM4-80GB", "Tesla V100 (16 GB)", "Ascend 910B"])
def test_printable_gpu_models_are_kept(model: str) -> None:
    assert make(hardware={"gpu_model": model}).hardware.gpu_model == model


def test_the_cost_bound_holds_at_the_corners() -> None:
    # The module docstring's argument, checked at its worst case.
    hw = {"gpu_count": MAX_GPU_COUNT, "max_power_w": MAX_POWER_W}
    for eta in (0.0, 0.5, 1.0):
        spec = make(eta_knob=eta, hardware=hw)
        value = cost(MAX_ENERGY_J, MAX_TIME_S, spec.eta_knob, spec.hardware.total_max_power_w)
        assert math.isfinite(value)
        assert value <= MAX_COST
        assert math.isfinite(value * MAX_BETA)
    power = make(hardware=hw).hardware.total_max_power_w
    assert cost(MAX_ENERGY_J, MAX_TIME_S, 0.0, power) == pytest.approx(
        MAX_GPU_COUNT * MAX_POWER_W * MAX_TIME_S
    )


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    energy=st.floats(0, MAX_ENERGY_J),
    time=st.floats(0, MAX_TIME_S),
    eta=st.floats(0, 1),
    count=st.integers(1, MAX_GPU_COUNT),
    power=st.floats(0, MAX_POWER_W, exclude_min=True),
)
def test_no_accepted_input_has_an_unbounded_cost(
    energy: float, time: float, eta: float, count: int, power: float
) -> None:
    value = cost(energy, time, eta, power * count)
    assert 0.0 <= value <= MAX_COST * (1 + 1e-12)


# -- batch plan: micro-batches and devices ------------------------------------------------


def test_split_runs_a_global_batch_as_micro_batches_on_every_device() -> None:
    job = make(batch_sizes=[64, 128, 256], default_batch_size=128, micro_batch_size=8, devices=4)
    assert job.split(256) == (64, 8, 8)  # 64 per device, 8 passes of 8
    assert job.split(64) == (16, 8, 2)
    assert job.batch_unit == 32


def test_split_without_micro_batching_is_one_pass_per_device() -> None:
    assert make().split(128) == (128, 128, 1)
    assert make(devices=2).split(128) == (64, 64, 1)


def test_batch_sizes_must_be_whole_micro_batches_on_every_device() -> None:
    message = error_of(micro_batch_size=24, devices=2)
    assert "multiple of micro_batch_size x devices = 48" in message
    assert "[32, 64, 128, 256]" in message


def test_the_plan_may_differ_between_lanes_the_rest_may_not() -> None:
    base = make().config_fingerprint()
    assert make(batch_sizes=[8, 16], default_batch_size=16).config_fingerprint() == base
    assert make(micro_batch_size=16, devices=2).config_fingerprint() == base
    assert make(micro_batch_size=16).plan != make().plan
    other = make(batch_sizes=[8, 16], default_batch_size=16)
    assert make().with_plan(other.plan) == other


def test_memory_sizes_are_one_syntax_for_the_cli_and_python() -> None:
    from bso.spec import memory_size

    assert (memory_size("256MiB"), memory_size("2GB"), memory_size(1024)) == (
        256 << 20,
        2 * 10**9,
        1024,
    )
    for bad in ("lots", 0, True, 1.5):
        with pytest.raises(ValueError, match="memory"):
            memory_size(bad)  # type: ignore[arg-type]
