"""``MemoryPrecision`` is Lightning's own precision plugin for the precision it chose: the class Lightning's Trainer
would build, from the Trainer's namespace, with only four of Lightning's methods extended (no hand-forwarding)."""

from __future__ import annotations

import copy
import importlib
import os
import pickle
import warnings

import pytest
import torch

from lightning_memopt import MemoryPrecision
from lightning_memopt.utilities.namespaces import NAMESPACES
from tests.helpers.lightning import pl
from tests.helpers.models import TinyModel
from tests.helpers.trainer import make_trainer

#: The only methods of Lightning's plugins that ``MemoryPrecision`` extends; each calls Lightning's through super().
EXTENDED = {"convert_module", "pre_backward", "load_state_dict", "teardown"}

#: Where this package's warnings must point (not Lightning's trainer or checkpoint code).
HERE = os.path.join("lightning_memopt", "plugins", "precision.py")


def _lightning_s_choice(namespace: str, precision: str) -> type:
    """The plugin class ``Trainer(accelerator="cpu", precision=...)`` of ``namespace`` builds."""
    trainer_class = importlib.import_module(namespace).Trainer
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning swaps 16-mixed for bf16-mixed on a CPU (same class)
        trainer = trainer_class(accelerator="cpu", precision=precision, logger=False, enable_progress_bar=False)
    return type(trainer.precision_plugin)


def _lightning_classes(plugin) -> list[type]:
    return [c for c in type(plugin).__mro__ if not c.__module__.startswith(("lightning_memopt", "builtins"))]


@pytest.mark.parametrize("namespace", NAMESPACES)
@pytest.mark.parametrize("precision", ["auto", "32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true", "64-true"])
def test_after_setup_it_is_the_plugin_lightning_would_build(namespace, precision):
    plugin = MemoryPrecision(precision)
    choice = plugin.resolve(torch.device("cpu"), namespace=namespace)
    expected = _lightning_s_choice(namespace, choice.precision)
    assert type(plugin) is not expected and isinstance(plugin, expected) and isinstance(plugin, MemoryPrecision)
    assert _lightning_classes(plugin) == list(expected.__mro__[:-1])  # Lightning's classes of one namespace only
    for name in dir(expected):
        if callable(getattr(expected, name)) and not name.startswith("__") and name not in EXTENDED:
            assert getattr(type(plugin), name) is getattr(expected, name), name  # Lightning's own, not a copy
    ours = {name for cls in type(plugin).__mro__ if cls.__module__.startswith("lightning_memopt") for name in vars(cls)}
    assert ours & {name for name in dir(expected) if not name.startswith("__")} == EXTENDED


def test_the_precision_argument_is_named_as_the_trainer_s():
    plugin = MemoryPrecision(precision="bf16-mixed")
    assert plugin.requested_precision == "bf16-mixed"
    assert repr(plugin) == "MemoryPrecision(precision='bf16-mixed')"
    with pytest.raises(TypeError, match="mode"):
        MemoryPrecision(mode="bf16-mixed")


def test_either_trainer_accepts_it_before_setup():
    for precision in ("auto", "bf16-true", "64-true"):
        plugin = MemoryPrecision(precision)
        assert all(isinstance(plugin, importlib.import_module(f"{ns}.plugins").Precision) for ns in NAMESPACES)


def test_a_second_choice_drops_what_lightning_set_for_the_first():
    plugin = MemoryPrecision("auto")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a CUDA GradScaler on a CPU build warns that it is disabled
        plugin.resolve(torch.device("cuda"), capability=(7, 0), device_name="Tesla V100")
    scaler = plugin.scaler
    assert isinstance(scaler, torch.amp.GradScaler) and plugin.device == "cuda"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plugin.resolve(torch.device("cuda"), capability=(7, 0), device_name="Tesla V100")
    assert plugin.scaler is scaler  # the same choice again (a second fit) keeps the scaler and its state
    plugin.resolve(torch.device("cpu"))
    assert plugin.precision == "32-true" and plugin.scaler is None and not hasattr(plugin, "device")
    assert _lightning_classes(plugin)[0] is _lightning_s_choice(NAMESPACES[0], "32-true")


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_pickle_and_deepcopy_keep_the_class(namespace):
    plugin = MemoryPrecision("16-mixed", float32_matmul_precision="high")
    for stage in ("before setup", "after setup"):
        for copied in (pickle.loads(pickle.dumps(plugin)), copy.deepcopy(plugin)):
            assert type(copied) is type(plugin), stage
            assert (copied.requested_precision, copied.precision) == (plugin.requested_precision, plugin.precision)
        plugin.resolve(torch.device("cpu"), namespace=namespace)
    assert isinstance(copied.scaler, torch.amp.GradScaler) and copied.scaler is not plugin.scaler


def _fit_16_mixed(tmp_path, ckpt_path=None, max_steps=2):
    plugin = MemoryPrecision("16-mixed", scaler=torch.amp.GradScaler("cpu"))  # Lightning 2.1 makes a CUDA-only one
    trainer = make_trainer(
        tmp_path,
        plugins=[plugin],
        max_steps=max_steps,
        enable_checkpointing=True,
        callbacks=[pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)],
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(TinyModel(), ckpt_path=ckpt_path)
    return plugin, caught


def test_the_scaler_state_goes_through_a_checkpoint_under_one_key(tmp_path):
    plugin, _ = _fit_16_mixed(tmp_path)
    saved = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)
    state = saved["MemoryPrecision"]
    assert state == plugin.scaler.state_dict() and state["_growth_tracker"] >= 1
    resumed, _ = _fit_16_mixed(tmp_path, ckpt_path=tmp_path / "ckpt" / "last.ckpt", max_steps=3)
    after = resumed.scaler.state_dict()
    assert (after["scale"], after["_growth_tracker"]) == (state["scale"], state["_growth_tracker"] + 1)


def test_a_bad_scaler_state_warns_from_this_package_and_starts_fresh(tmp_path):
    _fit_16_mixed(tmp_path)
    path = tmp_path / "ckpt" / "last.ckpt"
    saved = torch.load(path, weights_only=False)
    tracker = saved["MemoryPrecision"]["_growth_tracker"]
    saved["MemoryPrecision"]["scale"] = -1.0
    torch.save(saved, path)
    resumed, caught = _fit_16_mixed(tmp_path, ckpt_path=path, max_steps=3)
    (warned,) = [w for w in caught if "checkpoint's state key 'scale'" in str(w.message)]
    assert warned.filename.endswith(HERE), warned.filename
    assert resumed.scaler.state_dict()["_growth_tracker"] != tracker + 1  # fresh: the saved tracker was not loaded


def test_a_subclass_is_refused_instead_of_losing_its_methods_at_setup():
    with pytest.raises(TypeError, match="cannot subclass `MemoryPrecision`.*subclass Lightning's precision plugin"):

        class Mine(MemoryPrecision):
            pass


@pytest.mark.cuda
def test_on_a_gpu_auto_becomes_lightnings_mixed_precision_and_autocasts(tmp_path):
    """On a real GPU, ``auto`` is Lightning's ``MixedPrecision`` of the Trainer's namespace, and the training step
    runs under its autocast (bf16 where the card computes it, else fp16 with a scaler)."""
    seen = []

    class Model(TinyModel):
        def training_step(self, batch, batch_idx):
            out = self(batch)
            seen.append(out.dtype)
            return out.float().pow(2).mean()

    plugin = MemoryPrecision("auto")
    trainer = make_trainer(tmp_path, accelerator="cuda", plugins=[plugin], max_steps=2)
    trainer.fit(Model())
    mixed = importlib.import_module(f"{pl.__name__}.plugins.precision").MixedPrecision
    assert trainer.precision_plugin is plugin and isinstance(plugin, mixed) and isinstance(plugin, MemoryPrecision)
    bf16 = torch.cuda.get_device_capability()[0] >= 8
    assert set(seen) == {torch.bfloat16 if bf16 else torch.float16}
    assert (plugin.scaler is None) == bf16
