"""One contract over every exported callback: what any Lightning user may do with a callback."""

import copy
import pickle

import pytest
import torch
from lightning.pytorch.callbacks import Callback

import lightning_memopt.callbacks as callbacks_pkg
from tests.helpers.models import TinyModel
from tests.helpers.trainer import make_trainer

EXPORTED = [getattr(callbacks_pkg, name) for name in callbacks_pkg.__all__]


def test_every_export_is_a_callback():
    assert EXPORTED, "no callbacks exported"
    for cls in EXPORTED:
        assert issubclass(cls, Callback), cls
    assert list(callbacks_pkg.__all__) == sorted(callbacks_pkg.__all__)


@pytest.mark.parametrize("cls", EXPORTED, ids=lambda c: c.__name__)
def test_callback_contract(cls, tmp_path):
    callback = cls()  # defaults only
    model = TinyModel()
    trainer = make_trainer(tmp_path, callbacks=[callback], max_steps=3, logger=False)
    trainer.fit(model)
    assert trainer.global_step == 3

    # pickle after a fit (e.g. for spawn launchers and checkpoint-time deep copies)
    clone = pickle.loads(pickle.dumps(callback))
    assert type(clone) is cls
    copy.deepcopy(callback)

    # state_dict round trip through a fresh instance
    state = callback.state_dict()
    assert isinstance(state, dict)
    fresh = cls()
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


@pytest.mark.parametrize("cls", EXPORTED, ids=lambda c: c.__name__)
def test_callback_state_survives_a_checkpoint(cls, tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    callback = cls()
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    trainer = make_trainer(tmp_path, callbacks=[callback, ckpt], max_steps=2, enable_checkpointing=True)
    trainer.fit(TinyModel())
    saved = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)["callbacks"]
    state = callback.state_dict()
    if state:
        assert saved[callback.state_key] == state
    else:  # a stateless callback: Lightning stores only non-empty callback states
        assert callback.state_key not in saved
    resumed_cb = cls()
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
    from lightning.pytorch.cli import LightningCLI

    config = {
        "trainer": {
            "accelerator": "cpu", "devices": 1, "max_steps": 2, "logger": False, "enable_checkpointing": False,
            "enable_progress_bar": False, "enable_model_summary": False, "limit_val_batches": 1,
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
