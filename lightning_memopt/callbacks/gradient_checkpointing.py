"""GradientCheckpointing: turn activation checkpointing on for chosen layers (or the Hugging Face switch) at setup."""

from __future__ import annotations

import fnmatch
import functools
import inspect
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from typing_extensions import override

from lightning_memopt.utilities.checks import check_bool
from lightning_memopt.utilities.namespaces import Callback, rank_zero_info
from lightning_memopt.utilities.warnings import WarnOnce

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["GradientCheckpointing"]

#: Block classes wrapped when no ``modules`` are given and the model has no checkpointing switch of its own.
DEFAULT_BLOCKS: tuple[type[nn.Module], ...] = (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)


class _SwitchAPI(NamedTuple):
    """A model's own checkpointing switch: the names of its methods, its property and its keyword argument."""

    enable: str
    disable: str
    is_on: str
    kwargs: str


#: The switch APIs, newest first: Hugging Face transformers 5 renamed ``gradient_checkpointing_*`` to
#: ``activation_checkpointing_*`` (the old names still work there, with a FutureWarning on every call).
SWITCH_APIS = (
    _SwitchAPI(
        "activation_checkpointing_enable",
        "activation_checkpointing_disable",
        "is_activation_checkpointing",
        "activation_checkpointing_kwargs",
    ),
    _SwitchAPI(
        "gradient_checkpointing_enable",
        "gradient_checkpointing_disable",
        "is_gradient_checkpointing",
        "gradient_checkpointing_kwargs",
    ),
)


def switch_api(module: nn.Module) -> _SwitchAPI | None:
    """The newest checkpointing switch ``module`` has, or ``None``; models that say they do not support it: ``None``.

    Only methods are looked up (``is_*`` properties, which warn on old names, are not read here).
    """
    if getattr(type(module), "supports_gradient_checkpointing", True) is False:
        return None  # a Hugging Face model whose switch would raise: its blocks are wrapped instead
    for api in SWITCH_APIS:
        if callable(getattr(module, api.enable, None)):
            return api
    return None


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
    another :meth:`wrap` are counted as checkpointed and left to whoever wrapped them.

    Args:
        modules: which submodules to checkpoint (see above); ``None`` for the defaults.
        use_model_switch: without ``modules``, turn on the model's own switch when it has one.

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
        self._switched: list[tuple[nn.Module, _SwitchAPI]] = []
        self._caches: list[Any] = []  # configs whose use_cache this callback turned off
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
    def _find_switches(model: nn.Module) -> list[tuple[str, nn.Module, _SwitchAPI]]:
        """The outermost submodules (or the model itself) with a checkpointing switch: ``(name, module, api)``."""
        found: list[tuple[str, nn.Module, _SwitchAPI]] = []
        prefixes: list[str] = []
        for name, module in model.named_modules():
            if any(p == "" or name.startswith(p + ".") for p in prefixes):
                continue
            api = switch_api(module)
            if api is None:
                continue
            found.append((name, module, api))
            prefixes.append(name)
        return found

    def _enable_switch(self, module: nn.Module, api: _SwitchAPI) -> None:
        enable = getattr(module, api.enable)
        try:
            params = inspect.signature(enable).parameters
        except (TypeError, ValueError):
            params = {}  # type: ignore[assignment]
        if api.kwargs in params:
            enable(**{api.kwargs: {"use_reentrant": False}})
        else:
            enable()
        self._switched.append((module, api))

    def _turn_off_caches(self, model: nn.Module) -> list[str]:
        """``config.use_cache = False`` on every submodule's config that has it on; returns where (for the message)."""
        where = []
        seen: set[int] = set()
        for name, module in model.named_modules():
            config = getattr(module, "config", None)
            if config is None or id(config) in seen or getattr(config, "use_cache", None) is not True:
                continue
            seen.add(id(config))
            config.use_cache = False
            self._caches.append(config)
            where.append(name or type(module).__name__)
        return where

    # ---------------------------------------------------------------------------------------------- hooks
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or self._wrapped or self._switched:
            return
        switches = self._find_switches(pl_module) if self.use_model_switch else []
        if switches and self.modules is None:
            turned, already = [], []
            for name, module, api in switches:
                label = f"{name or type(module).__name__}.{api.enable}()"
                if bool(getattr(module, api.is_on, False)):
                    already.append(label)
                else:
                    self._enable_switch(module, api)
                    turned.append(label)
            rank_zero_info(
                "GradientCheckpointing: the model's own switch"
                + (f" turned on: {', '.join(turned)}" if turned else "")
                + (f"{'; ' if turned else ' '}on already: {', '.join(already)}" if already else "")
                + " (pass `modules=` to wrap blocks yourself instead)."
            )
            return
        names = self.wrap(pl_module)
        caches = self._turn_off_caches(pl_module) if names else []
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
            own = ", ".join(f"{n or type(m).__name__}.{a.enable}()" for n, m, a in switches)
            over = f", instead of the model's own switch ({own})" if switches else ""
            cache = (
                f"; `config.use_cache=False` for the fit on {', '.join(caches)} (a cache filled inside a"
                " checkpointed block breaks its recomputation)"
                if caches
                else ""
            )
            rank_zero_info(
                f"GradientCheckpointing: wrapped {len(names)} module(s) by {why}{over}: {', '.join(names)}{cache}."
            )

    def restore(self) -> None:
        """Give back everything setup changed: the original forwards, and model switches turned on by this callback."""
        self.unwrap()
        caches, self._caches = self._caches, []
        for config in caches:
            config.use_cache = True
        switched, self._switched = self._switched, []
        for module, api in switched:
            disable = getattr(module, api.disable, None)
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
