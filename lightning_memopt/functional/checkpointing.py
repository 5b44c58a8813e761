"""Activation checkpointing without a Trainer: wrap blocks (or turn on a model's own switch) and give it all back.

:func:`wrap_checkpointing` is what :class:`~lightning_memopt.callbacks.GradientCheckpointing` does at setup; the
:class:`CheckpointingHandle` it returns restores everything at teardown. Wrapping replaces only the instance's
``forward`` by a :class:`_CheckpointedForward` (non-reentrant ``torch.utils.checkpoint.checkpoint``, active in training
mode with grad enabled), so parameter names and ``state_dict`` keys do not change.
"""

from __future__ import annotations

import fnmatch
import functools
import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = [
    "DEFAULT_BLOCKS",
    "SWITCH_APIS",
    "CheckpointingHandle",
    "enable_switch",
    "find_switches",
    "is_checkpointed",
    "module_matches",
    "switch_api",
    "wrap_checkpointing",
    "wrap_modules",
]

#: Block classes wrapped when no ``checkpoint_modules`` are given and the model has no checkpointing switch of its own.
DEFAULT_BLOCKS: tuple[type[nn.Module], ...] = (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)

#: What ``checkpoint_modules`` holds: ``nn.Module`` classes, class names or ``fnmatch`` patterns over qualified
#: submodule names.
ModuleSpec = Sequence[type[nn.Module] | str]


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
            forward = self._forward
            if kwargs:
                forward = functools.partial(self._forward, **kwargs)
            norms = [m for m in self.module.modules() if _tracks_running_stats(m)]
            if norms:
                forward = _StatsOnce(forward, norms)
            return checkpoint(forward, *args, use_reentrant=False)
        return self._forward(*args, **kwargs)


def _tracks_running_stats(module: nn.Module) -> bool:
    """Whether ``module`` is a norm layer that updates running statistics in a training forward (BatchNorm, ...)."""
    return isinstance(module, nn.modules.batchnorm._NormBase) and module.track_running_stats and module.training


class _StatsOnce:
    """A checkpointed forward whose recomputation in backward leaves the running statistics as the forward left them.

    Without it a checkpointed BatchNorm counts every batch twice (``num_batches_tracked``) and moves its running mean
    and variance twice; in training mode the output uses the batch's statistics, so the recomputed activations do
    not depend on the running ones and putting them back changes nothing else.
    """

    def __init__(self, forward: Any, norms: list[nn.Module]) -> None:
        self.forward, self.norms, self.calls = forward, norms, 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls == 1:
            return self.forward(*args, **kwargs)
        saved = [(buf, buf.clone()) for m in self.norms for buf in m.buffers(recurse=False)]
        try:
            return self.forward(*args, **kwargs)
        finally:
            with torch.no_grad():
                for buf, value in saved:
                    buf.copy_(value)


def is_checkpointed(module: nn.Module) -> bool:
    """Whether ``module``'s forward is wrapped by :func:`wrap_modules` (and not unwrapped since)."""
    return isinstance(module.__dict__.get("forward"), _CheckpointedForward)


def module_matches(name: str, module: nn.Module, checkpoint_modules: ModuleSpec | None) -> bool:
    """Whether the submodule ``name`` matches ``checkpoint_modules`` (``None``: the :data:`DEFAULT_BLOCKS`)."""
    if checkpoint_modules is None:
        return isinstance(module, DEFAULT_BLOCKS)
    for entry in checkpoint_modules:
        if isinstance(entry, type):
            if isinstance(module, entry):
                return True
        elif entry == type(module).__name__ or (name and fnmatch.fnmatchcase(name, entry)):
            return True
    return False


def find_switches(model: nn.Module) -> list[tuple[str, nn.Module, _SwitchAPI]]:
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


def enable_switch(module: nn.Module, api: _SwitchAPI) -> None:
    """Turn ``module``'s own switch on, non-reentrant where the switch takes keyword arguments."""
    enable = getattr(module, api.enable)
    try:
        params: Any = inspect.signature(enable).parameters
    except (TypeError, ValueError):
        params = {}
    if api.kwargs in params:
        enable(**{api.kwargs: {"use_reentrant": False}})
    else:
        enable()


@dataclass
class CheckpointingHandle:
    """What :func:`wrap_checkpointing` (or :func:`wrap_modules`) changed; :meth:`restore` gives it all back.

    Attributes:
        wrapped_names: qualified names of the submodules wrapped (``""`` is the model itself).
        already_wrapped_names: submodules that were checkpointed already and left to whoever wrapped them.
        switches: the model's own switches found: ``(name, module, api)``.
        turned_on / already_on: labels (``"name.method()"``) of switches turned on here / found on already.
        caches: where ``config.use_cache`` was turned off for the fit.
    """

    wrapped_names: list[str] = field(default_factory=list)
    already_wrapped_names: list[str] = field(default_factory=list)
    switches: list[tuple[str, nn.Module, _SwitchAPI]] = field(default_factory=list)
    turned_on: list[str] = field(default_factory=list)
    already_on: list[str] = field(default_factory=list)
    caches: list[str] = field(default_factory=list)
    _wrapped: list[tuple[nn.Module, Any]] = field(default_factory=list, repr=False)
    _switched: list[tuple[nn.Module, _SwitchAPI]] = field(default_factory=list, repr=False)
    _configs: list[Any] = field(default_factory=list, repr=False)

    @property
    def used_switch(self) -> bool:
        """Whether the model's own switch was taken (turned on, or found on already) instead of wrapping."""
        return bool(self.turned_on or self.already_on)

    @property
    def changed(self) -> bool:
        """Whether anything is left to give back."""
        return bool(self._wrapped or self._switched or self._configs)

    def unwrap(self) -> None:
        """Restore the original forwards of everything wrapped."""
        for module, original in reversed(self._wrapped):
            if original is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = original
        self._wrapped.clear()
        self.wrapped_names.clear()
        self.already_wrapped_names = []

    def restore(self) -> None:
        """Give back everything: the original forwards, ``use_cache``, and the switches turned on here."""
        self.unwrap()
        configs, self._configs = self._configs, []
        for config in configs:
            config.use_cache = True
        switched, self._switched = self._switched, []
        for module, api in switched:
            disable = getattr(module, api.disable, None)
            if callable(disable):
                disable()


def wrap_modules(model: nn.Module, checkpoint_modules: ModuleSpec | None = None) -> CheckpointingHandle:
    """Wrap the matching submodules of ``model`` (outermost match only).

    Submodules that are checkpointed already are skipped with everything inside them; those that match are listed
    in ``already_wrapped_names`` (another ``GradientCheckpointing``'s blocks that do not match are not).

    Examples:
        >>> layer = nn.TransformerEncoderLayer(8, 2, 16)
        >>> model = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        >>> handle = wrap_modules(model)
        >>> handle.wrapped_names, is_checkpointed(model.layers[0])
        (['layers.0', 'layers.1'], True)
        >>> handle.restore(); is_checkpointed(model.layers[0])
        False
    """
    handle = CheckpointingHandle()
    covered, skipped = handle.wrapped_names, handle.already_wrapped_names
    inside: list[str] = []  # checkpointed already: nothing inside is wrapped again
    for name, module in model.named_modules():
        if module is model or any(name.startswith(prefix + ".") for prefix in covered + inside):
            continue
        matches = module_matches(name, module, checkpoint_modules)
        if is_checkpointed(module):
            inside.append(name)
            if matches:
                skipped.append(name)
            continue
        if not matches:
            continue
        original = module.__dict__.get("forward")
        module.forward = _CheckpointedForward(module, original)
        handle._wrapped.append((module, original))
        covered.append(name)
    return handle


def _turn_off_caches(model: nn.Module, handle: CheckpointingHandle) -> None:
    """``config.use_cache = False`` on every submodule's config that has it on; recorded in ``handle``."""
    seen: set[int] = set()
    for name, module in model.named_modules():
        config = getattr(module, "config", None)
        if config is None or id(config) in seen or getattr(config, "use_cache", None) is not True:
            continue
        seen.add(id(config))
        config.use_cache = False
        handle._configs.append(config)
        handle.caches.append(name or type(module).__name__)


def wrap_checkpointing(
    model: nn.Module, checkpoint_modules: ModuleSpec | None = None, use_model_switch: bool = True
) -> CheckpointingHandle:
    """Turn activation checkpointing on in ``model``; the returned handle's ``restore()`` turns it off again.

    With ``checkpoint_modules``, the matching submodules are wrapped, also where the model has a switch of its own,
    and configs with ``use_cache`` on get ``use_cache=False`` (a cache filled inside a checkpointed block breaks its
    recomputation). Without ``checkpoint_modules``, the model's own switch is turned on when it has one (and
    ``use_model_switch``); a switch that is on already is left on and not turned off by ``restore``. Otherwise the
    :data:`DEFAULT_BLOCKS` are wrapped.

    Examples:
        >>> layer = nn.TransformerEncoderLayer(8, 2, 16)
        >>> model = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        >>> handle = wrap_checkpointing(model, ["layers.1"])
        >>> handle.wrapped_names, handle.used_switch
        (['layers.1'], False)
        >>> handle.restore()
    """
    switches: list[tuple[str, nn.Module, _SwitchAPI]] = []
    if use_model_switch:
        switches = find_switches(model)
    if switches and checkpoint_modules is None:
        handle = CheckpointingHandle(switches=switches)
        for name, module, api in switches:
            label = f"{name or type(module).__name__}.{api.enable}()"
            if bool(getattr(module, api.is_on, False)):
                handle.already_on.append(label)
            else:
                enable_switch(module, api)
                handle._switched.append((module, api))
                handle.turned_on.append(label)
        return handle
    handle = wrap_modules(model, checkpoint_modules)
    handle.switches = switches
    if handle.wrapped_names:
        _turn_off_caches(model, handle)
    return handle
