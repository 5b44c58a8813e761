"""The zoo's LightningCLI project: a LightningModule and a LightningDataModule importable by ``class_path``, the
``MemoryPresetCLI`` that trains them, and the YAML configs a user writes for it.

* ``config.yaml``: ``model: class_path: ... init_args: ...``, ``data: class_path: ... init_args: {batch_size: ...}``
  and a ``memory:`` section (``ZooCLI`` in subclass mode: ``main(subclass_mode=True)``).
* ``config_fixed.yaml``: the same project for a CLI given the classes (``main(subclass_mode=False)``): ``model:`` and
  ``data:`` hold the init args alone.

Run it as a user does (``python -m tests.helpers.zoo_cli fit --config tests/helpers/zoo_cli/config.yaml``) or in
process with :func:`main`.
"""

from tests.helpers.zoo_cli.project import CONFIG, CONFIG_FIXED, ZooBlock, ZooClassifier, ZooCLI, ZooDataModule, main

__all__ = ["CONFIG", "CONFIG_FIXED", "ZooBlock", "ZooCLI", "ZooClassifier", "ZooDataModule", "main"]
