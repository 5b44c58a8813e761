"""The work behind ``lightning-memopt estimate``: a model, a batch and a budget from the command line.

Private to :mod:`lightning_memopt.cli`. Importing this package imports neither torch nor Lightning (``build_parser``
never imports it; ``_run_estimate`` does, and torch and the planner are imported inside :func:`run_estimate`).

What it does, in the order :func:`run_estimate` (``run.py``) does it:

* read the LightningCLI config files (``--config``: sections ``model``, ``data``, ``optimizer``, ``trainer`` and
  MemoryPresetCLI's ``memory``; any other section is ignored) and apply the command line's ``--model CLASS``,
  ``--data CLASS``, ``--optimizer CLASS`` and dotted overrides (``--model.init_args.lr 0.1`` or ``--model.lr 0.1``)
  (``config.py``);
* check the flags and read the settings: precision, devices, budget, checkpointing, optimizer (``settings.py``),
  and the ``memory:`` preset's micro-batch, precision, checkpointing and effective batch (``memory.py``);
* build the classes with :mod:`importlib` (nested ``class_path``/``init_args`` dicts are built too) (``classes.py``);
* make ``batch_fn(micro_batch_size)``: from the datamodule's training set (the first samples in order, collated by
  its ``train_dataloader``'s ``collate_fn``) or from ``--batch-shape`` specs (``batches.py``);
* run :func:`~lightning_memopt.planner.estimate_memory` (no budget) or
  :func:`~lightning_memopt.planner.plan_memory` (a budget) and print the result; a plan that fits ends with the
  ``memory:`` section to paste back into the config (``memory.py``).

Every error a user can cause is an :class:`EstimateInputError` whose message is one line naming the argument.
"""

from lightning_memopt.cli_estimate.batches import parse_batch_shape
from lightning_memopt.cli_estimate.common import EstimateInputError
from lightning_memopt.cli_estimate.config import CLASS_SECTIONS
from lightning_memopt.cli_estimate.run import run_estimate

__all__ = ["CLASS_SECTIONS", "EstimateInputError", "parse_batch_shape", "run_estimate"]
