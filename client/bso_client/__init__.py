"""Training-loop client for the bso service.

Everything a training script needs is importable from here::

    from bso_client import BatchSizeOptimizer, JobSpec, TrainFailError

The names are resolved on first use (PEP 562), so ``import bso_client`` stays
cheap and pulls in neither torch, nor the Celery transport, nor anything of
the server (SQLAlchemy, the worker code).  The framework callbacks live in
:mod:`bso_client.integrations` and import their framework when imported.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bso.core.growth import BatchGrowth
    from bso.spec import Hardware, JobSpec
    from bso_client.batch_candidates import auto_batch_sizes, candidate_batch_sizes
    from bso_client.batch_search import (
        find_max_batch_size,
        preserved_training_state,
        probe_model,
    )
    from bso_client.discovery import Discovery
    from bso_client.distributed import Collective, SingleProcess, TorchCollective
    from bso_client.energy.base import EnergyFallbackWarning, EnergyMonitor, Measurement
    from bso_client.energy.detect import detect_monitor
    from bso_client.energy.nvml import NvmlMonitor
    from bso_client.energy.rapl import RaplMonitor
    from bso_client.energy.time_only import TimeOnlyMonitor
    from bso_client.errors import (
        BsoError,
        ConfigMismatch,
        DistributedSetupError,
        MetricTypeError,
        MixedGpuModels,
        NoBatchSizeFits,
        OperationOrderError,
        RankZeroError,
        ServiceUnavailable,
        TrainFailError,
        UnexpectedBatchSize,
    )
    from bso_client.lr import ScalingRule, scale_lr, scale_optimizer_lr
    from bso_client.optimizer import BatchSizeOptimizer
    from bso_client.run_status import EXIT_RELAUNCH, RunStatus
    from bso_client.service_calls import BsoServiceLike
    from bso_client.transport import ServiceClient

_EXPORTS: dict[str, str] = {
    "BatchGrowth": "bso.core.growth",
    "Discovery": "bso_client.discovery",
    "find_max_batch_size": "bso_client.batch_search",
    "probe_model": "bso_client.batch_search",
    "auto_batch_sizes": "bso_client.batch_candidates",
    "candidate_batch_sizes": "bso_client.batch_candidates",
    "preserved_training_state": "bso_client.batch_search",
    "NoBatchSizeFits": "bso_client.errors",
    "BatchSizeOptimizer": "bso_client.optimizer",
    "RunStatus": "bso_client.run_status",
    "EXIT_RELAUNCH": "bso_client.run_status",
    "BsoServiceLike": "bso_client.service_calls",
    "JobSpec": "bso.spec",
    "Hardware": "bso.spec",
    "ServiceClient": "bso_client.transport",
    "Collective": "bso_client.distributed",
    "SingleProcess": "bso_client.distributed",
    "TorchCollective": "bso_client.distributed",
    "EnergyFallbackWarning": "bso_client.energy.base",
    "EnergyMonitor": "bso_client.energy.base",
    "Measurement": "bso_client.energy.base",
    "RaplMonitor": "bso_client.energy.rapl",
    "TimeOnlyMonitor": "bso_client.energy.time_only",
    "detect_monitor": "bso_client.energy.detect",
    "NvmlMonitor": "bso_client.energy.nvml",
    "MixedGpuModels": "bso_client.errors",
    "ScalingRule": "bso_client.lr",
    "scale_lr": "bso_client.lr",
    "scale_optimizer_lr": "bso_client.lr",
    "BsoError": "bso_client.errors",
    "ConfigMismatch": "bso_client.errors",
    "DistributedSetupError": "bso_client.errors",
    "MetricTypeError": "bso_client.errors",
    "OperationOrderError": "bso_client.errors",
    "RankZeroError": "bso_client.errors",
    "ServiceUnavailable": "bso_client.errors",
    "TrainFailError": "bso_client.errors",
    "UnexpectedBatchSize": "bso_client.errors",
}

__all__ = [
    "EXIT_RELAUNCH",
    "BatchGrowth",
    "BatchSizeOptimizer",
    "BsoError",
    "BsoServiceLike",
    "Collective",
    "ConfigMismatch",
    "Discovery",
    "DistributedSetupError",
    "EnergyFallbackWarning",
    "EnergyMonitor",
    "Hardware",
    "JobSpec",
    "Measurement",
    "MetricTypeError",
    "MixedGpuModels",
    "NoBatchSizeFits",
    "NvmlMonitor",
    "OperationOrderError",
    "RankZeroError",
    "RaplMonitor",
    "RunStatus",
    "ScalingRule",
    "ServiceClient",
    "ServiceUnavailable",
    "SingleProcess",
    "TimeOnlyMonitor",
    "TorchCollective",
    "TrainFailError",
    "UnexpectedBatchSize",
    "auto_batch_sizes",
    "candidate_batch_sizes",
    "detect_monitor",
    "find_max_batch_size",
    "preserved_training_state",
    "probe_model",
    "scale_lr",
    "scale_optimizer_lr",
]


def __getattr__(name: str) -> Any:
    """Import the module that defines ``name`` on first access (PEP 562)."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'bso_client' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
