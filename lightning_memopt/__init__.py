"""lightning-memopt: keep PyTorch Lightning training inside GPU memory, and say why when it cannot.

The names below are imported on first use, so that ``lightning-memopt analyze`` and ``report`` start without
importing torch and Lightning.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lightning_memopt.__about__ import __version__

if TYPE_CHECKING:
    from lightning_memopt.callbacks import (
        AllocatorSettings,
        AutoMicroBatch,
        CacheCleaner,
        GarbageCollector,
        GradientCheckpointing,
        MemoryAudit,
        MemoryMonitor,
        OOMReporter,
    )
    from lightning_memopt.data import TokenBudgetBatchSampler
    from lightning_memopt.functional.conversion import to_device_and_dtype
    from lightning_memopt.functional.readings.memory import MemoryReading, read_memory
    from lightning_memopt.metrics import StreamingRetrievalMetric
    from lightning_memopt.planner import (
        MemoryEstimate,
        MemoryEstimateError,
        MemoryPlan,
        TokenBudgetPlan,
        estimate_generation,
        estimate_memory,
        longest_input,
        plan_memory,
        plan_token_budget,
    )
    from lightning_memopt.plugins import MemoryPrecision
    from lightning_memopt.presets import MemoryPreset, MemoryPresetCLI
    from lightning_memopt.utilities.oom import is_out_of_memory_error

#: Where each public name lives.
_EXPORTS = {
    "AllocatorSettings": "lightning_memopt.callbacks",
    "AutoMicroBatch": "lightning_memopt.callbacks",
    "CacheCleaner": "lightning_memopt.callbacks",
    "GarbageCollector": "lightning_memopt.callbacks",
    "GradientCheckpointing": "lightning_memopt.callbacks",
    "MemoryAudit": "lightning_memopt.callbacks",
    "MemoryMonitor": "lightning_memopt.callbacks",
    "OOMReporter": "lightning_memopt.callbacks",
    "MemoryPrecision": "lightning_memopt.plugins",
    "MemoryPreset": "lightning_memopt.presets",
    "MemoryPresetCLI": "lightning_memopt.presets",
    "MemoryReading": "lightning_memopt.functional.readings.memory",
    "read_memory": "lightning_memopt.functional.readings.memory",
    "StreamingRetrievalMetric": "lightning_memopt.metrics",
    "to_device_and_dtype": "lightning_memopt.functional.conversion",
    "MemoryEstimate": "lightning_memopt.planner",
    "MemoryEstimateError": "lightning_memopt.planner",
    "is_out_of_memory_error": "lightning_memopt.utilities.oom",
    "MemoryPlan": "lightning_memopt.planner",
    "estimate_memory": "lightning_memopt.planner",
    "estimate_generation": "lightning_memopt.planner",
    "plan_memory": "lightning_memopt.planner",
    "plan_token_budget": "lightning_memopt.planner",
    "longest_input": "lightning_memopt.planner",
    "TokenBudgetPlan": "lightning_memopt.planner",
    "TokenBudgetBatchSampler": "lightning_memopt.data",
}

__all__ = [
    "AllocatorSettings",
    "AutoMicroBatch",
    "CacheCleaner",
    "GarbageCollector",
    "GradientCheckpointing",
    "MemoryAudit",
    "MemoryEstimate",
    "MemoryEstimateError",
    "MemoryMonitor",
    "MemoryPlan",
    "MemoryPrecision",
    "MemoryPreset",
    "MemoryPresetCLI",
    "MemoryReading",
    "OOMReporter",
    "StreamingRetrievalMetric",
    "TokenBudgetBatchSampler",
    "TokenBudgetPlan",
    "__version__",
    "estimate_generation",
    "estimate_memory",
    "is_out_of_memory_error",
    "longest_input",
    "plan_memory",
    "plan_token_budget",
    "read_memory",
    "to_device_and_dtype",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lightning_memopt' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups do not come here again
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
