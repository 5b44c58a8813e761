"""AllocatorSettings: CUDA caching-allocator settings and a memory fraction for one run, given back at teardown."""

from __future__ import annotations

from typing import TYPE_CHECKING

from typing_extensions import override

from lightning_memopt.functional.allocator import borrow_allocator_conf, borrow_memory_fraction, check_alloc_conf
from lightning_memopt.utilities.checks import check_fraction
from lightning_memopt.utilities.namespaces import Callback
from lightning_memopt.utilities.quiet import note_inactive, report_inactive
from lightning_memopt.utilities.shared_state import Lease
from lightning_memopt.utilities.trainer import trainer_device
from lightning_memopt.utilities.warnings import WarnOnce

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["AllocatorSettings"]


class AllocatorSettings(Callback):
    """Applies allocator settings and a memory fraction for one run, and gives them back at teardown.

    ``MemoryPreset.trainer_kwargs()`` adds it when the preset carries allocator settings or a fraction. Building it
    changes nothing: both are applied at ``setup`` and given back at teardown and when the run stops with an exception
    (an environment variable that was unset is removed again, one that was set gets its exact previous value back).

    How ``allocator_conf`` is applied at ``setup``:

    * CUDA not initialised yet (a CPU run, or CUDA first used after setup): through ``PYTORCH_CUDA_ALLOC_CONF`` (or
      ``PYTORCH_ALLOC_CONF`` where the user set that one), which torch reads when CUDA initialises. Keys the user
      exported win over ``allocator_conf``.
    * CUDA initialised (the usual case on a GPU: Lightning's accelerator selects the device, which initialises CUDA,
      before any callback's ``setup``): through torch's runtime allocator settings, for the allocations that follow.
      ``expandable_segments`` takes effect for segments created afterwards (seen turning on and back off on an H200,
      torch 2.11); ``max_split_size_mb``, ``max_non_split_rounding_mb``, ``garbage_collection_threshold``,
      ``roundup_power2_divisions`` and the pinned-memory keys are accepted at runtime. ``backend`` is chosen when
      torch is imported: one other than the process started with is refused when this callback is built (a
      ``ValueError`` with the ``export`` line), and a key refused at runtime gets one warning with the ``export``
      line, the way for any key that must hold from the first allocation. At teardown ``expandable_segments``,
      ``release_lock_on_cudamalloc`` and ``pinned_use_cuda_host_register`` are turned back to torch's default
      (``False``); torch cannot report the other keys' values from before, so those stay for the process.

    Both settings belong to the process. Runs that overlap (Trainers fitting in threads) share them through
    :func:`~lightning_memopt.utilities.shared_state.borrow`: the first run in applies its values, the last one out
    gives back what was there before the first. A run that overlaps with a different ``allocator_conf`` (or another
    fraction on the same device) runs with the first run's value and gets one warning saying so.

    Args:
        allocator_conf: e.g. ``"expandable_segments:True"``; ``None`` leaves the allocator alone.
        memory_fraction: fraction of the device memory this process may use, in (0, 1]; set at ``setup`` on the
            device the Trainer trains on (CUDA only).

    On a Trainer that does not train on CUDA (a CPU run) the memory fraction is not set, and the callback is named in
    the one line per fit that lists the callbacks with nothing to do; ``allocator_conf`` still goes through the
    environment variable for the run (it only matters to CUDA, should the run initialise it).

    Outputs: the allocator settings above during the run; nothing is logged.

    Examples:
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
        check_alloc_conf(allocator_conf)
        self.allocator_conf = allocator_conf
        self.memory_fraction = check_fraction("memory_fraction", memory_fraction, allow_none=True)
        self._warn = WarnOnce()
        self._conf: Lease | None = None
        self._fraction: Lease | None = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        device = trainer_device(trainer)
        if device.type != "cuda" and stage == "fit":
            note_inactive(trainer, "AllocatorSettings", "CUDA only")
        try:
            if self.allocator_conf and self._conf is None:
                self._conf = borrow_allocator_conf(self.allocator_conf, self._warn)
        except Exception as err:  # never crash training over allocator settings
            self._warn.warn("conf_failed", f"`allocator_conf` could not be applied: {err}")
        try:
            if self._fraction is None and device.type == "cuda":
                self._fraction = borrow_memory_fraction(self.memory_fraction, device, self._warn)
        except Exception as err:  # never crash training over a memory limit
            self._warn.warn("fraction_failed", f"`memory_fraction` could not be applied: {err}")

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        report_inactive(trainer)

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
        """Stop borrowing the settings; the last run out gives back the environment variable, the runtime allocator
        keys and the memory fraction. Raises what giving them back raised (after giving back the rest)."""
        fraction, conf, self._fraction, self._conf = self._fraction, self._conf, None, None
        try:
            if fraction is not None:
                fraction.release()
        finally:
            if conf is not None:
                conf.release()
