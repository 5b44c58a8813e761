"""Micro-batch x accumulation gives the full-batch gradients and weights (SGD, fp32, atol 1e-6).

The reference is plain torch: one SGD step per effective batch on the mean loss. Lightning divides every loss by
``accumulate_grad_batches``, also in a short last window of an epoch (upstream #19987); ``MemoryPrecision``
(``exact_accumulation=True``, used by every ``MemoryPreset``) rescales that window. Both behaviours are pinned here.
"""

import json

import pytest

from lightning_memopt import MemoryPrecision, MemoryPreset
from tests.helpers.accumulation import GradRecorder, Regression, reference
from tests.helpers.accumulation import close as _close
from tests.helpers.subprocess_run import SCRIPTS, run_file
from tests.helpers.trainer import make_trainer


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


def _resumed_weights(tmp_path, plugins):
    """``max_steps=4``: one epoch (16 batches of 2, accumulate 4), checkpointed at its end by ModelCheckpoint, then
    resumed in a new Trainer up to ``max_steps=8``: the weights after the resumed epoch."""
    from tests.helpers.lightning import pl

    first = make_trainer(
        tmp_path,
        max_steps=4,
        limit_train_batches=None,
        accumulate_grad_batches=4,
        enable_checkpointing=True,
        callbacks=[pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)],
        plugins=list(plugins),
    )
    first.fit(Regression(2, 32))
    model = Regression(2, 32)
    second = make_trainer(
        tmp_path, max_steps=8, limit_train_batches=None, accumulate_grad_batches=4, plugins=list(plugins)
    )
    second.fit(model, ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    assert second.global_step == 8
    return [p.detach().clone() for p in model.net.parameters()]


def test_a_resume_from_an_end_of_epoch_checkpoint_accumulates_as_lightning_does(tmp_path):
    """Stopped by ``max_steps`` at an epoch's end, Lightning's resumed loop runs one more batch in that epoch (ready
    17 of 16); the short-window rescale divided by zero there. Windows that divide the epoch need no rescale: the
    weights are Lightning's own."""
    got = _resumed_weights(tmp_path / "memory", [MemoryPrecision("32-true")])
    expected = _resumed_weights(tmp_path / "plain", [])
    assert _close(got, expected)


@pytest.mark.slow
def test_ddp_two_processes_match_the_full_batch(tmp_path):
    micro = 2
    proc = run_file(SCRIPTS / "presets_accumulation_ddp.py", tmp_path, args=(str(tmp_path), "24", str(micro)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = sorted(tmp_path.glob("result_rank*.json"))
    assert [f.name for f in files] == ["result_rank0.json", "result_rank1.json"], proc.stderr[-3000:]
    results = [json.loads(f.read_text()) for f in files]
    for r in results:
        assert r["accumulate"] == 4 // micro and r["steps"] == 3
        assert r["grads"] and r["weights"], r
