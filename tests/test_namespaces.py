"""Both Lightning namespaces: ``lightning.pytorch`` and the standalone ``pytorch_lightning`` (2.1 and later).

The contract tests run again in a fresh interpreter with ``LIGHTNING_MEMOPT_TEST_NAMESPACE=pytorch_lightning``
(their models, Trainers and CLIs then come from ``pytorch_lightning``) with the oldest release served, which
``scripts/bootstrap.sh`` puts into ``.venv/lightning-oldest``; the installed ``pytorch_lightning`` (the release of
``lightning.pytorch``) runs the plugin and the preset through its own Trainer here.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from lightning_memopt import (
    AllocatorSettings,
    AutoMicroBatch,
    CacheCleaner,
    GarbageCollector,
    GradientCheckpointing,
    MemoryAudit,
    MemoryMonitor,
    MemoryPrecision,
    MemoryPreset,
    OOMReporter,
)
from lightning_memopt.utilities import namespaces
from tests.helpers.models import fit_linear_module
from tests.helpers.presets_env import give_back_allocator_settings
from tests.helpers.subprocess_run import REPO_ROOT, run_script

pytorch_lightning = pytest.importorskip("pytorch_lightning")
import lightning.pytorch as lightning_pytorch  # noqa: E402

OLDEST = REPO_ROOT / ".venv" / "lightning-oldest"
#: The tests that build every callback, the precision plugin and the presets into a Trainer and fit, run again with
#: the oldest ``pytorch_lightning`` served. The installed ``pytorch_lightning`` is the same release as
#: ``lightning.pytorch`` (the main run) under another name; its Trainer takes the plugin and the preset in this file.
OLDEST_TESTS = [
    "tests/callbacks/test_contract.py",  # every callback, AutoMicroBatch's loop included, fits in a Trainer
    "tests/callbacks/test_auto_micro_batch_eval.py",  # evaluation split through the private names of 2.1
    "tests/plugins/test_precision.py",
    "tests/plugins/test_precision_classes.py",  # the Lightning plugin class is the namespace's own
    "tests/plugins/test_presets.py",
    "tests/plugins/test_precision_names.py",
    "tests/plugins/test_preset_cli.py",  # MemoryPresetCLI on the namespace's LightningCLI
]
CALLBACKS = [
    AllocatorSettings,
    AutoMicroBatch,
    CacheCleaner,
    GarbageCollector,
    GradientCheckpointing,
    MemoryAudit,
    MemoryMonitor,
    OOMReporter,
]


def test_both_namespaces_are_found_installed():
    assert namespaces.NAMESPACES == ("lightning.pytorch", "pytorch_lightning")
    assert namespaces.classes("Trainer") == (lightning_pytorch.Trainer, pytorch_lightning.Trainer)


@pytest.mark.parametrize("cls", CALLBACKS, ids=lambda c: c.__name__)
def test_every_callback_is_a_callback_of_both_namespaces(cls):
    assert issubclass(cls, lightning_pytorch.Callback)
    assert issubclass(cls, pytorch_lightning.Callback)


@pytest.mark.parametrize("pl", [lightning_pytorch, pytorch_lightning], ids=lambda m: m.__name__)
def test_either_trainer_takes_the_plugin_and_the_preset(pl, tmp_path):
    """``pytorch_lightning.Trainer`` used to refuse MemoryPrecision: "Found invalid type for plugin"."""
    trainer = pl.Trainer(
        accelerator="cpu",
        plugins=[MemoryPrecision("bf16-mixed")],
        logger=False,
        default_root_dir=str(tmp_path),
        enable_progress_bar=False,
    )
    assert isinstance(trainer.precision_plugin, MemoryPrecision)
    preset = MemoryPreset("max-savings", effective_batch_size=8)
    trainer = pl.Trainer(**preset.trainer_kwargs(accelerator="cpu", logger=False, default_root_dir=str(tmp_path)))
    built = preset.callbacks()
    give_back_allocator_settings(trainer.callbacks, built)  # never fit, never torn down
    assert trainer.accumulate_grad_batches == preset.accumulate_grad_batches
    assert {type(c) for c in trainer.callbacks} >= {type(c) for c in built}


@pytest.mark.parametrize("pl", [lightning_pytorch, pytorch_lightning], ids=lambda m: m.__name__)
def test_the_plugin_works_through_the_trainer_s_own_namespace(pl, tmp_path):
    plugin = MemoryPrecision("bf16-mixed")
    trainer = fit_linear_module(pl, tmp_path, plugins=[plugin])
    assert trainer.global_step == 2
    assert namespaces.namespace_of(trainer) is pl
    assert isinstance(plugin, pl.plugins.precision.MixedPrecision)  # Lightning's plugin of the Trainer's namespace
    assert plugin.precision == "bf16-mixed"


def test_namespace_of_and_lookup_follow_the_object():
    trainer = pytorch_lightning.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False)
    assert namespaces.namespace_of(trainer) is pytorch_lightning
    assert namespaces.lookup(trainer, "strategies.DDPStrategy") is pytorch_lightning.strategies.DDPStrategy
    assert namespaces.is_instance(trainer, "Trainer")
    assert not namespaces.is_instance(trainer.strategy, "strategies.DDPStrategy")
    assert namespaces.namespace_of(lightning_pytorch.LightningModule()) is lightning_pytorch


def _run_contract_tests(
    tests: list[str], extra_path: str | None = None, options: tuple[str, ...] = ()
) -> tuple[str, str]:
    env = dict(os.environ, LIGHTNING_MEMOPT_TEST_NAMESPACE="pytorch_lightning", PYTHONWARNINGS="ignore")
    if extra_path:
        env["PYTHONPATH"] = os.pathsep.join([extra_path, str(REPO_ROOT), env.get("PYTHONPATH", "")])
    # one interpreter prints the versions found, then runs pytest (each fresh interpreter imports Lightning: ~3 s)
    runner = (
        "import sys, pytest, pytorch_lightning as p, lightning_memopt.utilities.namespaces as n;"
        " print('VERSIONS', p.__version__, ','.join(n.NAMESPACES), flush=True);"
        " sys.exit(pytest.main(sys.argv[1:]))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", runner, "-q", "-x", "-p", "no:cacheprovider", "-W", "ignore", *options, *tests],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and " failed" not in proc.stdout
    version = next(line for line in proc.stdout.splitlines() if line.startswith("VERSIONS ")).split()
    return version[1], version[2]


@pytest.mark.slow
def test_the_contract_tests_pass_with_the_oldest_pytorch_lightning_served():
    if not OLDEST.is_dir():
        if os.environ.get("CI"):
            pytest.fail(f"{OLDEST} is missing: `bash scripts/bootstrap.sh test` installs it")
        pytest.skip(f"{OLDEST} is missing: `bash scripts/bootstrap.sh test` installs it")
    version, found = _run_contract_tests(OLDEST_TESTS, str(OLDEST), options=("-m", "not slow"))
    assert tuple(int(p) for p in version.split(".")[:2]) == namespaces.MIN_VERSION
    assert found == "lightning.pytorch,pytorch_lightning"


ONE_NAMESPACE_SCRIPT = """
import sys
sys.modules[{hidden!r}] = None  # as if it were not installed: any import of it fails
import importlib
import torch

from lightning_memopt import (AutoMicroBatch, CacheCleaner, GarbageCollector, GradientCheckpointing, MemoryAudit,
                              MemoryMonitor, MemoryPrecision, OOMReporter)
from lightning_memopt.utilities.namespaces import NAMESPACES

pl = importlib.import_module({used!r})


class Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.randn(16, 4), batch_size=4)


callbacks = [AutoMicroBatch(), CacheCleaner(), GarbageCollector(), GradientCheckpointing(), MemoryAudit(),
             MemoryMonitor(), OOMReporter()]
trainer = pl.Trainer(accelerator="cpu", max_steps=3, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, callbacks=callbacks, plugins=[MemoryPrecision("bf16-mixed")],
                     default_root_dir=".")
trainer.fit(Model())
print("NAMESPACES", ",".join(NAMESPACES), "STEPS", trainer.global_step,
      "IMPORTED", any(m == {hidden!r} or m.startswith({hidden!r} + ".") for m, v in sys.modules.items()
                      if v is not None))
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("used", "hidden"), [("pytorch_lightning", "lightning"), ("lightning.pytorch", "pytorch_lightning")]
)
def test_one_namespace_installed_is_enough_and_the_other_is_never_imported(used, hidden, tmp_path):
    proc = run_script(ONE_NAMESPACE_SCRIPT.format(used=used, hidden=hidden), tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"NAMESPACES {used} STEPS 3 IMPORTED False" in proc.stdout, proc.stdout[-2000:]
