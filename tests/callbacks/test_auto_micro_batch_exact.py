"""AutoMicroBatch as a normal step: uneven micro-batches, self.log, clipping, checkpoints, accumulation, bf16, CLI.

Lightning's own behaviour is the reference throughout: the whole batch in one step where the micro-batches are uneven,
``accumulate_grad_batches`` at the feasible micro-batch where a simulated memory budget forces halving.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from lightning_memopt.callbacks.auto_micro_batch import AutoMicroBatch
from tests.helpers.amb import N_SAMPLES, Net, fit, weights
from tests.helpers.lightning import lightning_module

ModelCheckpoint = lightning_module("callbacks").ModelCheckpoint

ONE_EPOCH = {"max_steps": -1, "max_epochs": 1}


def starts_and_sizes(batch_size, steps, per_step=1):
    """(first sample, samples) of each optimizer step's samples, the DataLoader run in order, epoch after epoch."""
    out, start = [], 0
    for _ in range(steps):
        size = 0
        for _ in range(per_step):
            if start + size >= N_SAMPLES:
                break
            size += min(batch_size, N_SAMPLES - start - size)
        out.append((start, size))
        start = (start + size) % N_SAMPLES
    return out


def assert_each_sample_counted_once(model, batch_size, steps, per_step=1):
    """The probe's gradient at each optimizer step: ``1 / samples`` on the step's samples, 0 elsewhere."""
    assert len(model.counts) == steps
    for step, ((start, size), grad) in enumerate(zip(starts_and_sizes(batch_size, steps, per_step), model.counts)):
        expected = torch.zeros(N_SAMPLES)
        expected[start : start + size] = 1.0
        assert torch.allclose(grad * size, expected, atol=1e-6, rtol=0), step


def assert_weights(got_model, expected_model, exact=True, atol=1e-6):
    got, expected = weights(got_model), weights(expected_model)
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        if exact:
            assert torch.equal(got[name], value), name
        else:
            assert torch.allclose(got[name], value, atol=atol, rtol=0), (name, (got[name] - value).abs().max())


# ------------------------------------------------------------------------------------------------ uneven micro-batches


class Logged(Net):
    """Net that also logs from hooks outside ``training_step``, with values that tell the steps apart."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.losses: list[tuple[int, float]] = []  # (samples, loss) of each training_step call

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.losses.append((batch[0].shape[0], loss.item()))
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.log("batch_end_value", float(batch_idx), on_step=False, on_epoch=True)

    def on_before_optimizer_step(self, optimizer):
        super().on_before_optimizer_step(optimizer)
        self.log("pre_step_value", float(self.global_step), on_step=False, on_epoch=True)


# a batch of 12 in slices of 5, 5, 2 (the last DataLoader batch, 4, whole), or 3, 3, 3, 3 (the last one 3, 1)
SLICES = {5: [5, 5, 2] * 5 + [4], 3: [3, 3, 3, 3] * 5 + [3, 1]}


@pytest.fixture(scope="module", params=sorted(SLICES), ids=lambda m: f"micro{m}")
def uneven(request, tmp_path_factory):
    """One epoch of 64 samples in batches of 12 (the last one 4): AutoMicroBatch(micro) and Lightning, whole batches."""
    tmp = tmp_path_factory.mktemp(f"uneven{request.param}")
    ours, reference = Logged(batch_size=12), Logged(batch_size=12)
    trainer = fit(tmp / "ours", ours, [AutoMicroBatch(micro_batch_size=request.param)], **ONE_EPOCH)
    ref_trainer = fit(tmp / "ref", reference, **ONE_EPOCH)
    return request.param, ours, reference, trainer, ref_trainer


def test_uneven_micro_batches_and_a_short_last_batch_equal_one_whole_batch_step(uneven):
    micro, ours, reference, trainer, ref_trainer = uneven
    assert ours.seen_sizes == SLICES[micro]
    assert reference.seen_sizes == [12] * 5 + [4]
    assert trainer.global_step == ref_trainer.global_step == 6
    assert_each_sample_counted_once(ours, batch_size=12, steps=6)
    assert_weights(ours, reference, exact=False)


def test_a_training_step_log_s_epoch_mean_is_weighted_by_micro_batch_size(uneven):
    _, ours, _, trainer, ref_trainer = uneven
    got, expected = trainer.callback_metrics["train_loss"].item(), ref_trainer.callback_metrics["train_loss"].item()
    assert got == pytest.approx(expected, rel=1e-6, abs=0)
    # the weighting matters here: the plain mean of the micro-batch losses is not the epoch mean
    plain = sum(loss for _, loss in ours.losses) / len(ours.losses)
    assert plain != pytest.approx(expected, rel=1e-3)
    assert sum(m * loss for m, loss in ours.losses) / N_SAMPLES == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("uneven", [5], indirect=True, ids=["micro5"])  # slices of 3 (3 and 1 of 4) are proportional
@pytest.mark.parametrize("key", ["batch_end_value", "pre_step_value"])
def test_a_log_outside_training_step_is_weighted_by_the_batch_size(uneven, key):
    _, _, _, trainer, ref_trainer = uneven
    got, expected = trainer.callback_metrics[key], ref_trainer.callback_metrics[key]
    assert got.item() == pytest.approx(expected.item(), rel=1e-6, abs=0)


class OOMAtCall(Net):
    """Net whose ``training_step`` call number ``at`` (0-based, over the run) runs out of memory, once."""

    def __init__(self, at, where, **kwargs):
        super().__init__(**kwargs)
        self.at, self.where = at, where

    def training_step(self, batch, batch_idx):
        if len(self.seen_sizes) != self.at:
            return super().training_step(batch, batch_idx)
        budget = "forward_budget" if self.where == "forward" else "backward_budget"
        setattr(self, budget, 0)  # the backward budget is read in forward, it fails when backward runs
        try:
            return super().training_step(batch, batch_idx)
        finally:
            setattr(self, budget, None)


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_micro_batch_size_changed_inside_a_step_still_counts_each_sample_once(tmp_path, where):
    """Batch 2 (calls 6, 7, 8: slices 5, 5, 2) runs out of memory at its second slice and runs again in slices of 2."""
    ours, reference = OOMAtCall(at=7, where=where, batch_size=12), Net(batch_size=12)
    callback = AutoMicroBatch(micro_batch_size=5)
    trainer = fit(tmp_path / "ours", ours, [callback], **ONE_EPOCH)
    ref_trainer = fit(tmp_path / "ref", reference, **ONE_EPOCH)
    assert ours.seen_sizes == [5, 5, 2] * 2 + [5, 5] + [2] * 6 * 3 + [2, 2]
    assert (callback.micro_batch_size, callback.retries) == (2, 1)
    assert trainer.global_step == ref_trainer.global_step == 6
    assert_each_sample_counted_once(ours, batch_size=12, steps=6)
    assert_weights(ours, reference, exact=False)


# ------------------------------------------------------------------------------------------------ gradient clipping


class Clipped(Net):
    """Net that records the gradients' norm and largest value before and after Lightning clips them."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.before: list[tuple[float, float]] = []
        self.after: list[tuple[float, float]] = []

    @staticmethod
    def _measure(module):
        grads = [p.grad for p in module.parameters() if p.grad is not None]
        return torch.nn.utils.get_total_norm(grads).item(), max(g.abs().max().item() for g in grads)

    def on_before_optimizer_step(self, optimizer):  # Lightning calls it before clipping
        super().on_before_optimizer_step(optimizer)
        self.before.append(self._measure(self))

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        self.after.append(self._measure(self))


@pytest.mark.parametrize(("algorithm", "clip"), [("norm", 0.2), ("value", 0.05)])
def test_gradient_clipping_clips_the_whole_batch_s_gradient_as_lightning_accumulation_does(tmp_path, algorithm, clip):
    ours, reference = Clipped(backward_budget=4, batch_size=16), Clipped(batch_size=4)
    callback = AutoMicroBatch()
    clipping = {"gradient_clip_val": clip, "gradient_clip_algorithm": algorithm}
    trainer = fit(tmp_path / "ours", ours, [callback], **clipping)
    ref_trainer = fit(tmp_path / "ref", reference, accumulate=4, **clipping)
    assert callback.micro_batch_size == 4 and callback.retries == 2
    assert trainer.global_step == ref_trainer.global_step == 4
    measure = 0 if algorithm == "norm" else 1
    assert len(ours.before) == len(ours.after) == 4
    for before, after in zip(ours.before, ours.after):  # it really clipped, at every step
        assert before[measure] > 2 * clip and after[measure] <= clip * (1 + 1e-5), (before, after)
    assert ours.before == reference.before and ours.after == reference.after
    assert_weights(ours, reference)


# ------------------------------------------------------------------------------------------------ ModelCheckpoint


def _checkpoints(tmp_path, model, callbacks=(), accumulate=1):
    dirpath = tmp_path / "ckpt"
    checkpoint = ModelCheckpoint(dirpath=dirpath, every_n_train_steps=2, save_top_k=-1)
    trainer = fit(
        tmp_path, model, [*callbacks, checkpoint], accumulate=accumulate, max_steps=6, enable_checkpointing=True
    )
    return trainer, {path.name: torch.load(path, weights_only=False) for path in sorted(dirpath.glob("*.ckpt"))}


def test_model_checkpoint_saves_the_same_files_steps_and_optimizer_state_as_lightning_accumulation(tmp_path):
    """Halving at the first batch (16 -> 8 -> 4), six steps over two epochs, a checkpoint every two steps."""
    ours, reference = Net(optimizer="adamw", backward_budget=4, batch_size=16), Net(optimizer="adamw", batch_size=4)
    trainer, saved = _checkpoints(tmp_path / "ours", ours, [AutoMicroBatch()])
    ref_trainer, ref_saved = _checkpoints(tmp_path / "ref", reference, accumulate=4)
    assert sorted(saved) == sorted(ref_saved) == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "epoch=1-step=6.ckpt"]
    assert trainer.global_step == ref_trainer.global_step == 6
    for name, ckpt in saved.items():
        ref = ref_saved[name]
        step = int(name.split("step=")[1].split(".")[0])
        assert ckpt["global_step"] == ref["global_step"] == step, name
        assert ckpt["epoch"] == ref["epoch"], name
        steps = [s["step"].item() for s in ckpt["optimizer_states"][0]["state"].values()]
        ref_steps = [s["step"].item() for s in ref["optimizer_states"][0]["state"].values()]
        assert steps == ref_steps == [step] * 5, name  # AdamW's per-parameter step count
        progress = ckpt["loops"]["fit_loop"]["epoch_loop.automatic_optimization.optim_progress"]
        ref_progress = ref["loops"]["fit_loop"]["epoch_loop.automatic_optimization.optim_progress"]
        assert progress == ref_progress and progress["optimizer"]["step"]["total"]["completed"] == step, name
        assert ckpt["lr_schedulers"] == ref["lr_schedulers"] and ckpt["lr_schedulers"][0]["last_epoch"] == step
        for key, value in ref["state_dict"].items():
            assert torch.equal(ckpt["state_dict"][key], value), (name, key)


# ---------------------------------------------------------------------------------------------- accumulate_grad_batches


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_accumulate_grad_batches_with_halving_equals_lightning_at_the_feasible_micro_batch(tmp_path, where):
    """accumulate 2 of 16 at micro-batches of 4 is Lightning's accumulate 8 of 4; three steps cross the epoch."""
    budget = {"forward_budget": 4} if where == "forward" else {"backward_budget": 4}
    ours, reference = Net(batch_size=16, **budget), Net(batch_size=4)
    callback = AutoMicroBatch()
    trainer = fit(tmp_path / "ours", ours, [callback], accumulate=2, max_steps=3)
    ref_trainer = fit(tmp_path / "ref", reference, accumulate=8, max_steps=3)
    assert callback.micro_batch_size == 4 and callback.retries == 2
    assert trainer.global_step == ref_trainer.global_step == 3
    scheduler, ref_scheduler = trainer.lr_scheduler_configs[0].scheduler, ref_trainer.lr_scheduler_configs[0].scheduler
    assert scheduler.last_epoch == ref_scheduler.last_epoch == 3
    assert_each_sample_counted_once(ours, batch_size=16, steps=3, per_step=2)
    assert_weights(ours, reference)


# ------------------------------------------------------------------------------------------------ bf16


class Autocast(Net):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.autocast: list[tuple[bool, torch.dtype]] = []

    def training_step(self, batch, batch_idx):
        self.autocast.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_bf16_mixed_memory_precision_equals_lightning_accumulation_with_the_same_plugin(tmp_path, where):
    from lightning_memopt import MemoryPrecision

    budget = {"forward_budget": 4} if where == "forward" else {"backward_budget": 4}
    ours, reference = Autocast(batch_size=16, **budget), Autocast(batch_size=4)
    callback = AutoMicroBatch()
    trainer = fit(tmp_path / "ours", ours, [callback], plugins=[MemoryPrecision("bf16-mixed")])
    ref_trainer = fit(tmp_path / "ref", reference, accumulate=4, plugins=[MemoryPrecision("bf16-mixed")])
    assert set(ours.autocast) == set(reference.autocast) == {(True, torch.bfloat16)}
    assert callback.micro_batch_size == 4 and callback.retries == 2
    assert trainer.global_step == ref_trainer.global_step == 4
    assert_weights(ours, reference)


# ------------------------------------------------------------------------------------------------ LightningCLI

CLI_TRAINER = [
    "--trainer.accelerator=cpu",
    "--trainer.devices=1",
    "--trainer.logger=false",
    "--trainer.enable_checkpointing=false",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
    "--trainer.limit_val_batches=0",
    "--trainer.max_steps=1",
]


def _cli(tmp_path, args):
    pytest.importorskip("jsonargparse")
    LightningCLI = lightning_module("cli").LightningCLI

    # no seed_everything: it would set the global seed and PL_GLOBAL_SEED for the tests after this one
    with mock.patch("sys.argv", ["train.py"]):  # pytest's own arguments are not the CLI's
        return LightningCLI(
            Net,
            run=False,
            seed_everything_default=False,
            args=[*CLI_TRAINER, f"--trainer.default_root_dir={tmp_path}", *args],
        )


def _the_callback(cli):
    found = [cb for cb in cli.trainer.callbacks if isinstance(cb, AutoMicroBatch)]
    assert len(found) == 1
    return found[0]


def test_lightning_cli_builds_the_callback_from_command_line_arguments_and_it_runs(tmp_path):
    cli = _cli(
        tmp_path,
        [
            "--trainer.callbacks+=lightning_memopt.AutoMicroBatch",
            "--trainer.callbacks.micro_batch_size=4",
            "--trainer.callbacks.min_micro_batch_size=2",
            "--model.forward_budget=2",
            "--model.batch_size=8",
        ],
    )
    callback = _the_callback(cli)
    assert (callback.start_micro_batch_size, callback.micro_batch_size, callback.min_micro_batch_size) == (4, 4, 2)
    assert callback.split_batch_fn is None and callback.batch_size_fn is None
    cli.trainer.fit(cli.model)
    assert cli.model.seen_sizes == [4, 2, 2, 2, 2]  # started at 4, halved to 2 for the forward budget
    assert cli.trainer.global_step == 1


FUNCTIONS = "lightning_memopt.functional.micro_batch.slicing"


@pytest.mark.parametrize(
    ("init_args", "expected"),
    [
        ({"micro_batch_size": 4, "min_micro_batch_size": 2}, (4, 4, 2, None, None)),
        ({}, ("auto", None, 1, None, None)),
        ({"micro_batch_size": "auto", "min_micro_batch_size": 3}, ("auto", None, 3, None, None)),
        (
            {"split_batch_fn": f"{FUNCTIONS}.slice_batch", "batch_size_fn": f"{FUNCTIONS}.batch_size_of"},
            ("auto", None, 1, "slice_batch", "batch_size_of"),
        ),
    ],
    ids=["sizes", "defaults", "auto", "functions"],
)
def test_lightning_cli_builds_the_callback_from_a_yaml_config(tmp_path, init_args, expected):
    import yaml

    callback = {"class_path": "lightning_memopt.AutoMicroBatch", **({"init_args": init_args} if init_args else {})}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"trainer": {"callbacks": [callback]}}))
    built = _the_callback(_cli(tmp_path, [f"--config={path}"]))
    functions = [getattr(fn, "__qualname__", fn) for fn in (built.split_batch_fn, built.batch_size_fn)]
    assert (built.start_micro_batch_size, built.micro_batch_size, built.min_micro_batch_size, *functions) == expected


def test_lightning_cli_takes_the_train_evaluate_and_weight_fn_switches(tmp_path):
    import yaml

    init_args = {"train": False, "evaluate": False, "weight_fn": f"{FUNCTIONS}.batch_size_of"}
    callback = {"class_path": "lightning_memopt.AutoMicroBatch", "init_args": init_args}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"trainer": {"callbacks": [callback]}}))
    built = _the_callback(_cli(tmp_path, [f"--config={path}"]))
    assert (built.train, built.evaluate, built.weight_fn.__qualname__) == (False, False, "batch_size_of")


def test_lightning_cli_reports_the_callback_s_own_argument_check(tmp_path):
    with pytest.raises(ValueError, match=r"`micro_batch_size` must be a positive int, got 0"):
        _cli(
            tmp_path, ["--trainer.callbacks+=lightning_memopt.AutoMicroBatch", "--trainer.callbacks.micro_batch_size=0"]
        )
