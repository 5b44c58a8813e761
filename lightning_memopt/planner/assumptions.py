"""What an estimate modelled and assumed, in words (:attr:`~lightning_memopt.MemoryEstimate.assumptions`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lightning_memopt.planner.budget import cublas_workspace_bytes, cublas_workspace_config, gpu_compute_capability
from lightning_memopt.utilities.formatting import format_bytes

__all__ = ["assumptions", "cublas_workspace"]


def _sharding_assumptions(world_size: int, cpu_offload: bool, cuda: bool) -> list[str]:
    if world_size == 1:
        return []
    said = [
        f"FSDP2 (fully_shard) over {world_size} ranks, run in one process on a fake process group: the bytes are"
        " rank 0's (uneven shards padded as FSDP2 pads them); collectives in the CPU's order, without overlap"
    ]
    if cpu_offload:
        said.append(
            "CPU offload: sharded parameters, their gradients, optimizer states and the optimizer step on the host"
            " (offloaded_bytes), not in the peak; not counted: the host-to-device copies of a unit's shards while"
            " it is all-gathered"
        )
    if cuda:
        said.append(
            "not counted for FSDP2 on CUDA: NCCL's buffers, memory kept longer by the all-gather and reduce-scatter"
            " streams"
        )
        said.append(
            "optimizer step over the DTensor shards modelled per tensor (CUDA's foreach kernels step them in place:"
            " measured on one GPU within 0.3 %)"
        )
    return said


def _stage_assumptions(stage: str, cuda: bool) -> list[str]:
    if stage == "fit":
        return []
    said = [
        f"trainer.{stage}: the model in eval mode without autograd (Lightning's inference mode), no gradients or"
        " optimizer states; each step's output alive to the end of the step"
    ]
    if stage == "predict":
        where = "moved to the host, not in the peak" if cuda else "kept on the CPU: those of every step run counted"
        said.append(f"trainer.predict keeps every batch's predictions ({where})")
    return said


def cublas_workspace(gpu: str | tuple[int, int] | None, threads: int = 2) -> tuple[int, str]:
    """Bytes of the cuBLAS workspaces (one per thread that runs matrix products: forward's and backward's in training,
    ``threads=1`` for evaluation) and where the size comes from.

    Examples:
        >>> cublas_workspace((9, 0))[0] == 2 * 32 * 1024**2
        True
    """
    capability: tuple[int, int] | None = None
    label = ""
    if gpu is not None:
        capability, label = gpu_compute_capability(gpu)
    config = cublas_workspace_config()
    one = cublas_workspace_bytes(capability, config)
    if config is not None:
        why = f"CUBLAS_WORKSPACE_CONFIG={config!r}"
    elif capability is None:
        why = "torch's default for GPUs other than compute capability 9.0; `gpu='H100-80GB'` counts 32 MiB each"
    else:
        why = f"torch's default for {label}, compute capability {capability[0]}.{capability[1]}"
    if threads == 1:
        return one, f"cuBLAS workspace {format_bytes(one)} ({why})"
    return threads * one, f"cuBLAS workspaces {threads} x {format_bytes(one)} ({why})"


def assumptions(
    *,
    cuda: bool,
    fake: bool,
    foreach: bool,
    mode: str,
    dtype: torch.dtype | None,
    workspace: str,
    accumulate: int,
    attention: str | None,
    corrections: Sequence[str],
    manual: bool,
    world_size: int = 1,
    cpu_offload: bool = False,
    stage: str = "fit",
    param_dtype: torch.dtype | None = None,
) -> tuple[str, ...]:
    """The estimate's assumptions: the evaluation ``stage``, FSDP2 sharding over ``world_size`` ranks (and
    ``cpu_offload``), accumulation, the CUDA models (allocator, ``workspace``, ``attention``, ``foreach``), autocast,
    the fallback, the fake-kernel ``corrections`` made and manual optimization."""
    said = _stage_assumptions(stage, cuda)
    said.extend(_sharding_assumptions(world_size, cpu_offload, cuda))
    if param_dtype is not None:
        said.append(
            f"FSDP2's MixedPrecisionPolicy(param_dtype={param_dtype}, reduce_dtype=torch.float32) on every unit, no"
            " autocast (the Trainer at 32-true): parameters all-gathered and gradients computed in"
            f" {param_dtype}, reduced and kept in float32"
        )
    if accumulate > 1:
        said.append(
            f"gradient accumulation over {accumulate} micro-batches: the gradients stay alive through every"
            " micro-batch, later backwards add into them"
        )
    if cuda:
        said.append("CUDA allocator: every tensor in 512-byte blocks (allocated bytes, not reserved)")
        said.append(workspace)
        if attention:
            said.append(attention)
        if foreach:
            said.append("optimizer foreach=True (torch's default on CUDA)")
        said.append("not counted: CUDA context, reserved-but-unused memory, DDP gradient buckets, NCCL buffers")
    if mode == "mixed":
        lists = "CUDA's float32 list (layer_norm, softmax, sum, ...) in float32" if cuda else "the CPU's op lists"
        said.append(f"autocast to {dtype} around the {'training' if stage == 'fit' else 'evaluation'} step, {lists}")
    if not fake:
        said.append("a real step on the CPU (fallback)")
    said.extend(corrections)
    if manual:
        said.append("manual optimization: the training step run as written, with the optimizers it asks for")
    return tuple(said)
