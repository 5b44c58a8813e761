"""The real per-rank peak of FSDP2 training steps: N gloo processes (forked), plain torch (no Lightning).

Usage: ``python fsdp2_peak.py PORT WORLD_SIZE``; writes ``peak_{rank}.json``: for ``reshard_after_forward`` True and
False (and True with AdamW's ``foreach`` step, key ``"foreach"``), the most bytes alive at once on that rank over two
training steps of :class:`ResidualMLP` in Lightning's order (forward, ``zero_grad(set_to_none=True)``, backward,
``AdamW.step``), each ``fully_shard`` per block and at the root.

The bytes are counted by a live-storage counter of its own (not the planner's): every storage an operator creates,
its local shard for a ``DTensor`` (a DTensor's own storage reports the global size), and every storage FSDP2 frees or
re-creates with ``UntypedStorage.resize_`` (no operator shows it). Fake tensors are not memory: DTensor makes them
the first time it meets an operator, to learn its output's shape (AdamW's ``foreach`` step: 5.8 MB of them here). A
storage leaves the count when its last holder lets go, which for a collective's tensors can be gloo's worker thread a
moment after the collective has returned: a new high waits ``SETTLE_SECONDS`` for that thread, so the peak is the
step's, not the thread scheduler's.
"""

from __future__ import annotations

import json
import os
import sys
import time
import weakref
from typing import Any

import torch
from torch import nn

#: How long a new high waits for gloo's worker thread (see ``Live.grow``).
SETTLE_SECONDS = 0.002
WIDTH = 128
BLOCKS = 4
BATCH = 16


class Block(nn.Module):
    """A residual MLP block: ``x + fc2(relu(fc1(x)))``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


class ResidualMLP(nn.Module):
    """``BLOCKS`` residual blocks in a ``ModuleList`` and a head; the output is the loss (a sum).

    Examples:
        >>> ResidualMLP()(torch.ones(2, WIDTH)).shape
        torch.Size([])
    """

    def __init__(self, width: int = WIDTH, blocks: int = BLOCKS) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))
        self.head = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x).sum()


def make_batch() -> torch.Tensor:
    return torch.randn(BATCH, WIDTH)


def lightning_steps(
    model: nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor, steps: int, after_step: Any = None
) -> None:
    """``steps`` training steps in Lightning's order: forward, ``zero_grad(set_to_none=True)``, backward (the loss
    freed after it), the optimizer step; ``after_step()`` after each."""
    for _ in range(steps):
        loss = model(batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        del loss
        optimizer.step()
        if after_step is not None:
            after_step()


def _storages(tensor: torch.Tensor) -> list[torch.UntypedStorage]:
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if not is_traceable_wrapper_subclass(tensor):
        return [tensor.untyped_storage()]
    names, _ = tensor.__tensor_flatten__()
    inner = [getattr(tensor, n) for n in names]
    return [s for t in inner if isinstance(t, torch.Tensor) for s in _storages(t)]


def peak_bytes(world_size: int, reshard_after_forward: bool, foreach: bool = False, steps: int = 2) -> int:
    """The peak bytes alive on this rank over ``steps`` training steps (a process group must be initialised);
    ``foreach``: AdamW's multi-tensor step (CUDA's default)."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass_type
    from torch.utils._pytree import tree_flatten

    class Live(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.sizes: dict[int, int] = {}
            self.now = self.peak = 0

        def track(self, tensor: torch.Tensor) -> None:
            if isinstance(tensor, FakeTensor):  # DTensor's metadata runs (an operator's output shape): no memory
                return
            for storage in _storages(tensor):
                key = id(storage)
                if key not in self.sizes:
                    self.sizes[key] = storage.nbytes()
                    self.grow(storage.nbytes())
                    weakref.finalize(storage, lambda k=key: self.grow(-self.sizes.pop(k)))

        def grow(self, nbytes: int) -> None:
            self.now += nbytes
            if self.now > self.peak:
                # gloo's worker thread lets go of a finished collective's tensors after it has signalled completion:
                # let it, before a new high is taken (a dropped buffer it still held is not a byte the step needs)
                time.sleep(SETTLE_SECONDS)
                self.peak = max(self.peak, self.now)

        def resized(self, storage: torch.UntypedStorage) -> None:
            key = id(storage)
            if key in self.sizes:
                self.grow(storage.nbytes() - self.sizes[key])
                self.sizes[key] = storage.nbytes()

        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
            if any(is_traceable_wrapper_subclass_type(t) for t in types):
                return NotImplemented  # a DTensor runs on its local shard
            out = func(*args, **(kwargs or {}))
            for value in tree_flatten(out)[0]:
                if isinstance(value, torch.Tensor):
                    self.track(value)
            return out

    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    model = ResidualMLP()
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    batch = make_batch()
    counter = Live()
    for tensor in [*model.parameters(), batch]:
        counter.track(tensor)
    original = torch.UntypedStorage.resize_

    def resize_(storage: torch.UntypedStorage, size: int) -> Any:
        out = original(storage, size)
        counter.resized(storage)
        return out

    torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
    try:
        with counter:
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=foreach)
            lightning_steps(model, optimizer, batch, steps)
    finally:
        torch.UntypedStorage.resize_ = original  # type: ignore[method-assign]
    return counter.peak


def tracker_peak(model: nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor, steps: int = 2) -> dict:
    """torch's own ``FSDPMemTracker`` (no package code) over ``steps`` training steps of a sharded ``model`` in
    Lightning's order, the loss freed after backward, inside the caller's fake mode and fake process group: its peak
    by part (``"Total"``, ``"Sharded Param"``, ``"Unsharded Param"``, ...)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    tracker = FSDPMemTracker(model, optimizer)
    tracker.track_inputs((batch,))
    with tracker:
        lightning_steps(model, optimizer, batch, steps, after_step=tracker.reset_mod_stats)
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    return {str(getattr(k, "value", k)): int(v) for k, v in peak.items()}


def run(rank: int, world_size: int, port: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        peaks = {str(r).lower(): peak_bytes(world_size, r) for r in (True, False)}
        peaks["foreach"] = peak_bytes(world_size, True, foreach=True)
    finally:
        dist.destroy_process_group()
    with open(f"peak_{rank}.json", "w") as f:
        json.dump(peaks, f)


if __name__ == "__main__":
    import torch.multiprocessing as mp

    torch.set_num_threads(1)
    world = int(sys.argv[2])
    mp.start_processes(run, args=(world, sys.argv[1]), nprocs=world, start_method="fork")
