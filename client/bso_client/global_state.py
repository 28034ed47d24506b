"""What a memory probe could change outside the model, copied and put back.

A probe runs real training steps, and the model factory of a
:class:`~bso_client.discovery.Discovery` builds a model: both draw from the
process's global random generators (weight initialisation, dropout masks,
random batches).  A script that seeds, then creates its optimizer (which may
probe), then builds its own model must start from the same weights whether
the probe ran, came from the cache, or was not needed: otherwise the first run
of a job trains another model than the runs after it (issue 23: 58% against
33% epoch-1 accuracy with the same seed).  So a probe leaves these as it
found them:

* the random generators of torch (CPU, and CUDA when it was initialised; CUDA
  first initialised by the probe is seeded again with ``torch.initial_seed()``,
  as its lazy initialisation would have done), numpy's global generator, and
  Python's :mod:`random`;
* grad mode (``torch.is_grad_enabled()``);
* the ``torch.backends`` flags and global switches a model factory may set
  (cuDNN's benchmark, deterministic, enabled and TF32 flags, the matmul
  precision and TF32 / reduced-precision flags, deterministic algorithms).

The model's and optimizer's own state is :class:`~bso_client.batch_search.TrainingState`'s.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_BACKEND_FLAGS = (
    ("backends.cudnn", "benchmark"),
    ("backends.cudnn", "deterministic"),
    ("backends.cudnn", "enabled"),
    ("backends.cudnn", "allow_tf32"),
    ("backends.cuda.matmul", "allow_tf32"),
    ("backends.cuda.matmul", "allow_fp16_reduced_precision_reduction"),
    ("backends.cuda.matmul", "allow_bf16_reduced_precision_reduction"),
    ("backends.mkldnn", "enabled"),
)
"""(path under ``torch``, attribute): the flags read and written back as they are."""


class GlobalState:
    """A copy of the process-wide state a probe may change; :meth:`restore` puts it back
    (any number of times)."""

    def __init__(self) -> None:
        import torch

        self._python = random.getstate()
        numpy = sys.modules.get("numpy")
        self._numpy = numpy.random.get_state() if numpy is not None else None
        self._cpu_rng = torch.get_rng_state()
        self._cuda_rng = torch.cuda.get_rng_state_all() if _cuda_initialized() else None
        self._grad = torch.is_grad_enabled()
        self._flags = {
            (path, name): getattr(owner, name)
            for path, name in _BACKEND_FLAGS
            if (owner := _resolve(torch, path)) is not None and hasattr(owner, name)
        }
        self._matmul_precision = torch.get_float32_matmul_precision()
        self._deterministic = (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        )

    def restore(self) -> None:
        import torch

        random.setstate(self._python)
        numpy = sys.modules.get("numpy")
        if numpy is not None and self._numpy is not None:
            numpy.random.set_state(self._numpy)
        torch.set_rng_state(self._cpu_rng)
        if self._cuda_rng is not None:
            torch.cuda.set_rng_state_all(self._cuda_rng)
        elif _cuda_initialized():  # the probe initialised CUDA and drew from it
            torch.cuda.manual_seed_all(torch.initial_seed())
        torch.set_grad_enabled(self._grad)
        for (path, name), value in self._flags.items():
            setattr(_resolve(torch, path), name, value)
        torch.set_float32_matmul_precision(self._matmul_precision)
        enabled, warn_only = self._deterministic
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


@contextmanager
def preserved_global_state() -> Iterator[GlobalState]:
    """Copy the global state on entry, restore it on exit, even on error."""
    state = GlobalState()
    try:
        yield state
    finally:
        state.restore()


def _resolve(root: Any, path: str) -> Any:
    for part in path.split("."):
        root = getattr(root, part, None)
        if root is None:
            return None
    return root


def _cuda_initialized() -> bool:
    """Whether CUDA was set up already: its generators exist only then."""
    import torch

    initialized: bool = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    return initialized


__all__ = ["GlobalState", "preserved_global_state"]
