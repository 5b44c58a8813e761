"""GradientCheckpointing: turn activation checkpointing on for chosen layers (or the Hugging Face switch) at setup."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from torch import nn
from typing_extensions import override

from lightning_memopt.functional.checkpointing import CheckpointingHandle, wrap_checkpointing, wrap_modules
from lightning_memopt.utilities.checks import check_bool
from lightning_memopt.utilities.formatting import wrap_to_width
from lightning_memopt.utilities.namespaces import Callback, rank_zero_info
from lightning_memopt.utilities.warnings import WarnOnce

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["GradientCheckpointing"]

_EXAMPLE = "Example: `checkpoint_modules=[nn.TransformerEncoderLayer, 'encoder.layers.*']`."


def _checked_modules(modules: Any) -> list[type[nn.Module] | str] | None:
    """``checkpoint_modules`` as a list (one class or name becomes a list of one); a bad value raises ``ValueError``."""
    if modules is None:
        return None
    if isinstance(modules, (str, type)):
        modules = [modules]
    if not isinstance(modules, Iterable):
        raise ValueError(
            "`checkpoint_modules` must be a list of nn.Module classes, class names or name patterns, or None, got"
            f" {modules!r}. {_EXAMPLE}"
        )
    modules = list(modules)
    if not modules:
        raise ValueError(
            "`checkpoint_modules` must name at least one nn.Module class, class name or name pattern, got []. Pass"
            f" `checkpoint_modules=None` for the default PyTorch transformer layers. {_EXAMPLE}"
        )
    for entry in modules:
        if not (isinstance(entry, str) and entry) and not (isinstance(entry, type) and issubclass(entry, nn.Module)):
            raise ValueError(
                "`checkpoint_modules` entries must be nn.Module classes, class names or name patterns, got"
                f" {entry!r}. {_EXAMPLE}"
            )
    return modules


def _switch_summary(turned: list[str], already: list[str]) -> str:
    """What setup did through the model's own switches: those it turned on, and those that were on already."""
    summary = "GradientCheckpointing: the model's own switch"
    if turned:
        summary += f" turned on: {', '.join(turned)}"
    if already:
        separator = "; " if turned else " "
        summary += f"{separator}on already: {', '.join(already)}"
    return summary + " (pass `checkpoint_modules=` to wrap blocks yourself instead)."


class GradientCheckpointing(Callback):
    """Turns activation (gradient) checkpointing on at setup and off again at teardown.

    Activations inside each checkpointed block are recomputed in backward instead of kept, for roughly one extra
    forward pass. At setup it wraps the submodules named by ``checkpoint_modules``; without them it turns on the
    model's own switch (Hugging Face ``activation_checkpointing_enable()`` / ``gradient_checkpointing_enable()``) when
    there is one, else it wraps PyTorch's transformer encoder and decoder layers. Everything it changed is given back
    at teardown and when fit stops with an exception.

    Args:
        checkpoint_modules: Which submodules to wrap: ``nn.Module`` classes, class names (``"T5Block"``) or
            ``fnmatch`` patterns over qualified submodule names (``"encoder.layers.*"``); ``None`` (default): the
            model's switch or the default layers.
        use_model_switch: Without ``checkpoint_modules``, turn on the model's own switch when it has one (default
            ``True``).
        verbose: Print at setup (rank zero) what was wrapped or which switch was turned on (default ``False``).

    Logs: no metrics. A warning says when nothing matched.

    Sharded training (FSDP2 under ``ModelParallelStrategy``): Lightning calls this ``setup`` before
    ``configure_model``, so the blocks are wrapped before ``fully_shard``; the wrapper replaces only the instance's
    ``forward``, so it runs inside FSDP's hooks (gathered parameters, recomputation in backward) in either order.
    A model that builds its blocks in ``configure_model`` has nothing to match at setup: they are wrapped at fit
    start instead (after ``fully_shard``), and the warning about no match waits until then.

    Examples:
        >>> from torch import nn
        >>> cb = GradientCheckpointing(checkpoint_modules=[nn.TransformerEncoderLayer, "decoder.*"])
        >>> layer = nn.TransformerEncoderLayer(8, 2, 16)
        >>> model = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        >>> cb.wrap(model)
        ['layers.0', 'layers.1']
        >>> cb.unwrap(); cb.wrapped_names
        []

    More: docs/memory-callbacks.md
    """

    def __init__(
        self,
        checkpoint_modules: Sequence[type[nn.Module] | str] | None = None,
        use_model_switch: bool = True,
        verbose: bool = False,
    ) -> None:
        check_bool("use_model_switch", use_model_switch)
        check_bool("verbose", verbose)
        self.checkpoint_modules = _checked_modules(checkpoint_modules)
        self.use_model_switch = use_model_switch
        self.verbose = verbose
        #: Qualified names of the submodules wrapped by this callback (setup or :meth:`wrap`), until given back.
        self.wrapped_names: list[str] = []
        #: Submodules that the last wrap found checkpointed already (left to whoever wrapped them).
        self.already_wrapped_names: list[str] = []
        self._handles: list[CheckpointingHandle] = []
        self._pending = False  # nothing matched at setup: look again at fit start, after `configure_model`
        self._warn = WarnOnce()

    def wrap(self, model: nn.Module) -> list[str]:
        """Wrap the matching submodules of ``model`` (outermost match only); returns their qualified names.

        Submodules that are checkpointed already (wrapped before and not unwrapped) are skipped with everything
        inside them; they are listed in ``already_wrapped_names``.
        """
        handle = wrap_modules(model, self.checkpoint_modules)
        self._handles.append(handle)
        self.wrapped_names.extend(handle.wrapped_names)
        self.already_wrapped_names = list(handle.already_wrapped_names)
        return list(handle.wrapped_names)

    def unwrap(self) -> None:
        """Restore the original forwards of everything :meth:`wrap` changed."""
        for handle in reversed(self._handles):
            handle.unwrap()
        self.wrapped_names.clear()
        self.already_wrapped_names = []

    # ---------------------------------------------------------------------------------------------- hooks
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or any(h._wrapped or h._switched for h in self._handles):
            return
        self._apply(pl_module, last_look=False)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._pending:
            self._pending = False
            self._apply(pl_module, last_look=True)

    def _apply(self, pl_module: pl.LightningModule, last_look: bool) -> None:
        """Wrap (or switch on) what matches; when nothing does before ``configure_model`` (a model that builds its
        blocks there, as sharded training does), look again at fit start, and warn only then."""
        handle = wrap_checkpointing(pl_module, self.checkpoint_modules, self.use_model_switch)
        if not (handle.used_switch or handle.wrapped_names or handle.already_wrapped_names or last_look):
            handle.restore()
            self._pending = True
            return
        self._handles.append(handle)
        if not handle.used_switch:
            self.wrapped_names.extend(handle.wrapped_names)
            self.already_wrapped_names = list(handle.already_wrapped_names)
        if not handle.used_switch and not handle.wrapped_names and not handle.already_wrapped_names:
            wanted = "PyTorch transformer layers" if self.checkpoint_modules is None else repr(self.checkpoint_modules)
            self._warn.warn(
                "nothing",
                f"GradientCheckpointing found no submodule matching {wanted} in {type(pl_module).__name__};"
                " nothing is checkpointed. Pass `checkpoint_modules=` with your block classes or name patterns.",
            )
        elif self.verbose:
            rank_zero_info(wrap_to_width(self._summary(handle)))

    def _summary(self, handle: CheckpointingHandle) -> str:
        """What setup did, in one message: the switch turned on, or the modules wrapped (and why those)."""
        if handle.used_switch:
            return _switch_summary(handle.turned_on, handle.already_on)
        names = handle.wrapped_names
        if not names:
            return (
                f"GradientCheckpointing: {len(self.already_wrapped_names)} module(s) were checkpointed already and"
                f" are left as they are: {', '.join(self.already_wrapped_names)}"
            )
        if self.checkpoint_modules is not None:
            why = f"`checkpoint_modules={self.checkpoint_modules!r}`"
        else:
            why = "PyTorch transformer layers"
        own = ", ".join(f"{n or type(m).__name__}.{a.enable}()" for n, m, a in handle.switches)
        over = f", instead of the model's own switch ({own})" if handle.switches else ""
        cache = ""
        if handle.caches:
            cache = (
                f"; `config.use_cache=False` for the fit on {', '.join(handle.caches)} (a cache filled inside a"
                " checkpointed block breaks its recomputation)"
            )
        return f"GradientCheckpointing: wrapped {len(names)} module(s) by {why}{over}: {', '.join(names)}{cache}."

    def restore(self) -> None:
        """Give back everything setup changed: the original forwards, and model switches turned on by this callback."""
        handles, self._handles = self._handles, []
        self._pending = False
        for handle in reversed(handles):
            handle.restore()
        self.wrapped_names.clear()
        self.already_wrapped_names = []

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self.restore()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # Lightning skips the teardown hooks after an exception: without this, a retry in the same process would find
        # the blocks wrapped already.
        self.restore()
