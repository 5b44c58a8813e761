"""Two DDP processes on CPU: a preset's micro-batch x accumulation x devices equals the full-batch reference.

Usage: ``python presets_accumulation_ddp.py OUT_DIR N MICRO``; each rank writes ``OUT_DIR/result_rank{r}.json``.
"""

from __future__ import annotations

import json
import sys

from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_memopt import MemoryPreset
from tests.helpers.accumulation import GradRecorder, Regression, close, data, reference
from tests.helpers.lightning import pl


class DDPRegression(Regression):
    def train_dataloader(self):
        dataset = TensorDataset(*data(self.n))
        sampler = DistributedSampler(dataset, num_replicas=2, rank=self.global_rank, shuffle=False)
        return DataLoader(dataset, batch_size=self.batch_size, sampler=sampler)


def main(out_dir: str, n: int, micro: int) -> None:
    preset = MemoryPreset(effective_batch_size=8, micro_batch_size=micro, devices=2)
    kwargs = preset.trainer_kwargs()
    rec = GradRecorder()
    kwargs["callbacks"] = [rec]  # only the precision plugin and batch arithmetic matter here
    model = DDPRegression(preset.batch_size, n)
    trainer = pl.Trainer(
        accelerator="cpu",
        strategy="ddp",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        **kwargs,
    )
    trainer.fit(model)
    # DistributedSampler(shuffle=False) gives rank r the samples r, r+2, ...; each step's effective batch is
    # therefore the same 8 consecutive samples as the single-process reference.
    ref_grads, ref_weights = reference([8] * (n // 8), n)
    ok_grads = len(rec.grads) == n // 8 and all(close(g, r) for g, r in zip(rec.grads, ref_grads))
    ok_weights = close([p.detach() for p in model.net.parameters()], ref_weights)
    result = {
        "rank": trainer.global_rank,
        "accumulate": trainer.accumulate_grad_batches,
        "steps": len(rec.grads),
        "grads": ok_grads,
        "weights": ok_weights,
    }
    # one file per rank: both ranks share stdout, where lines can interleave
    with open(f"{out_dir}/result_rank{trainer.global_rank}.json", "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
