"""The sharded CUDA estimate against a real GPU: one rank of an FSDP2 step, on a fake process group, on one card.

A fake process group (torch's ``"fake"`` backend: collectives return at once, nothing is communicated) lets one GPU
run rank 0 of an N-rank ``fully_shard`` step for real: every local shard, all-gathered parameter, gradient and
optimizer state of that rank is allocated on the card, with the shapes of a real N-rank run (the values are not
those of one; memory does not depend on them). Its ``torch.cuda.max_memory_allocated()`` over two training steps in
Lightning's order is put next to ``estimate_memory(..., device="cuda", world_size=N)``.

The model: 8 residual MLP blocks of width 1024 (hidden 4096) and a head, ~68M parameters, batch 512, ``fully_shard``
per block and at the root (N = 2, 4), or not sharded (N = 1); fp32 and bf16-mixed (CUDA autocast), AdamW with
``foreach`` True (torch's CUDA default) and False. The allocator is emptied and the cuBLAS workspaces released
between cases; the peak is reset after the model and the batch are on the card.

    python benchmarks/sharded_cuda.py --out benchmarks/results/sharded_cuda_h200.json     # ~35 s on an H200

Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from lightning_memopt.planner import estimate_memory  # noqa: E402

__all__ = ["ResidualMLP", "measured_peak"]

WIDTH, BATCH = 1024, 512


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.a = nn.Linear(width, 4 * width)
        self.b = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.relu(self.a(x)))


class ResidualMLP(nn.Module):
    def __init__(self, width: int = WIDTH, blocks: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))
        self.head = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x).float().sum()


def measured_peak(world_size: int, foreach: bool, precision: str) -> int:
    """Rank 0's allocator peak over two real steps on the GPU (sharded over a fake group when ``world_size`` > 1)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = ResidualMLP()
    if world_size > 1:
        dist.init_process_group("fake", rank=0, world_size=world_size)
        mesh = init_device_mesh("cuda", (world_size,))
        for unit in [*model.blocks, model]:
            fully_shard(unit, mesh=mesh)
    model.cuda()
    x = torch.randn(BATCH, WIDTH, device="cuda")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=foreach)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(2):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision != "32-true"):
            loss = model(x)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        del loss
        optimizer.step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del model, optimizer, x
    if world_size > 1:
        dist.destroy_process_group()
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    return peak


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    rows = []
    for precision in ("32-true", "bf16-mixed"):
        for foreach in (True, False):
            for world_size in (1, 2, 4):
                started = time.perf_counter()
                est = estimate_memory(
                    ResidualMLP(),
                    torch.randn(BATCH, WIDTH),
                    device="cuda",
                    precision=precision,
                    optimizer=functools.partial(torch.optim.AdamW, lr=1e-3, foreach=foreach),
                    world_size=world_size,
                    gpu=torch.cuda.get_device_capability(),
                )
                seconds = time.perf_counter() - started
                measured = measured_peak(world_size, foreach, precision)
                rows.append(
                    {
                        "precision": precision,
                        "foreach": foreach,
                        "world_size": world_size,
                        "predicted": est.peak_bytes,
                        "measured": measured,
                        "ratio": est.peak_bytes / measured,
                        "estimate_s": seconds,
                        "temporaries": est.at_peak.get("temporaries"),
                    }
                )
                print(rows[-1], flush=True)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
