"""On a GPU: the sharded CUDA estimate against a real FSDP2 step's allocator peak (``cuda`` mark; skipped without one).

One GPU holds one rank of an N-rank ``fully_shard`` run over torch's fake process group: the allocations, the CUDA
streams and the autocast casts are real, the collectives do not communicate (so NCCL's own buffers are not in the
measured peak either). The tolerance is the single-device planner's (``tests/zoo/test_zoo_estimate.py``).
"""

from __future__ import annotations

import contextlib
import gc

import pytest
import torch
import torch.distributed as dist

from lightning_memopt import estimate_memory
from tests.scripts.fsdp2_peak import ResidualMLP

CUDA_TOLERANCE = 0.10
WIDTH, BLOCKS, BATCH = 1024, 4, 512


@contextlib.contextmanager
def _fake_group_store():
    """torch before 2.13 needs a store for its ``"fake"`` backend (GPU machines may run an older torch)."""
    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError:  # pragma: no cover - the backend needs none
        yield
        return
    original = dist.init_process_group

    def init(backend=None, *args, **kwargs):
        if backend == "fake" and kwargs.get("store") is None:
            kwargs["store"] = FakeStore()
        return original(backend, *args, **kwargs)

    dist.init_process_group = init
    try:
        yield
    finally:
        dist.init_process_group = original


def _real_peak(world_size: int, reshard: bool, offload: bool, precision: str) -> int:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    gc.collect()  # FSDP2's state of an earlier case holds reference cycles: free it before measuring
    torch.cuda.empty_cache()
    dist.init_process_group("fake", rank=0, world_size=world_size)
    try:
        mesh = init_device_mesh("cuda", (world_size,))
        with torch.device("meta"):
            model = ResidualMLP(WIDTH, BLOCKS)
        options = {"mesh": mesh, "reshard_after_forward": reshard}
        if offload:
            options["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
        for block in model.blocks:
            fully_shard(block, **options)
        fully_shard(model, **options)
        model.to_empty(device="cpu" if offload else "cuda")
        batch = torch.randn(BATCH, WIDTH, device="cuda")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        for _ in range(2):  # in Lightning's order: training step, zero_grad, backward, optimizer step
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
                loss = model(batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            del loss
            optimizer.step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()
    finally:
        dist.destroy_process_group()


@pytest.mark.cuda
@pytest.mark.parametrize(
    ("world_size", "reshard", "offload", "precision"),
    [
        (2, True, False, "32-true"),
        (2, False, False, "32-true"),
        (4, True, False, "32-true"),
        (2, True, False, "bf16-mixed"),
        (2, True, True, "32-true"),
    ],
)
def test_the_sharded_cuda_estimate_is_within_10_percent_of_a_real_fsdp2_step(world_size, reshard, offload, precision):
    with _fake_group_store():
        estimated = estimate_memory(
            ResidualMLP(WIDTH, BLOCKS),
            torch.empty(BATCH, WIDTH, device="meta"),
            device="cuda",
            precision=precision,
            gpu=torch.cuda.get_device_capability(),
            world_size=world_size,
            reshard_after_forward=reshard,
            cpu_offload=offload,
        )
        measured = _real_peak(world_size, reshard, offload, precision)
    print(f"world {world_size} reshard {reshard} offload {offload} {precision}: {estimated.peak_bytes} vs {measured}")
    assert estimated.peak_bytes == pytest.approx(measured, rel=CUDA_TOLERANCE), (estimated.peak_bytes, measured)
