"""``MemoryPrecision`` is Lightning's own precision plugin for the precision it chose: the class Lightning's Trainer
would build, from construction on and from the Trainer's namespace after setup, with only four of Lightning's methods
extended (no hand-forwarding); subclasses keep their methods."""

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
from tests.helpers.models import TinyModel, fit_linear_module
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
    lightning = list(expected.__mro__[:-1])
    assert _lightning_classes(plugin)[: len(lightning)] == lightning  # Lightning's class and all it inherits first
    # then only the other namespace's base, so that a Trainer of either namespace takes the plugin
    assert all(isinstance(plugin, importlib.import_module(f"{ns}.plugins").Precision) for ns in NAMESPACES)
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


def _lightning_class(name: str, namespace: str = NAMESPACES[0]) -> type:
    return getattr(importlib.import_module(f"{namespace}.plugins.precision"), name)


@pytest.mark.parametrize(
    ("precision", "name"),
    [
        ("bf16-mixed", "MixedPrecision"),
        ("16-mixed", "MixedPrecision"),
        ("16-true", "HalfPrecision"),
        ("bf16-true", "HalfPrecision"),
        ("64-true", "DoublePrecision"),
        ("32-true", "Precision"),
        ("auto", "Precision"),  # on a CPU
    ],
)
def test_it_is_lightning_s_plugin_from_construction_on(precision, name):
    plugin = MemoryPrecision(precision, device="cpu")
    expected = _lightning_class(name)
    assert isinstance(plugin, expected) and _lightning_classes(plugin)[0] is expected
    assert type(plugin).__qualname__ == "MemoryPrecision"  # Lightning's checkpoint key for the plugin's state
    assert repr(plugin) == f"MemoryPrecision(precision={precision!r})"
    assert plugin.precision == ("32-true" if precision == "auto" else precision)
    if name == "MixedPrecision":
        assert plugin.device == "cpu"


def test_auto_on_a_cpu_is_the_class_itself():
    plugin = MemoryPrecision("auto", device="cpu")
    assert type(plugin) is MemoryPrecision and isinstance(plugin, _lightning_class("Precision"))


def test_the_device_defaults_to_what_trainer_accelerator_auto_picks(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert MemoryPrecision("bf16-mixed").device == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert MemoryPrecision("bf16-mixed").device == "cuda"


@pytest.mark.parametrize("device", ["gpu0", 3.5, object()])
def test_a_bad_device_is_refused_naming_the_argument(device):
    with pytest.raises(ValueError, match=r"`device` must be a device type such as 'cuda' or 'cpu'.*, got "):
        MemoryPrecision("bf16-mixed", device=device)


def test_a_device_the_trainer_does_not_train_on_is_chosen_again_at_setup(tmp_path):
    plugin = MemoryPrecision("bf16-mixed", device="cuda")  # built on a GPU machine, trained with accelerator="cpu"
    assert plugin.device == "cuda"
    trainer = make_trainer(tmp_path, plugins=[plugin], max_steps=1)
    trainer.fit(TinyModel())
    assert plugin.device == "cpu" and plugin.scaler is None  # Lightning's `__init__` run again, for the CPU
    assert _lightning_classes(plugin)[0] is _lightning_class("MixedPrecision", pl.__name__)  # the Trainer's namespace
    fp16 = MemoryPrecision("16-mixed", device="cpu")
    built_for_cpu = fp16.scaler
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a CUDA GradScaler on a CPU build warns that it is disabled
        fp16.resolve(torch.device("cuda"), capability=(7, 0), device_name="Tesla V100")
    assert fp16.device == "cuda" and isinstance(fp16.scaler, torch.amp.GradScaler) and fp16.scaler is not built_for_cpu


def test_auto_chosen_on_a_gpu_becomes_fp32_on_a_cpu_trainer(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    plugin = MemoryPrecision("auto")
    assert isinstance(plugin, _lightning_class("MixedPrecision")) and plugin.precision == "bf16-mixed"
    monkeypatch.undo()
    make_trainer(tmp_path, plugins=[plugin], max_steps=1).fit(TinyModel())
    assert plugin.precision == "32-true" and not hasattr(plugin, "device") and isinstance(plugin, MemoryPrecision)
    assert _lightning_classes(plugin)[0] is _lightning_class("Precision", pl.__name__)


class _Mine(MemoryPrecision):
    """A user's subclass: one Lightning method overridden, one method added."""

    def pre_backward(self, tensor, module):
        self.backwards = getattr(self, "backwards", 0) + 1
        return super().pre_backward(tensor, module)

    def describe(self) -> str:
        return f"mine, {self.precision}"


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_a_subclass_keeps_its_methods_through_a_fit(namespace, tmp_path):
    pl_namespace = importlib.import_module(namespace)
    plugin = _Mine("bf16-mixed", device="cpu")
    assert isinstance(plugin, _Mine) and isinstance(plugin, _lightning_class("MixedPrecision"))
    assert type(plugin).__name__ == "_Mine" and repr(plugin) == "_Mine(precision='bf16-mixed')"
    trainer = fit_linear_module(pl_namespace, tmp_path, plugins=[plugin])
    assert trainer.precision_plugin is plugin and isinstance(plugin, _Mine) and isinstance(plugin, MemoryPrecision)
    expected = _lightning_class("MixedPrecision", namespace)  # the Trainer's namespace, for every Lightning method
    assert all(getattr(type(plugin), name) is getattr(expected, name) for name in ("forward_context", "backward"))
    assert plugin.backwards == 2 and plugin.describe() == "mine, bf16-mixed"
    assert pickle.loads(pickle.dumps(plugin)).describe() == "mine, bf16-mixed"


def test_a_subclass_with_its_own_arguments_is_built_for_what_it_passes_on():
    class Fixed(MemoryPrecision):
        def __init__(self, label: str, **kwargs):
            super().__init__(precision="bf16-true", **kwargs)
            self.label = label

    class Forwarding(MemoryPrecision):
        def __init__(self, label: str, **kwargs):
            super().__init__(**kwargs)
            self.label = label

    fixed = Fixed("a", device="cpu")
    forwarding = Forwarding("b", precision="64-true")
    assert isinstance(fixed, Fixed) and isinstance(fixed, _lightning_class("HalfPrecision")) and fixed.label == "a"
    assert isinstance(forwarding, _lightning_class("DoublePrecision")) and forwarding.label == "b"
    with pytest.raises(TypeError, match="label"):
        Forwarding(precision="64-true")


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
