"""AllocatorSettings: CUDA caching-allocator settings and a memory fraction for one run, given back at teardown."""

from __future__ import annotations

from typing import TYPE_CHECKING

from typing_extensions import override

from lightning_memopt.functional.allocator import (
    AllocatorState,
    apply_allocator_conf,
    apply_memory_fraction,
    parse_alloc_conf,
    restore_allocator_settings,
)
from lightning_memopt.utilities.checks import check_fraction
from lightning_memopt.utilities.namespaces import Callback
from lightning_memopt.utilities.trainer import trainer_device
from lightning_memopt.utilities.warnings import WarnOnce

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["AllocatorSettings"]


class AllocatorSettings(Callback):
    """Applies allocator settings and a memory fraction for one run, and gives them back at teardown.

    ``MemoryPreset.trainer_kwargs()`` adds it when the preset carries allocator settings or a fraction. The
    settings are applied when this callback is built (normally before CUDA is initialised) and again at setup
    if they were not in effect; the fraction at setup, on the device the Trainer trains on.

    Both are given back at teardown and when fit stops with an exception: an environment variable that was unset is
    removed again, one that was set gets its exact previous value back.

    Args:
        allocator_conf: e.g. ``"expandable_segments:True"``; ``None`` leaves the allocator alone.
        memory_fraction: fraction of the device memory this process may use, in (0, 1].

    Outputs: ``PYTORCH_CUDA_ALLOC_CONF`` (or ``PYTORCH_ALLOC_CONF`` where the user set that one) during the run, or
    torch's runtime allocator settings once CUDA is initialised; nothing is logged.

    Example:
        >>> cb = AllocatorSettings(memory_fraction=0.95)
        >>> cb.memory_fraction
        0.95
    """

    def __init__(self, allocator_conf: str | None = None, memory_fraction: float | None = None) -> None:
        if allocator_conf is not None and not isinstance(allocator_conf, str):
            raise ValueError(
                f"`allocator_conf` must be a string of `key:value` entries or None, got {allocator_conf!r}."
                " Example: 'expandable_segments:True,max_split_size_mb:128'."
            )
        parse_alloc_conf(allocator_conf)
        check_fraction("memory_fraction", memory_fraction, allow_none=True)
        self.allocator_conf = allocator_conf
        self.memory_fraction = memory_fraction
        self._warn = WarnOnce()
        self._conf_state = apply_allocator_conf(allocator_conf, self._warn) if allocator_conf else AllocatorState()
        self._fraction_state = AllocatorState()

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        try:
            if self.allocator_conf and self._conf_state.how in ("skipped",):
                self._conf_state = apply_allocator_conf(self.allocator_conf, self._warn)
        except Exception as err:  # never crash training over allocator settings
            self._warn.warn("conf_failed", f"`allocator_conf` could not be applied: {err}")
        try:
            self._fraction_state = apply_memory_fraction(self.memory_fraction, trainer_device(trainer), warn=self._warn)
        except Exception as err:  # never crash training over a memory limit
            self._warn.warn("fraction_failed", f"`memory_fraction` could not be applied: {err}")

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._restore_guarded()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._restore_guarded()  # Lightning skips the teardown hooks after an exception

    def _restore_guarded(self) -> None:
        try:
            self.restore()
        except Exception as err:  # a hook never raises: the user's exception may be unwinding
            self._warn.warn("restore_failed", f"AllocatorSettings could not give the allocator settings back: {err}")

    def restore(self) -> None:
        """Give back the environment variable, runtime allocator keys and the memory fraction."""
        restore_allocator_settings(self._fraction_state)
        restore_allocator_settings(self._conf_state)
