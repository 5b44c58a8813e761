"""A model sharded with FSDP2 (``fully_shard``) in this one process, on torch's fake process group.

Collectives of the fake group do nothing, so one process holds rank 0's shards of an N-way sharding: enough for
everything that reads how a model is sharded (no training step: its all-gathers would gather nothing).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

WIDTH = 32


def blocks(num_blocks: int = 2) -> nn.Sequential:
    """``num_blocks`` MLP blocks (``Linear(32, 128)``, ``Linear(128, 32)``) and a ``Linear(32, 3)`` head."""
    torch.manual_seed(0)
    layers: list[nn.Module] = [
        nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.ReLU(), nn.Linear(4 * WIDTH, WIDTH)) for _ in range(num_blocks)
    ]
    return nn.Sequential(*layers, nn.Linear(WIDTH, 3))


@contextlib.contextmanager
def fake_mesh(
    world_size: int = 2,
    backend: str = "fake",
    shape: tuple[int, ...] | None = None,
    names: tuple[str, ...] = ("data_parallel",),
) -> Iterator[Any]:
    """A device mesh of ``world_size`` CPU ranks (1-D ``data_parallel`` unless ``shape`` and ``names`` say
    otherwise) on the fake process group, as rank 0; the group is destroyed afterwards.

    ``backend="gloo"`` (``world_size=1`` only) gives a real group of one process: forward and backward run, with
    every shard the whole parameter. A test that finds a process group already initialized is skipped.
    """
    import pytest
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    store = FakeStore() if backend == "fake" else dist.HashStore()
    dist.init_process_group(backend, store=store, rank=0, world_size=world_size)
    try:
        yield init_device_mesh("cpu", shape or (world_size,), mesh_dim_names=names)
    finally:
        dist.destroy_process_group()


def shard(model: nn.Sequential, mesh: Any, **block_kwargs: Any) -> nn.Sequential:
    """``fully_shard`` each block of ``model`` (with ``block_kwargs``), then the whole, as a ``configure_model``
    would."""
    from torch.distributed.fsdp import fully_shard

    for block in model[:-1]:
        fully_shard(block, mesh=mesh, **block_kwargs)
    fully_shard(model, mesh=mesh)
    return model
