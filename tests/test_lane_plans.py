"""A job's hardware lanes, each with the batch sizes that fit there, and epochs that grow.

Registering the same job from another GPU model with other candidates extends
the job (a new lane) instead of raising; each lane learns only over its own
sizes; a lane's plan is fixed once known.  Epoch reports may carry the size the
epoch ran at (online growth): it only grows, within the lane's sizes.
"""

from __future__ import annotations

from typing import Any

import pytest

from bso.commands.status import describe
from bso.errors import ConfigMismatch, InvalidEvent
from bso.service import BsoService
from bso.spec import Hardware, JobSpec
from bso.storage.memory import MemoryStore

V100 = Hardware(gpu_model="Tesla V100", gpu_count=1, max_power_w=250.0)
H100 = Hardware(gpu_model="NVIDIA H100", gpu_count=1, max_power_w=700.0)
T4 = Hardware(gpu_model="Tesla T4", gpu_count=1, max_power_w=70.0)


def spec(hardware: Hardware = V100, **changes: Any) -> JobSpec:
    fields: dict[str, Any] = {
        "job_id": "job",
        "batch_sizes": [32, 64, 128],
        "default_batch_size": 64,
        "target_metric": 0.9,
        "max_epochs": 4,
        "mab_seed": 3,
        "hardware": hardware,
    }
    fields.update(changes)
    return JobSpec.model_validate(fields)


@pytest.fixture
def service() -> BsoService:
    return BsoService(MemoryStore())


def sizes_handed_out(service: BsoService, hardware: Hardware, trials: int) -> set[int]:
    """Run ``trials`` trials on ``hardware`` to convergence at epoch 2; the sizes given."""
    seen = set()
    for _ in range(trials):
        trial = service.next_trial("job", hardware)
        seen.add(trial.batch_size)
        for epoch in (1, 2):
            decision = service.report_epoch(
                "job",
                trial.trial_number,
                epoch=epoch,
                time_s=10.0 * epoch,
                energy_j=1000.0 * epoch,
                metric=0.95 if epoch == 2 else 0.5,
            )
        assert decision.stop
    return seen


def test_another_gpu_model_with_other_sizes_extends_the_job(service: BsoService) -> None:
    service.register(spec())
    bigger = spec(H100, batch_sizes=[64, 128, 256, 512], default_batch_size=256)
    assert service.register(bigger).created is False
    assert service.next_trial("job", H100).batch_size == 256  # the lane's own default
    assert sizes_handed_out(service, H100, 8) <= {64, 128, 256, 512}
    assert sizes_handed_out(service, V100, 6) <= {32, 64, 128}


def test_each_lane_learns_only_over_its_own_sizes(service: BsoService) -> None:
    service.register(spec())
    service.register(spec(T4, batch_sizes=[8, 16, 32], default_batch_size=16))
    on_t4 = sizes_handed_out(service, T4, 10)
    assert on_t4 <= {8, 16, 32}
    assert 16 in on_t4  # the lane's own default runs first
    lanes = {lane.hardware.key: lane for lane in service.status("job").lanes}
    assert {s.batch_size for s in lanes[T4.key].sizes} <= {8, 16, 32}
    assert lanes[T4.key].recommended_batch_size in {8, 16, 32}


def test_a_lanes_plan_is_fixed_once_registered(service: BsoService) -> None:
    service.register(spec())
    service.register(spec(T4, batch_sizes=[8, 16, 32], default_batch_size=16))
    assert service.register(spec(T4, batch_sizes=[8, 16, 32], default_batch_size=16))
    with pytest.raises(ConfigMismatch, match=r"Tesla T4 x1 with batch sizes \[8, 16, 32\]"):
        service.register(spec(T4, batch_sizes=[8, 16], default_batch_size=16))


def test_the_jobs_own_hardware_keeps_the_jobs_plan(service: BsoService) -> None:
    service.register(spec())
    with pytest.raises(ConfigMismatch, match="batch sizes"):
        service.register(spec(batch_sizes=[32, 64], default_batch_size=64))


def test_a_lane_that_ran_under_the_jobs_plan_keeps_it(service: BsoService) -> None:
    service.register(spec())
    sizes_handed_out(service, T4, 1)  # an old client: no registration from the T4
    with pytest.raises(ConfigMismatch, match="fixed"):
        service.register(spec(T4, batch_sizes=[8, 16, 32], default_batch_size=16))


def test_other_settings_must_still_match_across_lanes(service: BsoService) -> None:
    service.register(spec())
    with pytest.raises(ConfigMismatch, match="eta_knob"):
        service.register(spec(H100, batch_sizes=[256], default_batch_size=256, eta_knob=0.9))


def test_micro_batching_is_part_of_a_lanes_plan(service: BsoService) -> None:
    service.register(spec())
    split = spec(T4, batch_sizes=[32, 64, 128], default_batch_size=64, micro_batch_size=16)
    service.register(split)
    with pytest.raises(ConfigMismatch, match="micro-batch 16"):
        service.register(spec(T4, batch_sizes=[32, 64, 128], default_batch_size=64))


# -- online growth ----------------------------------------------------------------------


def grow(service: BsoService, sizes: list[int | None]) -> int:
    """Report one epoch per entry of ``sizes`` on a fresh V100 trial; its number."""
    trial = service.next_trial("job", V100)
    for epoch, size in enumerate(sizes, start=1):
        service.report_epoch(
            "job",
            trial.trial_number,
            epoch=epoch,
            time_s=10.0 * epoch,
            energy_j=100.0 * epoch,
            metric=0.1,
            batch_size=size,
        )
    return trial.trial_number


def test_an_epoch_may_grow_the_batch_within_the_lanes_sizes(service: BsoService) -> None:
    service.register(spec())
    number = grow(service, [None, 128, 128])
    with service.store.read("job") as tx:
        trial = tx.get_trial(number)
    assert trial is not None
    assert (trial.batch_size, trial.current_batch_size) == (64, 128)  # charged to its start


@pytest.mark.parametrize(
    "sizes", [[32], [96], [128, 64], [256]], ids=["below-start", "off-list", "shrink", "too-big"]
)
def test_growth_outside_the_rules_is_refused(service: BsoService, sizes: list[int]) -> None:
    service.register(spec())
    with pytest.raises(InvalidEvent, match="may only grow"):
        grow(service, [*sizes])


def test_status_shows_each_lanes_own_candidates(service: BsoService) -> None:
    service.register(spec())
    service.register(spec(T4, batch_sizes=[8, 16, 32], default_batch_size=16))
    sizes_handed_out(service, V100, 1)
    sizes_handed_out(service, T4, 1)
    lanes = {lane.hardware.key: lane for lane in service.status("job").lanes}
    assert (lanes[V100.key].batch_sizes, lanes[V100.key].default_batch_size) == ([32, 64, 128], 64)
    assert (lanes[T4.key].batch_sizes, lanes[T4.key].default_batch_size) == ([8, 16, 32], 16)
    assert "candidates [8, 16, 32], default 16" in describe(service.status("job"))


def test_a_lanes_first_registration_pins_it_even_with_the_jobs_own_plan(
    service: BsoService,
) -> None:
    service.register(spec())
    service.register(spec(T4))  # the job's plan, from another hardware
    with pytest.raises(ConfigMismatch, match="fixed"):
        service.register(spec(T4, batch_sizes=[8, 16, 32], default_batch_size=16))


def test_a_client_that_fills_in_devices_keeps_a_lane_that_ran_before_it(
    service: BsoService,
) -> None:
    service.register(spec())
    sizes_handed_out(service, V100, 1)
    again = service.register(spec(devices=2))  # the same sizes, now split over 2 ranks
    assert again.plan is not None
    assert again.plan.devices is None  # the lane keeps the meaning its trials had
