"""One contract over every exported callback: what any Lightning user may do with a callback."""

import copy
import gc
import json
import os
import pickle

import pytest
import torch

import lightning_memopt.callbacks as callbacks_pkg
from tests.helpers.lightning import lightning_module, pl
from tests.helpers.models import TinyModel
from tests.helpers.trainer import make_trainer

EXPORTED = [getattr(callbacks_pkg, name) for name in callbacks_pkg.__all__]
# MemoryAudit's fits walk every Python object (1.5-2.4 s each): in the full suite only
CONTRACT = [pytest.param(c, marks=pytest.mark.slow) if c.__name__ == "MemoryAudit" else c for c in EXPORTED]
#: Where a callback's defaults do nothing observable, the arguments that make it act (anything else: defaults only).
ARGUMENTS = {"AllocatorSettings": {"allocator_conf": "expandable_segments:True"}}
_ALLOC_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def _make(cls):
    return cls(**ARGUMENTS.get(cls.__name__, {}))


@pytest.fixture(autouse=True)
def _allocator_env_given_back():
    """Each test starts without allocator settings in the environment; an ``AllocatorSettings`` built but never fit
    (e.g. for a state round trip) keeps its setting, which is undone here."""
    saved = {name: os.environ.pop(name, None) for name in _ALLOC_ENV}
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def test_every_export_is_a_callback():
    assert EXPORTED, "no callbacks exported"
    for cls in EXPORTED:
        assert issubclass(cls, pl.Callback), cls
    assert list(callbacks_pkg.__all__) == sorted(callbacks_pkg.__all__)


class _During(pl.Callback):
    """What the process and the Trainer looked like in the middle of the fit."""

    def __init__(self):
        self.seen = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.seen is None:
            loop = trainer.fit_loop.epoch_loop.automatic_optimization
            alloc = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
            self.seen = {"gc_enabled": gc.isenabled(), "loop": type(loop).__name__, "alloc": alloc}


def _did_its_job(callback, trainer, during, tmp_path):
    """Each callback's own observable effect of a 3-step CPU fit at its defaults (not only "it did not raise")."""
    name = type(callback).__name__
    loop = type(trainer.fit_loop.epoch_loop.automatic_optimization).__name__
    if name == "MemoryMonitor":  # readings written for this run
        records = [json.loads(line) for line in callback.path.read_text().splitlines()]
        assert {r["phase"] for r in records} >= {"train"} and records[-1]["run_id"]
    elif name == "MemoryAudit":  # the footprint taken and the loaders looked at
        assert callback.last_audit["footprint"]["bytes_by_category"]["parameters"] == (32 * 2 + 2) * 4
        assert [i.name for i in callback.loaders] == ["train"]
    elif name == "OOMReporter":  # no out-of-memory: no report and not even its directory
        assert not (tmp_path / "memopt").exists()
    elif name == "CacheCleaner":  # a CPU has no allocator cache: nothing emptied, nothing counted
        assert (callback.calls, callback.seconds) == (0, 0.0)
    elif name == "GarbageCollector":  # automatic collection off during the fit, given back after it
        assert during["gc_enabled"] is False and gc.isenabled()
    elif name == "GradientCheckpointing":  # TinyModel has no transformer layer: nothing wrapped, nothing patched
        modules = trainer.lightning_module.modules()
        assert callback.wrapped_names == [] and all("forward" not in vars(m) for m in modules)
    elif name == "AutoMicroBatch":  # the whole batch fit; its loop was in place during the fit and is gone after
        assert callback.micro_batch_size == 4 and during["loop"] == "_MicroBatchOptimization" and loop != during["loop"]
    elif name == "AllocatorSettings":  # the setting in the environment during the fit (no CUDA yet), gone after it
        assert during["alloc"] == "expandable_segments:True" and "PYTORCH_CUDA_ALLOC_CONF" not in os.environ
    else:
        raise AssertionError(f"no behaviour check for {name}: add one here")


@pytest.mark.parametrize("cls", CONTRACT, ids=lambda c: c.__name__)
def test_callback_contract(cls, tmp_path):
    callback = _make(cls)  # defaults only, or the ARGUMENTS that make it act
    model = TinyModel()
    during = _During()
    trainer = make_trainer(tmp_path, callbacks=[callback, during], max_steps=3, logger=False, limit_val_batches=0)
    trainer.fit(model)
    assert trainer.global_step == 3
    _did_its_job(callback, trainer, during.seen, tmp_path)

    # pickle after a fit (e.g. for spawn launchers and checkpoint-time deep copies)
    clone = pickle.loads(pickle.dumps(callback))
    assert type(clone) is cls
    copy.deepcopy(callback)

    # state_dict round trip through a fresh instance
    state = callback.state_dict()
    assert isinstance(state, dict)
    fresh = _make(cls)
    fresh.load_state_dict(copy.deepcopy(state))
    assert fresh.state_dict() == state
    assert isinstance(callback.state_key, str)

    # fit twice with the same callback instance and the same trainer, then with a new trainer
    trainer.fit(model)
    trainer2 = make_trainer(tmp_path, callbacks=[callback], max_steps=2, logger=False)
    trainer2.fit(TinyModel())
    assert trainer2.global_step == 2

    # the other entry points
    trainer2.validate(model, verbose=False)
    trainer2.test(model, verbose=False)
    trainer2.predict(model)


@pytest.mark.parametrize("cls", CONTRACT, ids=lambda c: c.__name__)
def test_callback_state_survives_a_checkpoint(cls, tmp_path):
    ModelCheckpoint = lightning_module("callbacks").ModelCheckpoint

    callback = _make(cls)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    trainer = make_trainer(tmp_path, callbacks=[callback, ckpt], max_steps=2, enable_checkpointing=True)
    trainer.fit(TinyModel())
    saved = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)["callbacks"]
    state = callback.state_dict()
    if state:
        assert saved[callback.state_key] == state
    else:  # a stateless callback: Lightning stores only non-empty callback states
        assert callback.state_key not in saved
    resumed_cb = _make(cls)
    loaded = []
    original = resumed_cb.load_state_dict
    resumed_cb.load_state_dict = lambda state: loaded.append(state) or original(state)
    resumed = make_trainer(tmp_path, callbacks=[resumed_cb], max_steps=3)
    resumed.fit(TinyModel(), ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    assert resumed.global_step == 3
    assert loaded == ([state] if state else [])


@pytest.mark.slow
def test_callbacks_configurable_from_lightning_cli_yaml(tmp_path):
    pytest.importorskip("jsonargparse")
    import yaml

    LightningCLI = lightning_module("cli").LightningCLI

    config = {
        "trainer": {
            "accelerator": "cpu",
            "devices": 1,
            "max_steps": 2,
            "logger": False,
            "enable_checkpointing": False,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "limit_val_batches": 1,
            "default_root_dir": str(tmp_path),
            "callbacks": [{"class_path": f"lightning_memopt.{name}"} for name in callbacks_pkg.__all__],
        }
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    cli = LightningCLI(TinyModel, args=["fit", "--config", str(path)], save_config_kwargs={"overwrite": True})
    names = {type(cb).__name__ for cb in cli.trainer.callbacks}
    assert set(callbacks_pkg.__all__) <= names
    assert cli.trainer.global_step == 2


class BlockModel(TinyModel):
    """TinyModel with a transformer layer in front, so that GradientCheckpointing has something to wrap."""

    def __init__(self, crash_at=None):
        super().__init__()
        self.block = torch.nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True)
        self.crash_at = crash_at
        self.patched = []

    def forward(self, x):
        return self.layer(self.block(x.unsqueeze(1)).squeeze(1))

    def training_step(self, batch, batch_idx):
        self.patched.append("forward" in vars(self.block))  # what the callbacks did to the user's module
        if batch_idx == self.crash_at:
            raise RuntimeError("crash in training_step")
        return super().training_step(batch, batch_idx)


def _process_state():
    import gc
    import os

    return {
        "gc": (gc.isenabled(), gc.get_threshold()),
        "env": {k: v for k, v in os.environ.items() if k.startswith(("PYTORCH_", "CUDA_"))},
        "matmul": torch.get_float32_matmul_precision(),
    }


def _assert_freeze_kept(before: int) -> None:
    """The suite's freeze is as it was: a frozen object the fit drops is freed and the count goes down (hundreds when
    a test runs alone, the process's first fit); a freeze left behind adds every object the fit made, an unfreeze
    left behind takes them all."""
    import gc

    count = gc.get_freeze_count()
    assert count <= before and (before == 0 or count > before // 2), (before, count)


def _fit_recording(callback, tmp_path, model):
    """Fit, and return what the package warned and, per step, whether the user's module was patched."""
    import warnings

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer = make_trainer(tmp_path, callbacks=[callback], max_steps=3, limit_val_batches=0, logger=False)
        trainer.fit(model)
    assert trainer.global_step == 3
    ours = sorted(
        {
            str(w.message)
            for w in seen
            if "lightning_memopt" in (w.filename or "") or type(callback).__name__ in str(w.message)
        }
    )
    return set(ours), model.patched


@pytest.mark.parametrize("cls", CONTRACT, ids=lambda c: c.__name__)
def test_a_crash_then_a_clean_second_fit_behaves_like_a_fresh_callback(cls, tmp_path):
    import gc

    before, frozen = _process_state(), gc.get_freeze_count()
    model = BlockModel(crash_at=1)
    forward = model.block.forward
    callback = _make(cls)
    trainer = make_trainer(tmp_path / "crash", callbacks=[callback], max_steps=3, limit_val_batches=0, logger=False)
    with pytest.raises(RuntimeError, match="crash in training_step"):
        trainer.fit(model)
    # everything borrowed is given back: the process state and the user's modules
    assert _process_state() == before
    _assert_freeze_kept(frozen)
    assert model.block.forward == forward and "forward" not in vars(model.block)
    # the same instance, a second fit: what a fresh instance does (no warning a fresh one would not give; a
    # warn-once message given in the first fit is not repeated)
    again_warned, again_patched = _fit_recording(callback, tmp_path / "again", BlockModel())
    fresh_warned, fresh_patched = _fit_recording(_make(cls), tmp_path / "fresh", BlockModel())
    assert again_warned <= fresh_warned, again_warned - fresh_warned
    assert again_patched == fresh_patched == [cls.__name__ == "GradientCheckpointing"] * 3
    assert _process_state() == before
    _assert_freeze_kept(frozen)
