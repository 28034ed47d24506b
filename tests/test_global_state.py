"""GlobalState: what a probe may change outside the model is put back as it was."""

from __future__ import annotations

import random

import numpy as np
import torch

from bso_client.global_state import GlobalState, preserved_global_state


def draws() -> tuple[float, float, torch.Tensor]:
    return random.random(), float(np.random.rand()), torch.rand(3)


def test_the_random_generators_grad_mode_and_backend_flags_come_back() -> None:
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    expected = draws()
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    benchmark = torch.backends.cudnn.benchmark
    precision = torch.get_float32_matmul_precision()
    with torch.no_grad(), preserved_global_state():
        draws()  # what a factory and a probe's steps draw
        torch.set_grad_enabled(True)
        torch.backends.cudnn.benchmark = not benchmark
        torch.set_float32_matmul_precision("medium" if precision != "medium" else "high")
        torch.use_deterministic_algorithms(True)
        assert torch.is_grad_enabled()
    assert torch.backends.cudnn.benchmark == benchmark
    assert torch.get_float32_matmul_precision() == precision
    assert not torch.are_deterministic_algorithms_enabled()
    again = draws()
    assert again[:2] == expected[:2]
    assert torch.equal(again[2], expected[2])


def test_grad_mode_is_restored_to_what_it_was() -> None:
    with torch.no_grad():
        state = GlobalState()
        torch.set_grad_enabled(True)
        state.restore()
        assert not torch.is_grad_enabled()
    assert torch.is_grad_enabled()
