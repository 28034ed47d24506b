"""Learning-rate scaling rules, on plain floats and on real torch optimizers."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from bso_client.lr import (
    UNSCALED_LR_KEY,
    ScalingRule,
    rule_for,
    scale_factor,
    scale_lr,
    scale_optimizer_lr,
)


def params() -> list[torch.nn.Parameter]:
    return list(torch.nn.Linear(3, 2).parameters())


@pytest.mark.parametrize(
    ("rule", "factor"),
    [("linear", 4.0), ("sqrt", 2.0), ("none", 1.0), (ScalingRule.SQRT, 2.0)],
)
def test_scale_factor_per_rule(rule: str, factor: float) -> None:
    assert scale_factor(512, 128, rule) == factor
    assert scale_lr(0.1, 512, 128, rule) == pytest.approx(0.1 * factor)


def test_smaller_batches_scale_down() -> None:
    assert scale_lr(0.1, 32, 128, "linear") == pytest.approx(0.025)
    assert scale_lr(0.1, 32, 128, "sqrt") == pytest.approx(0.05)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="positive"):
        scale_factor(0, 128, "linear")
    with pytest.raises(ValueError, match="'cubic' is not a valid ScalingRule"):
        scale_factor(64, 128, "cubic")


@pytest.mark.parametrize(
    ("optimizer", "rule"),
    [
        ("SGD", ScalingRule.LINEAR),
        ("ASGD", ScalingRule.LINEAR),
        ("Adam", ScalingRule.SQRT),
        ("AdamW", ScalingRule.SQRT),
        ("Adagrad", ScalingRule.SQRT),
        ("RMSprop", ScalingRule.SQRT),
        ("Adafactor", ScalingRule.SQRT),
        ("Rprop", ScalingRule.NONE),
        ("LBFGS", ScalingRule.NONE),
    ],
)
def test_every_known_torch_optimizer_has_its_family(optimizer: str, rule: ScalingRule) -> None:
    assert rule_for(optimizer) == rule
    assert rule_for(getattr(torch.optim, optimizer)) == rule


def test_subclasses_inherit_their_family_and_unknown_ones_need_a_rule() -> None:
    class MyAdamW(torch.optim.AdamW):
        pass

    assert rule_for(MyAdamW(params())) == ScalingRule.SQRT
    with pytest.raises(ValueError, match="no known learning-rate scaling rule for Muon"):
        rule_for(torch.optim.Muon)


def test_sgd_param_groups_scale_linearly() -> None:
    first, last = torch.nn.Linear(3, 3), torch.nn.Linear(3, 1)
    groups: list[dict[str, Any]] = [
        {"params": first.parameters()},
        {"params": last.parameters(), "lr": 0.01},
    ]
    sgd = torch.optim.SGD(
        groups,
        lr=0.1,
        momentum=0.9,
    )
    assert scale_optimizer_lr(sgd, 1024, 256) == 4.0
    assert [g["lr"] for g in sgd.param_groups] == pytest.approx([0.4, 0.04])
    assert [g[UNSCALED_LR_KEY] for g in sgd.param_groups] == [0.1, 0.01]
    # The scaled rate is what the optimizer uses: one step moves by lr * grad.
    before = last.weight.detach().clone()
    last(first(torch.ones(1, 3))).sum().backward()
    sgd.step()
    assert last.weight.grad is not None
    assert torch.allclose(before - last.weight.detach(), 0.04 * last.weight.grad)


def test_adamw_scales_by_the_square_root_and_rescaling_does_not_compound() -> None:
    adamw = torch.optim.AdamW(params(), lr=1e-3)
    scale_optimizer_lr(adamw, 64, 256)
    assert adamw.param_groups[0]["lr"] == pytest.approx(5e-4)
    scale_optimizer_lr(adamw, 1024, 256)  # a retry with another size: from the original rate
    assert adamw.param_groups[0]["lr"] == pytest.approx(2e-3)
    # The key survives a checkpoint round trip.
    restored = torch.optim.AdamW(params(), lr=1e-3)
    restored.load_state_dict(adamw.state_dict())
    assert restored.param_groups[0]["lr"] == pytest.approx(2e-3)
    assert restored.param_groups[0][UNSCALED_LR_KEY] == 1e-3


def test_an_explicit_rule_overrides_the_family() -> None:
    adam = torch.optim.Adam(params(), lr=1e-3)
    assert scale_optimizer_lr(adam, 512, 256, rule="linear") == 2.0
    assert adam.param_groups[0]["lr"] == pytest.approx(2e-3)


def test_a_tensor_lr_is_updated_in_place() -> None:
    lr = torch.tensor(0.01)
    adam = torch.optim.Adam(params(), lr=lr)
    held = adam.param_groups[0]["lr"]
    scale_optimizer_lr(adam, 400, 100)
    assert adam.param_groups[0]["lr"] is held
    assert float(held) == pytest.approx(0.02)


def test_scaling_after_a_scheduler_was_created_is_refused() -> None:
    sgd = torch.optim.SGD(params(), lr=0.1)
    torch.optim.lr_scheduler.StepLR(sgd, step_size=10)
    with pytest.raises(ValueError, match="before creating the scheduler"):
        scale_optimizer_lr(sgd, 512, 256)
    assert sgd.param_groups[0]["lr"] == 0.1


def test_duck_typed_optimizers_work_without_torch() -> None:
    class Plain:
        def __init__(self) -> None:
            self.param_groups = [{"lr": 0.3}]

    plain = Plain()
    assert scale_optimizer_lr(plain, 200, 50, rule="sqrt") == 2.0
    assert plain.param_groups[0]["lr"] == pytest.approx(0.6)
    assert math.isclose(plain.param_groups[0][UNSCALED_LR_KEY], 0.3)
