"""The reference for the planner's estimates: Lightning's training steps run on real CPU tensors, every micro-batch
of every optimizer step, with the bytes alive counted by the same live-storage counter (no fake tensors, no twin)."""

from __future__ import annotations

import contextlib
import copy
import gc
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

from lightning_memopt.functional.planning import LiveBytes

__all__ = [
    "cuda_fit_peak",
    "empty_cuda_allocator",
    "measured_peak",
    "memtracker_peak",
    "trainer_evaluation_peak",
    "trainer_peak",
    "training_step_loss",
]


def training_step_loss(model: nn.Module, batch: Any, batch_idx: int) -> Tensor:
    """A LightningModule's ``training_step`` loss (a tensor or ``{"loss": ...}``)."""
    out = model.training_step(batch, batch_idx)
    return out["loss"] if isinstance(out, dict) else out


def measured_peak(
    module: nn.Module,
    batch: Any,
    *,
    optimizers: Callable[[nn.Module], list[torch.optim.Optimizer]],
    loss: Callable[[nn.Module, Any, int], Tensor] | None = training_step_loss,
    accumulate_grad_batches: int = 1,
    steps: int = 2,
    manual: Callable[[nn.Module, list[torch.optim.Optimizer]], None] | None = None,
) -> int:
    """The peak bytes of ``steps`` optimizer steps in Lightning's order on a copy of ``module``: per micro-batch the
    loss (divided by ``accumulate_grad_batches`` when over 1), ``zero_grad`` at the first micro-batch only,
    backward; the optimizer step after the last. ``manual(model, optimizers)`` instead prepares a manually optimized
    module, whose ``training_step`` is then the whole step."""
    model = copy.deepcopy(module)
    model.train()
    counter = LiveBytes()
    for t in [*model.parameters(), *model.buffers(), *tree_flatten(batch)[0]]:
        if isinstance(t, Tensor):
            counter.track(t)
    with counter, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*self.log.*")  # a LightningModule's step without its Trainer
        opts = optimizers(model)
        if manual is not None:
            manual(model, opts)
        for step in range(steps):
            for micro in range(accumulate_grad_batches):
                if manual is not None:
                    model.training_step(batch, step)
                    continue
                value = loss(model, batch, step * accumulate_grad_batches + micro)
                if accumulate_grad_batches > 1:
                    value = value / accumulate_grad_batches
                if micro == 0:
                    for opt in opts:
                        opt.zero_grad(set_to_none=True)
                value.backward()
                del value
            if manual is None:
                for opt in opts:
                    opt.step()
    return counter.peak


def trainer_peak(module: Any, tmp_path: Any, *, accumulate_grad_batches: int = 1, optimizer_steps: int = 2) -> int:
    """The peak bytes of a real ``Trainer.fit`` of a zoo ``module`` on the CPU (``optimizer_steps`` optimizer steps),
    counted by the live-storage counter, less the training set (built before, alive throughout). Lightning adds a
    few scalars of its own (the loss it keeps, logged values): tens of bytes."""
    from tests.helpers.trainer import make_trainer

    loader = module.train_dataloader()
    module.train_dataloader = lambda: loader
    counter, dataset_bytes = _counter_of(module, loader)
    manual = not module.automatic_optimization
    config = module.configure_optimizers() if manual else None  # manual: every optimizer steps once per batch
    optimizers = len(config) if isinstance(config, (list, tuple)) else 1
    trainer = make_trainer(
        tmp_path,
        max_steps=optimizer_steps * optimizers,
        limit_train_batches=optimizer_steps * accumulate_grad_batches,
        limit_val_batches=0,
        accumulate_grad_batches=accumulate_grad_batches,
    )
    with counter:
        trainer.fit(module)
    return counter.peak - dataset_bytes


def _counter_of(module: Any, loader: Any) -> tuple[LiveBytes, int]:
    """A counter that holds ``module``'s parameters and buffers and the zoo ``loader``'s dataset (built before a run,
    alive throughout); the dataset's bytes, which a run's peak is given less."""
    counter = LiveBytes()
    for t in [*module.parameters(), *module.buffers()]:
        counter.track(t)
    dataset = [t for t in tree_flatten(loader.dataset.batch)[0] if isinstance(t, Tensor)]
    for t in dataset:
        counter.track(t, "dataset")
    return counter, sum(t.untyped_storage().nbytes() for t in dataset)


def trainer_evaluation_peak(module: Any, tmp_path: Any, stage: str, *, batches: int = 2) -> int:
    """The peak bytes of a real ``trainer.validate/test/predict`` of a zoo ``module`` on the CPU over ``batches`` of
    its validation set, counted by the live-storage counter, less the evaluation set (built before, alive
    throughout)."""
    from tests.helpers.trainer import make_trainer

    loader = module.val_dataloader()
    counter, dataset_bytes = _counter_of(module, loader)
    limits = {f"limit_{name}_batches": batches for name in ("val", "test", "predict")}
    trainer = make_trainer(tmp_path, **limits)
    with counter, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        getattr(trainer, stage)(module, dataloaders=loader)
    return counter.peak - dataset_bytes


def memtracker_peak(module: nn.Module, batch: Any, precision: str = "32-true", steps: int = 2) -> int:
    """Peak CPU bytes of ``steps`` real training steps of a LightningModule with automatic optimization and one
    optimizer, measured by torch's own ``MemTracker`` (``torch.distributed._tools.mem_tracker``, no package code)
    over a plain loop in Lightning's order: ``training_step`` (under bf16 autocast for ``"bf16-mixed"``),
    ``zero_grad``, backward, optimizer step."""
    from torch.distributed._tools.mem_tracker import MemTracker

    config = module.configure_optimizers()
    optimizer = config["optimizer"] if isinstance(config, dict) else config
    module.train()
    tracker = MemTracker()
    tracker.track_external(module, optimizer, batch)
    autocast = precision == "bf16-mixed"
    with tracker, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*self.log.*")
        warnings.filterwarnings("ignore", message="Module is None")  # MemTracker's hooks on a freed module
        for step in range(steps):
            with torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
                loss = training_step_loss(module, batch, step)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            del loss
            optimizer.step()
            if step == 0:
                tracker.reset_mod_stats()
    return int(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])


def empty_cuda_allocator() -> int:
    """Release CUDA's cached blocks and cuBLAS workspaces and reset the peak; returns the bytes still allocated."""
    gc.collect()
    torch.cuda.synchronize()
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def cuda_fit_peak(entry: Any, precision: str, batch_size: int, optimizer_steps: int = 2) -> int:
    """``torch.cuda.max_memory_allocated()`` over a real ``Trainer.fit`` of a zoo entry on the GPU
    (``optimizer_steps`` optimizer steps), from an empty allocator: cached blocks and cuBLAS workspaces released."""
    from tests.helpers.lightning import pl

    module = entry.build(batch_size=batch_size)
    config = None if module.automatic_optimization else module.configure_optimizers()
    optimizers = len(config) if isinstance(config, (list, tuple)) else 1
    trainer = pl.Trainer(
        accelerator="cuda",
        devices=1,
        precision=precision,
        max_steps=optimizer_steps * optimizers,
        limit_train_batches=optimizer_steps,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    base = empty_cuda_allocator()
    trainer.fit(module)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base
