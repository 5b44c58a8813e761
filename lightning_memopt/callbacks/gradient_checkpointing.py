"""GradientCheckpointing: turn activation checkpointing on for chosen layers (or the Hugging Face switch) at setup."""

from __future__ import annotations

import fnmatch
import functools
import inspect
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from typing_extensions import override

from lightning_memopt.utilities.checks import check_bool
from lightning_memopt.utilities.namespaces import Callback
from lightning_memopt.utilities.warnings import WarnOnce, log

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["GradientCheckpointing"]

#: Block classes wrapped when no ``modules`` are given and the model has no ``gradient_checkpointing_enable``.
DEFAULT_BLOCKS: tuple[type[nn.Module], ...] = (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)


class _CheckpointedForward:
    """Instance-level ``forward`` that recomputes the module's forward in backward (non-reentrant).

    A plain object (not a closure) so that ``copy.deepcopy`` and pickling of the module carry it along correctly.
    Outside training or without grad it calls the original forward directly.
    """

    def __init__(self, module: nn.Module, original: Any = None) -> None:
        self.module = module
        self.original = original  # an instance-level forward that was there before, if any

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.original is not None:
            return self.original(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.module.training and torch.is_grad_enabled():
            # The block's keyword arguments are bound here, never handed to `checkpoint`: it would consume the ones
            # that share a name with its own options (`debug`, `context_fn`, `determinism_check`, ...).
            forward = functools.partial(self._forward, **kwargs) if kwargs else self._forward
            return checkpoint(forward, *args, use_reentrant=False)
        return self._forward(*args, **kwargs)


def is_checkpointed(module: nn.Module) -> bool:
    """Whether ``module``'s forward is wrapped by :class:`GradientCheckpointing` (and not unwrapped since)."""
    return isinstance(module.__dict__.get("forward"), _CheckpointedForward)


class GradientCheckpointing(Callback):
    """Turns activation (gradient) checkpointing on at setup and off again at teardown.

    Activations inside each wrapped block are not kept for backward but recomputed from the block's input, trading
    roughly one extra forward pass for much less activation memory. At ``setup``:

    1. if the LightningModule, or a submodule, has ``gradient_checkpointing_enable()`` (Hugging Face
       ``PreTrainedModel``), that is called (non-reentrant where the model accepts
       ``gradient_checkpointing_kwargs``); models that say ``supports_gradient_checkpointing = False`` are skipped;
    2. otherwise every submodule that matches ``modules`` is wrapped with non-reentrant
       ``torch.utils.checkpoint.checkpoint``. Entries of ``modules`` are classes (``nn.TransformerEncoderLayer``),
       class names (``"TransformerEncoderLayer"``, handy in YAML) or ``fnmatch`` patterns over qualified submodule
       names (``"encoder.layers.*"``). Without ``modules``, PyTorch's transformer encoder/decoder layers are wrapped.

    Wrapping replaces the instance's ``forward`` only (parameter names and ``state_dict`` keys do not change) and
    is active only in training mode with grad enabled; validation runs the plain forward. RNG state is preserved,
    so dropout masks in the recomputation match the first pass.

    Everything changed at setup is given back at teardown and when fit stops with an exception: the original forwards
    return, and a model switch that this callback turned on is turned off again (a switch that was already on,
    according to the model's ``is_gradient_checkpointing``, is left on). Blocks that are already checkpointed by
    another :meth:`wrap` are counted as checkpointed and left to whoever wrapped them.

    Args:
        modules: which submodules to checkpoint (see above); ``None`` for the defaults.
        use_model_switch: call the model's own ``gradient_checkpointing_enable()`` when it has one.

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
        self.wrapped_names: list[str] = []
        self.already_wrapped_names: list[str] = []
        self._wrapped: list[tuple[nn.Module, Any]] = []
        self._switched: list[nn.Module] = []
        self._warn = WarnOnce()

    # ---------------------------------------------------------------------------------------------- matching
    def _matches(self, name: str, module: nn.Module) -> bool:
        if self.modules is None:
            return isinstance(module, DEFAULT_BLOCKS)
        for entry in self.modules:
            if isinstance(entry, type):
                if isinstance(module, entry):
                    return True
            elif entry == type(module).__name__ or (name and fnmatch.fnmatchcase(name, entry)):
                return True
        return False

    def wrap(self, model: nn.Module) -> list[str]:
        """Wrap the matching submodules of ``model`` (outermost match only); returns their qualified names.

        Submodules that are checkpointed already (wrapped before and not unwrapped) are skipped with everything
        inside them; they are listed in ``already_wrapped_names``.
        """
        covered: list[str] = []
        skipped: list[str] = []
        for name, module in model.named_modules():
            if module is model or any(name.startswith(prefix + ".") for prefix in covered + skipped):
                continue
            if is_checkpointed(module):
                skipped.append(name)
                continue
            if not self._matches(name, module):
                continue
            original = module.__dict__.get("forward")
            module.forward = _CheckpointedForward(module, original)  # type: ignore[method-assign]
            self._wrapped.append((module, original))
            covered.append(name)
        self.wrapped_names.extend(covered)
        self.already_wrapped_names = skipped
        return covered

    def unwrap(self) -> None:
        """Restore the original forwards of everything :meth:`wrap` changed."""
        for module, original in reversed(self._wrapped):
            if original is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = original  # type: ignore[method-assign]
        self._wrapped.clear()
        self.wrapped_names.clear()
        self.already_wrapped_names = []

    @staticmethod
    def _find_switches(model: nn.Module) -> list[nn.Module]:
        """The outermost submodules (or the model itself) that have ``gradient_checkpointing_enable()``."""
        found: list[nn.Module] = []
        prefixes: list[str] = []
        for name, module in model.named_modules():
            if any(p == "" or name.startswith(p + ".") for p in prefixes):
                continue
            if not callable(getattr(module, "gradient_checkpointing_enable", None)):
                continue
            if getattr(module, "supports_gradient_checkpointing", True) is False:
                continue  # a Hugging Face model whose switch would raise: its blocks are wrapped instead
            found.append(module)
            prefixes.append(name)
        return found

    def _enable_switch(self, module: nn.Module) -> None:
        enable = module.gradient_checkpointing_enable  # type: ignore[operator]
        try:
            params = inspect.signature(enable).parameters
        except (TypeError, ValueError):
            params = {}  # type: ignore[assignment]
        if "gradient_checkpointing_kwargs" in params:
            enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            enable()
        self._switched.append(module)

    # ---------------------------------------------------------------------------------------------- hooks
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or self._wrapped or self._switched:
            return
        if self.use_model_switch:
            switches = self._find_switches(pl_module)
            if switches:
                for module in switches:
                    already = bool(getattr(module, "is_gradient_checkpointing", False))
                    if not already:
                        self._enable_switch(module)
                log.info("GradientCheckpointing: enabled the model's own switch on %d module(s).", len(switches))
                return
        names = self.wrap(pl_module)
        if not names and self.already_wrapped_names:
            log.info(
                "GradientCheckpointing: %d module(s) were checkpointed already and are left as they are: %s",
                len(self.already_wrapped_names),
                ", ".join(self.already_wrapped_names),
            )
        elif not names:
            wanted = "PyTorch transformer layers" if self.modules is None else repr(self.modules)
            self._warn.warn(
                "nothing",
                f"GradientCheckpointing found no submodule matching {wanted} in {type(pl_module).__name__};"
                " nothing is checkpointed. Pass `modules=` with your block classes or name patterns.",
            )
        else:
            log.info("GradientCheckpointing: wrapped %d module(s): %s", len(names), ", ".join(names))

    def restore(self) -> None:
        """Give back everything setup changed: the original forwards, and model switches turned on by this callback."""
        self.unwrap()
        switched, self._switched = self._switched, []
        for module in switched:
            disable = getattr(module, "gradient_checkpointing_disable", None)
            if callable(disable):
                disable()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self.restore()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # Lightning skips the teardown hooks after an exception: without this, a retry in the same process would find
        # the blocks wrapped already.
        self.restore()
