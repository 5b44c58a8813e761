"""Byte accounting of a model, its optimizers and the live tensors of a process.

Functions over modules, optimizers and the tensors reachable through Python's garbage collector; they read, never
change, what they are given. No Trainer, no hooks: the callbacks (``MemoryAudit``, ``OOMReporter``) call these and
decide what to report.

Every byte figure is *storage* bytes (``tensor.untyped_storage().nbytes()``), and a storage shared by
several tensors (views, tied weights, a gradient that aliases another tensor) is counted once. A storage
is identified by its :data:`StorageKey`: ``(device string, data pointer of the storage)``.

Modules: :mod:`.storage` (storage keys and sizes, the garbage collector's tensors), :mod:`.accounting` (what a model
and its optimizers hold), :mod:`.live` (the live tensors), :mod:`.duplicates` (stray copies of the weights),
:mod:`.holders` (where tensors are held), :mod:`.sharding` (how the parameters are sharded: FSDP units, local
shards beside the whole).
"""

from lightning_memopt.functional.footprint.accounting import (
    CATEGORIES,
    Footprint,
    FootprintRow,
    model_footprint,
    tensor_names,
    unexplained_bytes,
)
from lightning_memopt.functional.footprint.duplicates import Duplicates, find_duplicates
from lightning_memopt.functional.footprint.holders import MODULE_INTERNALS, find_storage_holders, iter_held_tensors
from lightning_memopt.functional.footprint.live import LiveTensor, live_tensors
from lightning_memopt.functional.footprint.sharding import Sharding, model_sharding
from lightning_memopt.functional.footprint.storage import StorageKey, storage_bytes, storage_key

__all__ = [
    "CATEGORIES",
    "MODULE_INTERNALS",
    "Duplicates",
    "Footprint",
    "FootprintRow",
    "LiveTensor",
    "Sharding",
    "StorageKey",
    "find_duplicates",
    "find_storage_holders",
    "iter_held_tensors",
    "live_tensors",
    "model_footprint",
    "model_sharding",
    "storage_bytes",
    "storage_key",
    "tensor_names",
    "unexplained_bytes",
]
