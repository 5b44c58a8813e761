"""StreamingRetrievalMetric is hard to misuse under DDP (2 gloo processes): the documented logging call prints no
Lightning ``sync_dist`` warning and logs the metric's own values, a run without ``sample_ids`` is warned about the
sampler's padding repeats once, and ``compute()`` on rank zero only ends in an error that says what to do."""

from __future__ import annotations

import json
import socket

import pytest

from tests.helpers.subprocess_run import run_script

LIGHTNING_SCRIPT = r"""
import json, sys, warnings
import torch
from torch.utils.data import DataLoader, Dataset
sys.path.insert(0, {root!r})
from tests.helpers.lightning import pl
from lightning_memopt import StreamingRetrievalMetric


class Pairs(Dataset):
    # 7 pairs: DistributedSampler pads to 8 over 2 processes, repeating one sample
    def __len__(self):
        return 7

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return torch.randn(4, generator=g), i


class Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 4)
        self.retrieval = StreamingRetrievalMetric(top_k=(1, 5))
        self.computed = []

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).pow(2).mean()

    def validation_step(self, batch, batch_idx):
        x, ids = batch
        with torch.no_grad():
            self.retrieval.update(self.layer(x), x, text_ids=ids)  # no sample_ids: padding repeats count twice

    def on_validation_epoch_end(self):
        values = self.retrieval.compute()
        self.computed.append({{k: v.item() for k, v in values.items()}})
        self.log_dict(values, sync_dist=True, reduce_fx="max")  # the documented call
        self.retrieval.reset()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return DataLoader(Pairs(), batch_size=2)

    def val_dataloader(self):
        return DataLoader(Pairs(), batch_size=2)


if __name__ == "__main__":
    model = Model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=2, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             num_sanity_val_steps=0, default_root_dir=".")
        trainer.fit(model)
    logged = {{k: v.item() for k, v in trainer.callback_metrics.items()}}
    out = {{"warnings": [str(w.message) for w in caught], "computed": model.computed, "logged": logged}}
    with open(f"rank{{trainer.global_rank}}.json", "w") as f:
        json.dump(out, f)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
"""


@pytest.mark.slow
def test_the_documented_logging_call_is_quiet_exact_and_padding_is_warned_once(tmp_path):
    from tests.helpers.subprocess_run import REPO_ROOT

    proc = run_script(LIGHTNING_SCRIPT.format(root=str(REPO_ROOT)), tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r in ranks:
        assert not [w for w in r["warnings"] if "sync_dist=True" in w], r["warnings"]
        assert len(r["computed"]) == 2
        assert r["computed"][-1] == {k: r["logged"][k] for k in r["computed"][-1]}  # logged as computed
    assert ranks[0]["computed"] == ranks[1]["computed"]  # the same values on every process
    padding = [[w for w in r["warnings"] if "without `sample_ids`" in w] for r in ranks]
    assert len(padding[0]) == 1 and "counted twice" in padding[0][0]  # rank zero, once for both epochs
    assert padding[1] == []


RANK_ZERO_SCRIPT = r"""
import datetime, json, os, sys
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
sys.path.insert(0, {root!r})
from lightning_memopt import StreamingRetrievalMetric


def run(rank):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT={port!r})
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=4))
    metric = StreamingRetrievalMetric()
    metric.update(torch.eye(3) + rank, torch.eye(3), text_ids=[0, 1, 2], sample_ids=[3 * rank, 3 * rank + 1,
                                                                                     3 * rank + 2])
    try:
        if rank == 0:  # the misuse: `if trainer.is_global_zero: metric.compute()`
            metric.compute()
            result = "no error"
        else:
            dist.barrier()  # where the other processes go next (Lightning's end of a stage)
            result = "no error"
    except Exception as err:
        result = f"{{type(err).__name__}}: {{err}}"
    with open(f"rank{{rank}}.json", "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    mp.start_processes(run, nprocs=2, start_method="fork", join=True)
"""


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


@pytest.mark.slow
def test_compute_on_rank_zero_only_says_that_every_process_must_call_it(tmp_path):
    from tests.helpers.subprocess_run import REPO_ROOT

    run_script(RANK_ZERO_SCRIPT.format(root=str(REPO_ROOT), port=_free_port()), tmp_path, timeout=120)
    result = json.loads((tmp_path / "rank0.json").read_text())
    assert result.startswith("RuntimeError: Every process must call `StreamingRetrievalMetric.compute()`"), result
    assert "not under `if trainer.is_global_zero`" in result
    assert "The first collective of compute() failed" in result  # the collective's own error is kept in the text
