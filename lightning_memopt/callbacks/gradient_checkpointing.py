"""GradientCheckpointing: turn activation checkpointing on for chosen layers (or the Hugging Face switch) at setup."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from torch import nn
from typing_extensions import override

from lightning_memopt.functional.checkpointing import (
    DEFAULT_BLOCKS,
    SWITCH_APIS,
    CheckpointingHandle,
    _CheckpointedForward,
    _SwitchAPI,
    enable_switch,
    find_switches,
    is_checkpointed,
    switch_api,
    wrap_checkpointing,
    wrap_modules,
)
from lightning_memopt.utilities.checks import check_bool
from lightning_memopt.utilities.namespaces import Callback, rank_zero_info
from lightning_memopt.utilities.warnings import WarnOnce

if TYPE_CHECKING:
    import lightning.pytorch as pl

# The functional names stay importable from here (lightning_memopt.callbacks.oom_reporter, lightning_memopt.planner).
__all__ = [
    "DEFAULT_BLOCKS",
    "SWITCH_APIS",
    "GradientCheckpointing",
    "_CheckpointedForward",
    "is_checkpointed",
    "switch_api",
]


class GradientCheckpointing(Callback):
    """Turns activation (gradient) checkpointing on at setup and off again at teardown.

    Activations inside each wrapped block are not kept for backward but recomputed from the block's input, trading
    roughly one extra forward pass for much less activation memory. At ``setup``:

    1. with ``modules`` given, every submodule that matches is wrapped with non-reentrant
       ``torch.utils.checkpoint.checkpoint``, also where the model has a switch of its own: your choice wins. Entries
       of ``modules`` are classes (``nn.TransformerEncoderLayer``), class names (``"TransformerEncoderLayer"``,
       ``"T5Block"``, handy in YAML) or ``fnmatch`` patterns over qualified submodule names (``"encoder.layers.*"``).
       Models whose ``config.use_cache`` is on (Hugging Face decoders) get ``use_cache=False`` for the fit: a cache
       filled inside a checkpointed block makes its recomputation differ (``CheckpointError``). It is restored at
       teardown;
    2. without ``modules``, if the LightningModule or a submodule has a switch of its own (Hugging Face
       ``PreTrainedModel``: ``activation_checkpointing_enable()`` in transformers 5, ``gradient_checkpointing_enable()``
       before; the newest name is used, so transformers 5 does not warn), that is turned on, non-reentrant; models
       that say ``supports_gradient_checkpointing = False`` are skipped;
    3. otherwise PyTorch's transformer encoder/decoder layers are wrapped.

    The path taken is said at setup (rank zero, at Lightning's default log level): what was wrapped, or which
    switch was turned on.

    Wrapping replaces the instance's ``forward`` only (parameter names and ``state_dict`` keys do not change) and
    is active only in training mode with grad enabled; validation runs the plain forward. RNG state is preserved,
    so dropout masks in the recomputation match the first pass.

    Everything changed at setup is given back at teardown and when fit stops with an exception: the original forwards
    return, and a model switch that this callback turned on is turned off again (a switch that was already on,
    according to the model's ``is_gradient_checkpointing``, is left on). Blocks that are already checkpointed by
    another :meth:`wrap` are counted as checkpointed and left to whoever wrapped them. Without a Trainer, the same is
    :func:`~lightning_memopt.functional.checkpointing.wrap_checkpointing`: it returns a handle whose ``restore()``
    gives everything back.

    Args:
        modules: which submodules to checkpoint (see above); ``None`` for the defaults.
        use_model_switch: without ``modules``, turn on the model's own switch when it has one.

    Logged metrics: none. The path taken is printed at setup; a warning says when nothing matched.

    Device requirements: any.

    Example:
        >>> from torch import nn
        >>> cb = GradientCheckpointing(modules=[nn.TransformerEncoderLayer, "decoder.*"])
        >>> layer = nn.TransformerEncoderLayer(8, 2, 16)
        >>> model = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        >>> cb.wrap(model)
        ['layers.0', 'layers.1']
        >>> cb.unwrap(); cb.wrapped_names
        []
    """

    def __init__(self, modules: Sequence[type[nn.Module] | str] | None = None, use_model_switch: bool = True) -> None:
        check_bool("use_model_switch", use_model_switch)
        if modules is not None:
            if isinstance(modules, (str, type)):
                modules = [modules]
            if not isinstance(modules, Iterable):
                raise ValueError(
                    f"`modules` must be a list of nn.Module classes, class names or name patterns, or None, got"
                    f" {modules!r}. Example: `modules=[nn.TransformerEncoderLayer, 'encoder.layers.*']`."
                )
            modules = list(modules)
            if not modules:
                raise ValueError(
                    "`modules` must name at least one nn.Module class, class name or name pattern, got []."
                    " Pass `modules=None` for the default PyTorch transformer layers, or e.g."
                    " `modules=[nn.TransformerEncoderLayer, 'encoder.layers.*']`."
                )
            for entry in modules:
                if not (isinstance(entry, str) and entry) and not (
                    isinstance(entry, type) and issubclass(entry, nn.Module)
                ):
                    raise ValueError(
                        f"`modules` entries must be nn.Module classes, class names or name patterns, got {entry!r}."
                        " Example: `modules=[nn.TransformerEncoderLayer, 'encoder.layers.*']`."
                    )
        self.modules = list(modules) if modules is not None else None
        self.use_model_switch = use_model_switch
        #: Qualified names of the submodules wrapped by this callback (setup or :meth:`wrap`), until given back.
        self.wrapped_names: list[str] = []
        #: Submodules that the last wrap found checkpointed already (left to whoever wrapped them).
        self.already_wrapped_names: list[str] = []
        self._handles: list[CheckpointingHandle] = []
        self._warn = WarnOnce()

    def wrap(self, model: nn.Module) -> list[str]:
        """Wrap the matching submodules of ``model`` (outermost match only); returns their qualified names.

        Submodules that are checkpointed already (wrapped before and not unwrapped) are skipped with everything
        inside them; they are listed in ``already_wrapped_names``.
        """
        handle = wrap_modules(model, self.modules)
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

    # lightning_memopt.planner prepares a model as setup does, through these two
    _find_switches = staticmethod(find_switches)

    def _enable_switch(self, module: nn.Module, api: _SwitchAPI) -> None:
        enable_switch(module, api)

    # ---------------------------------------------------------------------------------------------- hooks
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or any(h._wrapped or h._switched for h in self._handles):
            return
        handle = wrap_checkpointing(pl_module, self.modules, self.use_model_switch)
        self._handles.append(handle)
        if handle.used_switch:
            turned, already = handle.turned_on, handle.already_on
            rank_zero_info(
                "GradientCheckpointing: the model's own switch"
                + (f" turned on: {', '.join(turned)}" if turned else "")
                + (f"{'; ' if turned else ' '}on already: {', '.join(already)}" if already else "")
                + " (pass `modules=` to wrap blocks yourself instead)."
            )
            return
        names = handle.wrapped_names
        self.wrapped_names.extend(names)
        self.already_wrapped_names = list(handle.already_wrapped_names)
        if not names and self.already_wrapped_names:
            rank_zero_info(
                f"GradientCheckpointing: {len(self.already_wrapped_names)} module(s) were checkpointed already and are"
                f" left as they are: {', '.join(self.already_wrapped_names)}"
            )
        elif not names:
            wanted = "PyTorch transformer layers" if self.modules is None else repr(self.modules)
            self._warn.warn(
                "nothing",
                f"GradientCheckpointing found no submodule matching {wanted} in {type(pl_module).__name__};"
                " nothing is checkpointed. Pass `modules=` with your block classes or name patterns.",
            )
        else:
            why = f"`modules={self.modules!r}`" if self.modules is not None else "PyTorch transformer layers"
            own = ", ".join(f"{n or type(m).__name__}.{a.enable}()" for n, m, a in handle.switches)
            over = f", instead of the model's own switch ({own})" if handle.switches else ""
            cache = (
                f"; `config.use_cache=False` for the fit on {', '.join(handle.caches)} (a cache filled inside a"
                " checkpointed block breaks its recomputation)"
                if handle.caches
                else ""
            )
            rank_zero_info(
                f"GradientCheckpointing: wrapped {len(names)} module(s) by {why}{over}: {', '.join(names)}{cache}."
            )

    def restore(self) -> None:
        """Give back everything setup changed: the original forwards, and model switches turned on by this callback."""
        handles, self._handles = self._handles, []
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
