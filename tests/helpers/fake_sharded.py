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
def fake_mesh(world_size: int = 2, backend: str = "fake") -> Iterator[Any]:
    """A 1-D ``data_parallel`` device mesh of ``world_size`` CPU ranks on the fake process group (rank 0).

    ``backend="gloo"`` (``world_size=1`` only) gives a real group of one process: forward and backward run, with
    every shard the whole parameter.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    store = FakeStore() if backend == "fake" else dist.HashStore()
    dist.init_process_group(backend, store=store, rank=0, world_size=world_size)
    try:
        yield init_device_mesh("cpu", (world_size,), mesh_dim_names=("data_parallel",))
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
