"""The Lightning namespace the tests run against.

``lightning.pytorch`` unless ``LIGHTNING_MEMOPT_TEST_NAMESPACE=pytorch_lightning``: ``tests/test_namespaces.py``
runs the contract tests again that way, so every callback, the precision plugin and the presets are tried with
each Trainer.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

NAMESPACE = os.environ.get("LIGHTNING_MEMOPT_TEST_NAMESPACE", "lightning.pytorch")

#: The namespace itself (``pl.Trainer``, ``pl.LightningModule``, ``pl.Callback``).
pl = importlib.import_module(NAMESPACE)


def lightning_module(name: str) -> ModuleType:
    """``<namespace>.<name>``, e.g. ``lightning_module("callbacks").ModelCheckpoint``."""
    return importlib.import_module(f"{NAMESPACE}.{name}")
