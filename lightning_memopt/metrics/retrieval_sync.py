"""The ``torch.distributed`` collectives ``StreamingRetrievalMetric.compute()`` injects into the shared ranking."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_memopt.functional.retrieval import Collectives
from lightning_memopt.functional.retrieval.ranking import ReduceOp

__all__ = ["DistributedCollectives"]

#: The first thing every process sends in ``compute()``: a value no other collective is likely to carry.
_HANDSHAKE = 0x5EED_C0DE_2025

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


class DistributedCollectives(Collectives):
    """The collectives of a process group; a no-op world of one when not distributed.

    Args:
        group: the process group (``None``: the default group).

    Example:
        >>> comm = DistributedCollectives()  # not distributed here: a world of one
        >>> comm.rank, comm.world, comm.all_gather_rows(torch.ones(2, 1)).shape
        (0, 1, torch.Size([2, 1]))
    """

    def __init__(self, group: Any = None) -> None:
        self.group = group
        self.active = dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
        self.rank = dist.get_rank(group) if self.active else 0
        self.world = dist.get_world_size(group) if self.active else 1
        self.device = torch.device("cpu")
        if self.active and dist.get_backend(group) == "nccl":
            self.device = torch.device("cuda", torch.cuda.current_device())

    def handshake(self) -> None:
        """Check that every process is in ``compute()``: the first collective, with a token only it sends."""
        if not self.active:
            return
        token = torch.tensor([[_HANDSHAKE, self.rank, _HANDSHAKE]], dtype=torch.int64, device=self.device)
        out = [torch.zeros_like(token) for _ in range(self.world)]
        problem = (
            "Every process must call `StreamingRetrievalMetric.compute()` (it synchronises): call it on all ranks, not"
            ' under `if trainer.is_global_zero`, and log its values with `sync_dist=True, reduce_fx="max"`.'
        )
        try:
            dist.all_gather(out, token, group=self.group)
        except RuntimeError as err:
            raise RuntimeError(f"{problem} The first collective of compute() failed: {err}") from err
        got = torch.cat(out).cpu()
        stray = ((got[:, 0] != _HANDSHAKE) | (got[:, 2] != _HANDSHAKE)).nonzero().flatten().tolist()
        if stray:
            raise RuntimeError(f"{problem} Process(es) {stray} were in another collective.")

    def all_reduce(self, values: Tensor, op: ReduceOp) -> Tensor:
        if not self.active:
            return values
        reduced = values.to(self.device).clone()
        dist.all_reduce(reduced, op=_OPS[op], group=self.group)
        return reduced.to(values.device)

    def all_gather_rows(self, rows: Tensor) -> Tensor:
        """Concatenate every process's rows of a 2-D tensor (row counts may differ), in rank order."""
        if not self.active:
            return rows
        n = torch.tensor([rows.shape[0]], dtype=torch.int64, device=self.device)
        counts = [torch.zeros_like(n) for _ in range(self.world)]
        dist.all_gather(counts, n, group=self.group)
        counts_i = [int(c.item()) for c in counts]
        most = max(counts_i)
        padded = torch.zeros((most, *rows.shape[1:]), dtype=rows.dtype, device=self.device)
        padded[: rows.shape[0]] = rows.to(self.device)
        out = [torch.empty_like(padded) for _ in range(self.world)]
        dist.all_gather(out, padded, group=self.group)
        return torch.cat([o[:c] for o, c in zip(out, counts_i)], 0).to(rows.device)
