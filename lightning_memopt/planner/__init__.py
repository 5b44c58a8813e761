"""Will it fit? A training step's peak memory, predicted before training, without the GPU and without the memory.

:func:`estimate_memory` (``estimate.py``) runs two training steps of a fake twin of the model (fake CPU tensors:
shapes and dtypes, no data) in Lightning's order and counts the bytes of every tensor alive, to the byte on the CPU;
for a CUDA target it models what CUDA does differently and says so in :attr:`MemoryEstimate.assumptions`. The engine
is Trainer-free and lives in :mod:`lightning_memopt.functional.planning`; ``model_step.py`` says how the user's model
is trained there (its loss, optimizers, checkpointing). :func:`plan_memory` (``plan.py``) searches the micro-batch,
accumulation, precision and checkpointing that fit a budget (``budget.py``: bytes, a size or a GPU's name; a GPU's
compute capability sets its cuBLAS workspace) and returns numbers, a :class:`MemoryPlan`:
``MemoryPreset.from_plan(plan)`` (in :mod:`lightning_memopt.presets`, the layer above) builds the preset. Nothing here
imports the presets. :class:`MemoryEstimateError` is raised when a step cannot be estimated.
:func:`estimate_generation` (``generation.py``) estimates Hugging Face's ``generate`` at a length, through
``estimate_memory(stage="predict")``.
"""

from lightning_memopt.planner.budget import (
    CUDA_CONTEXT_BYTES,
    GPU_COMPUTE_CAPABILITY,
    GPU_MEMORY,
    cublas_workspace_bytes,
    parse_budget,
)
from lightning_memopt.planner.estimate import ESTIMATE_PRECISIONS, MemoryEstimate, estimate_memory
from lightning_memopt.planner.generation import estimate_generation
from lightning_memopt.planner.model_step import MemoryEstimateError
from lightning_memopt.planner.plan import MemoryPlan, plan_memory
from lightning_memopt.planner.search import PlanTrial
from lightning_memopt.planner.token_budget import TokenBudgetPlan, longest_input, plan_token_budget

__all__ = [
    "TokenBudgetPlan",
    "longest_input",
    "plan_token_budget",
    "CUDA_CONTEXT_BYTES",
    "ESTIMATE_PRECISIONS",
    "GPU_COMPUTE_CAPABILITY",
    "GPU_MEMORY",
    "MemoryEstimate",
    "MemoryEstimateError",
    "MemoryPlan",
    "PlanTrial",
    "cublas_workspace_bytes",
    "estimate_generation",
    "estimate_memory",
    "parse_budget",
    "plan_memory",
]
