"""AutoMicroBatch under FSDP2 on two CPU processes (gloo), only rank 1 with a memory budget; run by
test_auto_micro_batch_fsdp2.

Lightning's ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1), ``fully_shard`` per block and on the
root in ``configure_model``. Rank 1 runs out of memory above 2 samples in the forward of a middle block, then (second
fit) in its backward; in a third fit both ranks do, at different points (rank 0 above 4 samples in the forward of the
block before, rank 1 above 2 in the backward); a fourth is the reference, Lightning's accumulation at the micro-batch
that fits. Then, with ``accumulate_grad_batches=2``, rank 1 runs out of memory in the backward of the second batch of
the first window (sharded gradients of the first batch to keep, partial ones to drop), next to its reference. In a last
fit rank 1 runs out of memory inside FSDP's reduce-scatter itself (not recoverable): each rank writes the error it
ended with and how long it took. Before it, evaluation: rank 1 runs out of memory above 2 samples in a middle block's
forward during validation (with a synced step log in ``validation_step``), inside a fit and in a ``validate`` after
it, next to the same run without the callback, validated at the micro-batch that fits.
"""

import time

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_memopt import OOMReporter
from lightning_memopt.callbacks.auto_micro_batch import AutoMicroBatch
from tests.helpers.amb import BackwardBudget, ddp_trainer
from tests.helpers.lightning import lightning_module, pl

BATCH, BUDGET, WIDTH, BLOCKS = 8, 2, 16, 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.forward_budget: int | None = None
        self.backward_budget: int | None = None

    def forward(self, x):
        if self.forward_budget is not None and x.shape[0] > self.forward_budget:
            raise torch.OutOfMemoryError(f"simulated: forward of {x.shape[0]} samples, budget {self.forward_budget}")
        return x + torch.tanh(BackwardBudget.apply(self.linear(x), self.backward_budget))


class Sharded(pl.LightningModule):
    def __init__(self, where=None, batch_size=BATCH, val_batch_size=BATCH):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(4, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(WIDTH, 1)
        self.where, self.batch_size, self.val_batch_size = where, batch_size, val_batch_size
        self.seen_sizes: list[int] = []

    def configure_model(self):
        from torch.distributed.fsdp import fully_shard

        if getattr(self, "_sharded", False):  # a validate after fit: sharded already
            return
        self._sharded = True
        mesh = self.device_mesh["data_parallel"]
        if self.global_rank == 1 and self.where in ("forward", "backward"):
            setattr(self.blocks[2], f"{self.where}_budget", BUDGET)  # a middle block, rank 1 only
        if self.where == "both":
            if self.global_rank == 0:
                self.blocks[1].forward_budget = 2 * BUDGET
            else:
                self.blocks[2].backward_budget = BUDGET
        for block in self.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self, mesh=mesh)

    def on_train_batch_start(self, batch, batch_idx):
        if self.where == "window" and self.global_rank == 1 and batch_idx == 1:
            self.blocks[2].backward_budget = BUDGET

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h).squeeze(1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.seen_sizes.append(x.shape[0])
        return nn.functional.mse_loss(self(x), y)

    def on_validation_start(self):
        if self.where == "eval" and self.global_rank == 1:  # rank 1 short of memory in validation only
            self.blocks[2].forward_budget = BUDGET

    def on_validation_end(self):
        self.blocks[2].forward_budget = None

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.seen_sizes.append(x.shape[0])
        loss = nn.functional.mse_loss(self(x), y)
        self.log("val_step_loss", loss, on_step=True, on_epoch=False, sync_dist=True)  # a collective in the step
        self.log("val_loss", loss, sync_dist=True)
        return loss

    def val_dataloader(self):
        g = torch.Generator().manual_seed(1)
        data = TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, generator=g))
        return DataLoader(data, batch_size=self.val_batch_size, sampler=DistributedSampler(data, shuffle=False))

    def configure_optimizers(self):
        if self.where is not None and self.where.startswith("window"):  # plain SGD: the first batch at 8 (not 4 x 2)
            return torch.optim.SGD(self.parameters(), lr=0.05)  # rounds apart by 1e-8, AdamW amplifies it to 2e-6
        return torch.optim.AdamW(self.parameters(), lr=0.01, eps=1e-5)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, generator=g))
        return DataLoader(data, batch_size=self.batch_size, sampler=DistributedSampler(data, shuffle=False))


def fsdp2_trainer(callbacks, **kwargs):
    strategy = lightning_module("strategies").ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    return ddp_trainer(callbacks, strategy=strategy, **kwargs)


def full_weights(model):
    return {k: v.full_tensor().detach().clone() for k, v in model.state_dict().items()}


def recoverable() -> None:
    for where in ("forward", "backward", "both", "reference", "window", "window_reference"):
        if where.endswith("reference"):  # Lightning's accumulation at the micro-batch that fits
            window = 2 if where == "window_reference" else 1
            model, callbacks, accumulate = Sharded(where, batch_size=BUDGET), [], window * BATCH // BUDGET
        else:
            model, callbacks, accumulate = Sharded(where), [AutoMicroBatch()], 2 if where == "window" else 1
        trainer = fsdp2_trainer(callbacks, accumulate_grad_batches=accumulate)
        start = time.perf_counter()
        trainer.fit(model)
        torch.save(
            {
                "weights": full_weights(model),
                "micro": callbacks[0].micro_batch_size if callbacks else None,
                "retries": callbacks[0].retries if callbacks else None,
                "step": trainer.global_step,
                "sizes": model.seen_sizes,
                "seconds": time.perf_counter() - start,
            },
            f"{where}_rank{trainer.global_rank}.pt",
        )


def evaluation() -> None:
    for where in ("eval", "eval_reference"):
        if where == "eval":
            model, callbacks = Sharded(where), [AutoMicroBatch(train=False)]
        else:  # the same run without the callback, validated at the micro-batch that fits
            model, callbacks = Sharded(where, val_batch_size=BUDGET), []
        trainer = fsdp2_trainer(callbacks, limit_val_batches=None, max_steps=1, limit_train_batches=1)
        trainer.fit(model)
        in_fit = float(trainer.callback_metrics["val_loss"])
        model.seen_sizes.clear()
        if callbacks:  # the validate after fit learns its micro-batch again: its own agreement in FSDP2's collectives
            saved = callbacks[0].state_dict()
            callbacks[0].load_state_dict(
                {**saved, "validate_micro_batch_size": None, "validate_micro_batch_elements": None}
            )
        (alone,) = trainer.validate(model, verbose=False)
        torch.save(
            {
                "in_fit": in_fit,
                "alone": alone["val_loss"],
                "micro": callbacks[0].eval_micro_batch_sizes["validate"] if callbacks else None,
                "sizes": model.seen_sizes,
            },
            f"{where}_rank{trainer.global_rank}.pt",
        )


def collective() -> None:
    rank, start = None, time.perf_counter()
    try:
        model = Sharded()
        trainer = fsdp2_trainer([AutoMicroBatch(), OOMReporter(dirpath="collective_reports")])
        rank = trainer.global_rank
        if rank == 1:  # FSDP's reduce-scatter itself runs out of memory, after the agreement point
            real = torch.distributed.reduce_scatter_single

            def fails(*args, **kwargs):
                raise torch.OutOfMemoryError("simulated: inside the reduce-scatter")

            torch.distributed.reduce_scatter_single = fails
        trainer.fit(model)
        outcome = "no error"
    except BaseException as err:  # what this rank ended with
        outcome = f"{type(err).__name__}: {err}"
    finally:
        if rank == 1:
            torch.distributed.reduce_scatter_single = real
    torch.save({"error": outcome, "seconds": time.perf_counter() - start}, f"collective_rank{rank}.pt")


if __name__ == "__main__":
    recoverable()
    evaluation()
    collective()  # last: it leaves the process group unusable
    # Lightning keeps the process group; one left to interpreter exit sometimes aborts there (gloo's threads)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
