"""Find the batch sizes a job can use, so that nobody types them by hand.

Zeus asks the user for the list of candidate batch sizes and a default.  The
upper end of that list is a fact of the hardware (the largest batch whose
training step fits in accelerator memory) that users guess, usually by trial
and error, and get wrong in both directions: too low leaves fast, cheap sizes
unexplored; too high wastes the first trials of a job on out-of-memory crashes.
This module measures it instead and turns it into a candidate list:

* :func:`find_max_batch_size` probes a caller-supplied ``try_batch(b)`` (one
  training step at batch size ``b``) and returns the largest ``b`` that does
  not run out of memory.
* :mod:`bso_client.batch_candidates` turns that maximum into ``batch_sizes``
  and ``default_batch_size`` for a :class:`~bso.spec.JobSpec` ("batch sizes:
  auto").
* :func:`probe_model` builds ``try_batch`` for a plain PyTorch model, loss and
  optimizer, and puts their state back afterwards; :class:`TrainingState` /
  :func:`preserved_training_state` do the putting back for a custom
  ``try_batch``.

Typical use::

    max_bs = probe_model(model, optimizer, make_batch, loss_fn, device="cuda", limit=4096)
    sizes = auto_batch_sizes(max_bs, default_cap=256)
    spec = JobSpec(job_id_prefix="resnet", target_metric=0.93,
                   batch_sizes=sizes.batch_sizes,
                   default_batch_size=sizes.default_batch_size)

The maximum holds for the hardware it was measured on (one GPU model, one
precision, one model configuration): measure again when any of them changes.

Like the rest of :mod:`bso_client`, importing this module does not import
torch; the functions that need it import it when called, and the OOM
detection only looks at torch if the caller already imported it.
"""

from __future__ import annotations

import copy
import gc
import logging
import sys
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from bso.spec import MAX_BATCH_SIZE
from bso_client.errors import NoBatchSizeFits
from bso_client.global_state import GlobalState

if TYPE_CHECKING:
    import torch

__all__ = [
    "TrainingState",
    "find_max_batch_size",
    "free_memory",
    "is_allocation_failure",
    "preserved_training_state",
    "probe_model",
]

logger = logging.getLogger(__name__)

# Substrings (compared lower-case) of the RuntimeError messages torch and its
# libraries use for a failed allocation.  ``out of memory`` covers "CUDA out
# of memory", "CUDA error: out of memory", "HIP out of memory", "XPU out of
# memory" and "MPS backend out of memory"; the CPU allocator says "can't
# allocate memory"; cuBLAS reports a failed workspace allocation as
# CUBLAS_STATUS_ALLOC_FAILED, and cuDNN answers CUDNN_STATUS_NOT_SUPPORTED when
# it cannot get the workspace an algorithm for a large batch needs (Lightning
# and Accelerate treat it as OOM for the same reason).
_OOM_MESSAGES = (
    "out of memory",
    "can't allocate memory",
    "cublas_status_alloc_failed",
    "cudnn_status_alloc_failed",
    "cudnn error: cudnn_status_not_supported",
)


def is_allocation_failure(exc: BaseException) -> bool:
    """Whether ``exc`` says that an allocation failed, on any device torch supports.

    True for Python's :class:`MemoryError` (and numpy's subclass of it), for
    ``torch.OutOfMemoryError`` (``torch.cuda.OutOfMemoryError``), and for a
    :class:`RuntimeError` whose message is one of torch's allocation failures
    (see ``_OOM_MESSAGES``): older torch versions, MPS, XPU and the CPU
    allocator raise plain ``RuntimeError``.  Anything else is a real error that
    the search must not mistake for "too large", so it is False.

    Broader than :func:`bso_client.liveness.is_accelerator_out_of_memory`,
    which decides whether a run that died is charged with the size's memory:
    a probe that fails any allocation, host memory included, is too large for
    this machine whichever allocator said so.

    torch is consulted only if it is already imported: an exception cannot be
    torch's if torch was never loaded, and importing it here would make every
    caller pay for it.
    """
    if isinstance(exc, MemoryError):
        return True
    torch_module = sys.modules.get("torch")
    if torch_module is not None:
        oom_type = getattr(torch_module, "OutOfMemoryError", None)
        if oom_type is None:  # torch < 2.5 has only the CUDA one
            oom_type = getattr(getattr(torch_module, "cuda", None), "OutOfMemoryError", None)
        if isinstance(oom_type, type) and isinstance(exc, oom_type):
            return True
    if isinstance(exc, RuntimeError):
        message = str(exc).lower()
        return any(pattern in message for pattern in _OOM_MESSAGES)
    return False


def free_memory() -> None:
    """Release what a failed step left behind, so that the next probe starts clean.

    ``gc.collect()`` breaks the reference cycles between the exception, its
    traceback and the frames holding the step's activations; the allocator's
    cache is then handed back (CUDA, MPS, XPU, whichever is in use), otherwise
    the cached blocks of a failed large batch fragment memory and a later,
    smaller probe could fail although it fits on its own.
    """
    gc.collect()
    torch_module = sys.modules.get("torch")
    if torch_module is None:
        return
    if torch_module.cuda.is_available():
        torch_module.cuda.empty_cache()
    mps = getattr(torch_module, "mps", None)
    backends_mps = getattr(getattr(torch_module, "backends", None), "mps", None)
    if mps is not None and backends_mps is not None and backends_mps.is_available():
        mps.empty_cache()
    xpu = getattr(torch_module, "xpu", None)
    if xpu is not None and xpu.is_available():
        xpu.empty_cache()


def find_max_batch_size(
    try_batch: Callable[[int], None],
    *,
    start: int = 1,
    limit: int | None = None,
    granularity: int = 1,
    reset: Callable[[], None] | None = None,
) -> int:
    """The largest batch size for which ``try_batch`` does not run out of memory.

    ``try_batch(b)`` must run what training runs at batch size ``b`` (forward,
    backward and optimizer step; :func:`probe_model` does it for plain
    PyTorch) and raise on out of memory.  The search first doubles from
    ``start`` until a probe runs out of memory or ``limit`` is reached, then
    bisects between the last size that fitted and the first that did not, so
    it costs about ``2 * log2(max / start)`` probes instead of one per size.
    Between the two bounds only multiples of ``granularity`` are tried (e.g. 8,
    to match tensor-core tile sizes); the doubling sizes (``start``,
    ``2 * start``, ...) and ``limit`` are tried as given.  The answer is always
    a size that was actually run successfully.

    ``limit`` (default: the largest batch size a :class:`~bso.spec.JobSpec`
    accepts) bounds the search; pass it, e.g. the dataset size or the batch
    size beyond which the model is known not to train.  It matters most on CPU,
    where the operating system often swaps or kills the process long before an
    allocation fails.

    Out of memory is recognised by :func:`is_allocation_failure`; every other
    exception from ``try_batch`` propagates unchanged.  After an OOM,
    :func:`free_memory` releases the failed step's memory.  The search assumes
    that memory use grows with the batch size (a size fits if a larger one
    does).

    **The probes train the model.**  Each successful probe runs real optimizer
    steps, so without ``reset`` the weights and optimizer state afterwards are
    not those from before.  ``reset`` is called after every probe, whatever its
    outcome; pass :meth:`TrainingState.restore` (or use
    :func:`preserved_training_state` / :func:`probe_model`) to put the model
    and optimizer back, which also makes every probe start from the same state.

    Raises :class:`~bso_client.errors.NoBatchSizeFits` if ``start`` itself runs
    out of memory, and :class:`ValueError` for arguments out of range.
    """
    ceiling = MAX_BATCH_SIZE if limit is None else limit
    if start < 1:
        raise ValueError(f"start must be a positive batch size, got {start}")
    if granularity < 1:
        raise ValueError(f"granularity must be positive, got {granularity}")
    if ceiling < start:
        raise ValueError(f"limit {limit} is below start {start}")

    probes = 1  # the probe of ``start`` below

    def fits(batch_size: int) -> bool:
        nonlocal probes
        probes += 1
        fitted = _probe(try_batch, batch_size, reset) is None
        logger.debug("batch size %d %s", batch_size, "fits" if fitted else "runs out of memory")
        return fitted

    # The smallest size is probed on its own: its failure is the caller's
    # problem to hear about, with the OOM chained (raised here, outside the
    # probe's except block, so the failed step's frames are already released).
    first_error = _probe(try_batch, start, reset)
    if first_error is not None:
        raise NoBatchSizeFits(start, _first_line(first_error)) from first_error

    # Phase 1: double until the first failure (or until the ceiling fits).
    fitted = start
    failed: int | None = None
    while fitted < ceiling:
        size = min(2 * fitted, ceiling)
        if fits(size):
            fitted = size
        else:
            failed = size
            break
    if failed is None:
        logger.info("batch size search: %d fits (the limit), %d probes", fitted, probes)
        return fitted

    # Phase 2: bisect over the multiples of granularity strictly between them.
    low = fitted // granularity + 1  # smallest k with k * granularity > fitted
    high = (failed - 1) // granularity  # largest k with k * granularity < failed
    while low <= high:
        middle = (low + high) // 2
        if fits(middle * granularity):
            fitted = middle * granularity
            low = middle + 1
        else:
            high = middle - 1
    logger.info("batch size search: %d fits, %d does not, %d probes", fitted, failed, probes)
    return fitted


def _probe(
    try_batch: Callable[[int], None], batch_size: int, reset: Callable[[], None] | None
) -> BaseException | None:
    """Run one probe: None if it fitted, the OOM error if it ran out of memory.

    The error is returned rather than kept in an ``except`` block so that the
    memory is freed after Python has dropped the handler's references to the
    failed frames, and its traceback is cut so that the frames (holding the
    step's activations) are not kept alive by the returned error.
    """
    error: BaseException | None = None
    try:
        try_batch(batch_size)
    except Exception as exc:
        if not is_allocation_failure(exc):
            if reset is not None:
                reset()
            raise
        error = exc.with_traceback(None)
    if error is not None:
        free_memory()
    if reset is not None:
        reset()
    return error


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    line = text[0] if text else type(exc).__name__
    return line if len(line) <= 200 else line[:197] + "..."


class TrainingState:
    """A copy of a model's and optimizer's state, to be put back after probing.

    Taken at construction: the model's ``state_dict`` (parameters and buffers
    such as BatchNorm statistics), its parameters' gradients, which submodules
    are in training mode, the optimizer's ``state_dict`` (moments, step
    counts, learning rates), and, with ``rng``, the process's global state
    (:class:`~bso_client.global_state.GlobalState`: the random generators of
    torch, numpy and Python, grad mode, the ``torch.backends`` flags; a probe
    draws dropout masks, and a training run should not depend on whether it
    was probed first).  Tensors are copied to CPU memory so that the copy
    does not take accelerator memory away from the probes it protects.

    :meth:`restore` may be called any number of times.  Objects the copy does
    not cover (an AMP ``GradScaler``, an EMA of the weights, a learning-rate
    scheduler's own counters) are the caller's to save.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        rng: bool = True,
    ) -> None:

        self._model = model
        self._optimizer = optimizer
        self._model_state = _cpu_copy(model.state_dict())
        self._grads = {
            name: None if p.grad is None else _cpu_copy(p.grad)
            for name, p in model.named_parameters()
        }
        self._modes = [module.training for module in model.modules()]
        self._optimizer_state = None if optimizer is None else _cpu_copy(optimizer.state_dict())
        self._global = GlobalState() if rng else None

    def restore(self) -> None:
        """Put the model, optimizer and global state back as they were when copied."""
        self._model.load_state_dict(self._model_state)
        for name, param in self._model.named_parameters():
            saved = self._grads.get(name)
            param.grad = None if saved is None else saved.to(param.device, copy=True)
        for module, training in zip(self._model.modules(), self._modes, strict=False):
            module.train(training)
        if self._optimizer is not None and self._optimizer_state is not None:
            # A fresh copy each time: Optimizer.load_state_dict keeps the given
            # tensors when they are already on the parameter's device, and the
            # next step would then update our saved copy in place.
            self._optimizer.load_state_dict(_cpu_copy(self._optimizer_state))
        if self._global is not None:
            self._global.restore()


@contextmanager
def preserved_training_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *, rng: bool = True
) -> Iterator[TrainingState]:
    """Copy the training state on entry and restore it on exit, even on error.

    Pass the yielded state's ``restore`` as ``reset`` to
    :func:`find_max_batch_size` so that every probe also starts from it::

        with preserved_training_state(model, optimizer) as state:
            max_bs = find_max_batch_size(my_step, limit=1024, reset=state.restore)
    """
    state = TrainingState(model, optimizer, rng=rng)
    try:
        yield state
    finally:
        state.restore()
        free_memory()


def probe_model(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    make_batch: Callable[[int], tuple[Any, ...]],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    device: torch.device | str | None = None,
    *,
    start: int = 2,
    limit: int | None = None,
    granularity: int = 1,
    steps: int = 2,
) -> int:
    """:func:`find_max_batch_size` for a plain PyTorch model; the model is left as it was.

    ``make_batch(b)`` returns a synthetic or real batch of ``b`` samples as a
    tuple whose last element is the target and whose other elements are the
    model's positional inputs: ``(x, y)`` runs ``loss_fn(model(x), y)``.
    Tensors in it are moved to ``device`` when one is given.  Make the batch
    as large as real ones (longest sequence, full image size): the search
    measures what it is given.

    Each probe runs ``steps`` full training steps (zero_grad, forward,
    backward, optimizer step) in training mode.  Two by default because the
    first optimizer step is when stateful optimizers (Adam's moments) allocate
    their state, so only from the second step on are that state, the
    gradients and the activations in memory at the same time, as in training.

    Weights, gradients, optimizer state, training modes and random generators
    are restored after every probe and at the end (see :class:`TrainingState`).

    ``start`` defaults to 2, not 1, because BatchNorm in training mode cannot
    normalise a single sample and would raise a (non-memory) error at size 1.
    """
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    try_batch = training_steps(model, optimizer, make_batch, loss_fn, device, steps=steps)
    with preserved_training_state(model, optimizer) as state:
        model.train()
        return find_max_batch_size(
            try_batch, start=start, limit=limit, granularity=granularity, reset=state.restore
        )


def training_steps(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    make_batch: Callable[[int], tuple[Any, ...]],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    device: torch.device | str | None = None,
    *,
    steps: int = 1,
) -> Callable[[int], None]:
    """``run(b)``: ``steps`` full training steps (zero_grad, forward, backward,
    optimizer step) on one batch of ``b`` from ``make_batch``.

    ``make_batch(b)`` returns ``(inputs..., target)``; its tensors are moved to
    ``device`` when one is given.  On a CUDA device the call waits for the
    kernels, so that a failure belongs to the batch that caused it.  Shared by
    :func:`probe_model` and :mod:`bso_client.memory_probe`.
    """
    import torch

    target_device = None if device is None else torch.device(device)

    def run(batch_size: int) -> None:
        inputs, target = training_batch(make_batch, batch_size, target_device)
        with torch.enable_grad():  # a training step, even if the caller is under no_grad
            for _ in range(steps):
                optimizer.zero_grad(set_to_none=True)
                loss = loss_fn(model(*inputs), target)
                torch.autograd.backward(loss)
                optimizer.step()
        if target_device is not None and target_device.type == "cuda":
            torch.cuda.synchronize(target_device)

    return run


def training_batch(
    make_batch: Callable[[int], tuple[Any, ...]],
    batch_size: int,
    device: torch.device | None = None,
) -> tuple[list[Any], Any]:
    """``make_batch(batch_size)`` as ``(inputs, target)``, its tensors moved to
    ``device`` when one is given; a result too short to hold both is refused."""
    import torch

    batch = tuple(make_batch(batch_size))
    if len(batch) < 2:
        raise ValueError(
            "make_batch must return a tuple (inputs..., target) of at least two elements, "
            f"got {len(batch)}"
        )
    if device is not None:
        batch = tuple(item.to(device) if isinstance(item, torch.Tensor) else item for item in batch)
    *inputs, target = batch
    return inputs, target


def _cpu_copy(tree: Any) -> Any:
    """Deep copy of a (nested) state dict with every tensor copied to CPU memory."""
    torch_module = sys.modules.get("torch")
    if torch_module is not None and isinstance(tree, torch_module.Tensor):
        return tree.detach().to("cpu", copy=True)
    if isinstance(tree, dict):
        items = ((key, _cpu_copy(value)) for key, value in tree.items())
        copied: dict[Any, Any] = (
            OrderedDict(items) if isinstance(tree, OrderedDict) else dict(items)
        )
        # Module.state_dict() carries per-module versions in `_metadata`, which
        # load_state_dict reads to convert old formats: keep it.
        metadata = getattr(tree, "_metadata", None)
        if metadata is not None:
            setattr(copied, "_metadata", copy.deepcopy(metadata))  # noqa: B010
        return copied
    if isinstance(tree, list):
        return [_cpu_copy(value) for value in tree]
    if isinstance(tree, tuple):
        return tuple(_cpu_copy(value) for value in tree)
    return copy.deepcopy(tree)
