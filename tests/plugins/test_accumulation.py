"""Micro-batch x accumulation gives the full-batch gradients and weights (SGD, fp32, atol 1e-6).

The reference is plain torch: one SGD step per effective batch on the mean loss. Lightning divides every loss by
``accumulate_grad_batches``, also in a short last window of an epoch (upstream #19987); ``MemoryPrecision``
(``exact_accumulation=True``, used by every ``MemoryPreset``) rescales that window. Both behaviours are pinned here.
"""

import json

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_memopt import MemoryPrecision, MemoryPreset
from tests.helpers.lightning import pl
from tests.helpers.subprocess_run import run_script
from tests.helpers.trainer import make_trainer

N_FEATURES = 6


def _data(n):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, N_FEATURES, generator=g), torch.randn(n, 1, generator=g)


class Regression(pl.LightningModule):
    def __init__(self, batch_size, n):
        super().__init__()
        torch.manual_seed(1)
        self.net = nn.Sequential(nn.Linear(N_FEATURES, 8), nn.Tanh(), nn.Linear(8, 1))
        self.batch_size, self.n = batch_size, n

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(TensorDataset(*_data(self.n)), batch_size=self.batch_size, shuffle=False)


class GradRecorder(pl.Callback):
    def __init__(self):
        self.grads = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grads.append([p.grad.detach().clone() for p in pl_module.parameters()])


def reference(windows, n):
    """Plain torch: one SGD step per window (list of sample counts) on the mean loss of the window.

    Windows run through the ``n`` samples in order, epoch after epoch when they add up to more than ``n``.
    """
    model = Regression(1, n).net
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _data(n)
    epochs = -(-sum(windows) // n)
    x, y = x.repeat(epochs, 1), y.repeat(epochs, 1)
    grads, start = [], 0
    for size in windows:
        opt.zero_grad()
        nn.functional.mse_loss(model(x[start : start + size]), y[start : start + size]).backward()
        grads.append([p.grad.detach().clone() for p in model.parameters()])
        opt.step()
        start += size
    return grads, [p.detach().clone() for p in model.parameters()]


def _fit(tmp_path, micro, accumulate, n, epochs=1, plugins=()):
    rec = GradRecorder()
    model = Regression(micro, n)
    trainer = make_trainer(
        tmp_path,
        max_steps=-1,
        max_epochs=epochs,
        limit_train_batches=None,
        accumulate_grad_batches=accumulate,
        callbacks=[rec],
        plugins=list(plugins),
    )
    trainer.fit(model)
    return rec.grads, [p.detach().clone() for p in model.net.parameters()]


def _close(a, b):
    return all(torch.allclose(x, y, atol=1e-6, rtol=0) for x, y in zip(a, b))


@pytest.mark.parametrize("plugins", [(), (MemoryPrecision("32-true"),)], ids=["lightning", "memory_precision"])
def test_micro_batches_times_accumulation_equal_the_full_batch(tmp_path, plugins):
    n = 32  # 4 optimizer steps of an effective batch of 8
    preset = MemoryPreset(effective_batch_size=8, micro_batch_size=2)
    grads, weights = _fit(tmp_path, preset.batch_size, preset.accumulate_grad_batches, n, plugins=plugins)
    ref_grads, ref_weights = reference([8] * 4, n)
    assert len(grads) == 4
    for step, (g, r) in enumerate(zip(grads, ref_grads)):
        assert _close(g, r), f"gradients differ at step {step}"
    assert _close(weights, ref_weights)
    full_grads, full_weights = _fit(tmp_path, 8, 1, n)
    assert _close(weights, full_weights) and all(_close(g, r) for g, r in zip(grads, full_grads))


def test_upstream_short_last_window_is_pinned(tmp_path):
    # 10 samples, micro-batch 2, accumulate 4: windows of 8 and 2 samples. Lightning divides the last
    # window's loss by 4 instead of 1 (upstream #19987): its gradient is a quarter of the mean gradient.
    grads, _ = _fit(tmp_path, 2, 4, 10)
    ref_grads, _ = reference([8, 2], 10)
    assert _close(grads[0], ref_grads[0])
    assert _close(grads[1], [r / 4 for r in ref_grads[1]])
    assert not _close(grads[1], ref_grads[1])


def test_memory_precision_fixes_the_short_last_window(tmp_path):
    grads, weights = _fit(tmp_path, 2, 4, 10, epochs=2, plugins=[MemoryPrecision("32-true")])
    ref_grads, ref_weights = reference([8, 2, 8, 2], 10)
    assert len(grads) == 4  # two epochs: the fix applies in every epoch's last window
    for step, (g, r) in enumerate(zip(grads, ref_grads)):
        assert _close(g, r), f"gradients differ at step {step}"
    assert _close(weights, ref_weights)
    # opt-out keeps Lightning's behaviour
    grads_off, _ = _fit(tmp_path, 2, 4, 10, plugins=[MemoryPrecision("32-true", exact_accumulation=False)])
    assert _close(grads_off[1], [r / 4 for r in ref_grads[1]])


DDP_SCRIPT = """
import json, sys
import torch
sys.path.insert(0, {tests_root!r})
from tests.helpers.lightning import pl
from tests.plugins.test_accumulation import Regression, GradRecorder, reference, _close
from lightning_memopt import MemoryPreset

n = {n}


class DDPRegression(Regression):
    def train_dataloader(self):
        from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
        from tests.plugins.test_accumulation import _data

        dataset = TensorDataset(*_data(self.n))
        sampler = DistributedSampler(dataset, num_replicas=2, rank=self.global_rank, shuffle=False)
        return DataLoader(dataset, batch_size=self.batch_size, sampler=sampler)


preset = MemoryPreset(effective_batch_size=8, micro_batch_size={micro}, devices=2)
kwargs = preset.trainer_kwargs()
kwargs["callbacks"] = [GradRecorder()]  # only the precision plugin and batch arithmetic matter here
rec = kwargs["callbacks"][0]
model = DDPRegression(preset.batch_size, n)
trainer = pl.Trainer(accelerator="cpu", strategy="ddp", max_epochs=1, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False, **kwargs)
trainer.fit(model)
# DistributedSampler(shuffle=False) gives rank r the samples r, r+2, ...; each step's effective batch is
# therefore the same 8 consecutive samples as the single-process reference.
ref_grads, ref_weights = reference([8] * (n // 8), n)
ok_grads = len(rec.grads) == n // 8 and all(_close(g, r) for g, r in zip(rec.grads, ref_grads))
ok_weights = _close([p.detach() for p in model.net.parameters()], ref_weights)
result = {{"rank": trainer.global_rank, "accumulate": trainer.accumulate_grad_batches, "steps": len(rec.grads),
          "grads": ok_grads, "weights": ok_weights}}
# one file per rank: both ranks share stdout, where lines can interleave
with open(f"{{sys.argv[1]}}/result_rank{{trainer.global_rank}}.json", "w") as f:
    json.dump(result, f)
"""


@pytest.mark.slow
def test_ddp_two_processes_match_the_full_batch(tmp_path):
    micro = 2
    from tests.helpers.subprocess_run import REPO_ROOT

    code = DDP_SCRIPT.format(tests_root=str(REPO_ROOT), n=24, micro=micro)
    proc = run_script(code, tmp_path, args=(str(tmp_path),))
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = sorted(tmp_path.glob("result_rank*.json"))
    assert [f.name for f in files] == ["result_rank0.json", "result_rank1.json"], proc.stderr[-3000:]
    results = [json.loads(f.read_text()) for f in files]
    for r in results:
        assert r["accumulate"] == 4 // micro and r["steps"] == 3
        assert r["grads"] and r["weights"], r
