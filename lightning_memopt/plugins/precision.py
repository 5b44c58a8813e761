"""MemoryPrecision: Lightning's own precision plugin for the precision chosen on the training device, plus TF32 and
exact accumulation.

Lightning's Trainer builds one plugin class per precision (``MixedPrecision``, ``HalfPrecision``, ``Precision``, ...).
``MemoryPrecision(...)`` (or a subclass of it) returns, from ``__new__``, an instance of a class built from the class
called and Lightning's class for the precision chosen on the ``device`` argument, and ``__init__`` runs Lightning's
``__init__`` with the arguments Lightning's Trainer would pass. Everything else (autocast, the GradScaler, half
inputs, clipping, the scaler's checkpoint state) is Lightning's code, not a copy; ``MemoryPrecision`` adds only the
choice, TF32, the short-window rescale and the checks. At setup the choice is confirmed on the Trainer's device and
namespace; only where those differ from what was built does the plugin become the class for them.
"""

from __future__ import annotations

import abc
import contextlib
import functools
import importlib
import inspect
import math
import textwrap
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor
from torch.nn import Module
from typing_extensions import Self, override

from lightning_memopt.functional.precision import (
    UNSUPPORTED_STRATEGIES,
    PrecisionChoice,
    PrecisionInput,
    checked_scaler_state,
    choose_precision,
    fsdp2_policy,
    has_own_precision,
    normalize_precision,
    own_precision_strategy,
)
from lightning_memopt.utilities.checks import check_bool, check_choice
from lightning_memopt.utilities.formatting import WIDTH, wrap_to_width
from lightning_memopt.utilities.namespaces import NAMESPACES, Precision, classes, namespace_of, rank_zero_info
from lightning_memopt.utilities.quiet import note_inactive
from lightning_memopt.utilities.shared_state import Lease, Restore, borrow
from lightning_memopt.utilities.warnings import WarnOnce

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["MemoryPrecision", "UNSUPPORTED_STRATEGIES", "has_own_precision"]

#: How FSDP2 owns precision instead (``ModelParallelStrategy``): one of the two casts, never both.
_FSDP2_HINT = (
    " With `fully_shard` in `configure_model`, FSDP can own it instead: keep `precision='32-true'` and pass"
    f" `mp_policy={fsdp2_policy('bf16-mixed')}` to `fully_shard`; one of the two, not both (both cast twice)."
)

_MATMUL_PRECISIONS = ("highest", "high", "medium")

#: Backends whose ``matmul.fp32_precision`` ``torch.set_float32_matmul_precision`` also writes (torch >= 2.9).
_MATMUL_BACKENDS = ("cuda", "mkldnn")


def _matmul_backend(name: str) -> Any:
    return getattr(getattr(torch.backends, name, None), "matmul", None)


def _read_matmul_state() -> dict[str, str] | None:
    """The float32 matmul precision and what it wrote into each backend; ``None`` when the legacy getter raises.

    ``torch.set_float32_matmul_precision`` also writes ``torch.backends.{cuda,mkldnn}.matmul.fp32_precision``
    (``"none"`` before the first call, ``"ieee"`` after setting ``"highest"``), so giving back only the legacy value
    would leave those changed.
    """
    try:
        state = {"": torch.get_float32_matmul_precision()}
    except RuntimeError:  # the legacy getter raises once the newer fp32_precision API was used
        return None
    for name in _MATMUL_BACKENDS:
        value = getattr(_matmul_backend(name), "fp32_precision", None)
        if isinstance(value, str):
            state[name] = value
    return state


def _restore_matmul_state(state: dict[str, str]) -> None:
    """Give back what :func:`_read_matmul_state` read. Never raises (it runs while an exception may be unwinding).

    The per-backend values are written back after the legacy setter; they were read together with a working legacy
    getter, so the two APIs agree again afterwards and ``torch.get_float32_matmul_precision()`` keeps working.
    """
    with contextlib.suppress(Exception):
        torch.set_float32_matmul_precision(state[""])
    for name in _MATMUL_BACKENDS:
        if name in state:
            with contextlib.suppress(Exception):
                _matmul_backend(name).fp32_precision = state[name]


def _set_matmul_state(precision: str) -> Restore | None:
    """Set the float32 matmul precision (the first plugin in); ``None`` where the per-backend API is in use."""
    previous = _read_matmul_state()
    if previous is None:
        return None
    torch.set_float32_matmul_precision(precision)
    return functools.partial(_restore_matmul_state, previous)


#: Lightning's plugin class for each precision, as Lightning's Trainer picks it (its accelerator connector).
_LIGHTNING_CLASSES = {
    "32-true": "Precision",
    "16-mixed": "MixedPrecision",
    "bf16-mixed": "MixedPrecision",
    "16-true": "HalfPrecision",
    "bf16-true": "HalfPrecision",
    "64-true": "DoublePrecision",
    "transformer-engine": "TransformerEnginePrecision",
    "transformer-engine-float16": "TransformerEnginePrecision",
}

#: The precisions whose Lightning class is built only at setup: its ``__init__`` needs ``transformer_engine``.
_BUILT_AT_SETUP = ("transformer-engine", "transformer-engine-float16")

#: Lightning's base plugin of the first namespace: what ``MemoryPrecision`` itself already is (32-true).
_BASE_PRECISION = classes("plugins.precision.Precision")[0]


def _lightning_plugin(
    namespace: str, precision: str, device_type: str, scaler: torch.amp.GradScaler | None
) -> tuple[Any, dict[str, Any]]:
    """Lightning's plugin class for ``precision`` in ``namespace`` and the arguments its Trainer builds it with."""
    cls = getattr(importlib.import_module(f"{namespace}.plugins.precision"), _LIGHTNING_CLASSES[precision])
    if precision in ("16-mixed", "bf16-mixed"):
        fp16_scaler = scaler if precision == "16-mixed" else None  # Lightning's MixedPrecision refuses one for bf16
        return cls, {"precision": precision, "device": device_type, "scaler": fp16_scaler}
    if precision in ("16-true", "bf16-true"):
        return cls, {"precision": precision}
    if precision.startswith("transformer-engine"):
        dtype = torch.float16 if precision.endswith("float16") else torch.bfloat16
        keyword = "weights_dtype" if "weights_dtype" in inspect.signature(cls).parameters else "dtype"  # Lightning 2.1
        return cls, {keyword: dtype}
    return cls, {}


def _device_type(device: str | torch.device | None) -> str:
    """The device type ``device`` names; for ``None`` the one ``Trainer(accelerator="auto")`` picks (CUDA or CPU)."""
    if device is None:
        if torch.cuda.is_available():
            return "cuda"
        return "cpu"
    try:
        return torch.device(device).type
    except (RuntimeError, TypeError):
        raise ValueError(
            f"`device` must be a device type such as 'cuda' or 'cpu' (or a `torch.device`), got {device!r}."
            " Pass the accelerator the Trainer trains on, or None for CUDA where available, else CPU."
        ) from None


def _cuda_facts(
    device: torch.device, capability: tuple[int, int] | None, device_name: str | None
) -> tuple[tuple[int, int] | None, str | None]:
    """``capability`` and ``device_name``, read from ``device`` where they are ``None`` (a CUDA device only)."""
    if device.type == "cuda" and torch.cuda.is_available():
        if capability is None:
            major, minor = torch.cuda.get_device_capability(device)
            capability = (major, minor)
        if device_name is None:
            device_name = torch.cuda.get_device_name(device)
    return capability, device_name


def _construction_precision(requested: str, device_type: str, allow_emulated_bf16: bool) -> str:
    """The precision whose Lightning plugin a new ``MemoryPrecision`` is: setup confirms it on the Trainer's device.

    An explicit precision is its own (Transformer Engine's waits for setup: its plugin needs the package); ``"auto"``
    is chosen on ``device_type`` (the current CUDA device's capability). Nothing raises here: a bf16 request on a GPU
    without native bf16 is refused at setup, on the device that trains.
    """
    if requested in _BUILT_AT_SETUP:
        return "32-true"
    if requested != "auto":
        return requested
    capability, device_name = _cuda_facts(torch.device(device_type), None, None)
    return choose_precision(requested, device_type, capability, device_name, allow_emulated_bf16).precision


def _call_arguments(cls: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The arguments of ``cls(*args, **kwargs)`` by name, defaults included (a subclass's ``**kwargs`` unpacked).

    Raises the ``TypeError`` calling ``cls.__init__`` would raise for arguments that do not fit it.
    """
    signature = inspect.signature(cls.__init__)
    bound = signature.bind(None, *args, **kwargs)
    bound.apply_defaults()
    found = dict(bound.arguments)
    for name, parameter in signature.parameters.items():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            found.update(found.pop(name, {}))
    return found


class _PluginMeta(abc.ABCMeta):
    """Orders a built plugin class (:func:`_plugin_class`): the class called, then Lightning's class and its bases.

    The class called derives from :class:`~lightning_memopt.utilities.namespaces.Precision`, the base of every
    namespace (``lightning.pytorch``'s first), so Python's default order would put ``lightning.pytorch``'s base
    methods before those of a ``pytorch_lightning`` plugin class. Here Lightning's class comes right after this
    package's classes and the user's, with every class it inherits, and the other namespace's base only after it:
    each method Lightning defines resolves to the chosen namespace, and a Trainer of either namespace accepts it.
    """

    def mro(cls) -> list[type]:
        lightning_class = cls.__dict__.get("_lightning_class")
        if lightning_class is None:
            return super().mro()
        called = cls.__dict__["_called_class"]
        bases = Precision.__mro__
        order = [cls, *(c for c in called.__mro__ if c not in bases), *lightning_class.__mro__[:-1]]
        return order + [c for c in bases if c not in order]


@functools.cache
def _plugin_class(called: type, lightning_class: type) -> Any:
    """The class ``called`` (``MemoryPrecision`` or a subclass) built on ``lightning_class``, one per pair.

    Named like the class called, so its checkpoint key (Lightning stores the plugin's state under the class's
    ``__qualname__``) does not depend on what was chosen. ``called`` already is ``lightning.pytorch``'s base plugin.
    """
    if lightning_class is _BASE_PRECISION:
        return called
    namespace = {
        "__module__": called.__module__,
        "__qualname__": called.__qualname__,
        "__doc__": called.__doc__,
        "_called_class": called,
        "_lightning_class": lightning_class,
    }
    return type(called)(called.__name__, (called, lightning_class), namespace)


def _called_class(cls: type) -> type:
    return cls.__dict__.get("_called_class", cls)


def _lightning_class(cls: type) -> type:
    return cls.__dict__.get("_lightning_class", _BASE_PRECISION)


def _unpickle(called: type, lightning_class: type) -> Any:
    return object.__new__(_plugin_class(called, lightning_class))


class _ChosenAtConstruction:
    """Gives :class:`MemoryPrecision` (and its subclasses) the ``__new__`` that returns the built class.

    It lives in a base of its own so that tools reading a class's arguments (jsonargparse, ``LightningCLI``) read
    ``MemoryPrecision.__init__``'s, as they do for a class whose ``__new__`` is inherited.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Self:
        """An instance of ``cls`` built on Lightning's plugin class for the precision chosen on ``device``."""
        found = _call_arguments(cls, args, kwargs)
        requested = normalize_precision(found.get("precision", "auto"), "precision")
        device_type = _device_type(found.get("device"))
        precision = _construction_precision(requested, device_type, found.get("allow_emulated_bf16") is True)
        lightning_class, _ = _lightning_plugin(NAMESPACES[0], precision, device_type, None)
        called: type = cls
        instance: Self = object.__new__(_plugin_class(called, lightning_class))
        return instance


class MemoryPrecision(_ChosenAtConstruction, Precision, metaclass=_PluginMeta):
    """Lightning's precision plugin for the precision that fits the GPU, chosen on the training device.

    ``MemoryPrecision(...)`` is, from construction on, the plugin Lightning's Trainer would build for the precision
    (``MixedPrecision``, ``HalfPrecision``, ``DoublePrecision`` or ``Precision``): an instance of a class made from
    the class called and Lightning's, so autocast, the GradScaler and its checkpoint state are Lightning's own. The
    choice is made on ``device`` and confirmed at setup on the device the Trainer trains on; where the Trainer's
    device type or Lightning namespace differs (``Trainer(accelerator="cpu")`` on a GPU machine, a
    ``pytorch_lightning`` Trainer), setup chooses again and the plugin becomes the class for that, the one case in
    which its class changes (besides Transformer Engine's, built at setup). Subclasses keep their methods throughout.

    * ``"auto"``: ``bf16-mixed`` where the GPU has native bf16 (compute capability >= 8.0), else ``16-mixed`` with a
      ``GradScaler``; ``32-true`` on CPU and other devices. One line (rank zero) says what was chosen.
    * ``"16-mixed"``, ``"bf16-mixed"``: autocast; asking for bf16 on a GPU without native bf16 raises an error that
      names the GPU and suggests fp16 (``torch.cuda.is_bf16_supported()`` would say True there: it counts emulation).
    * ``"16-true"``, ``"bf16-true"``, ``"64-true"``: weights, inputs and tensors created in ``trainer.init_module()``
      are half (double), as with Lightning's plugin (``init_module`` runs before setup).
    * ``"32-true"``: plain fp32; ``"transformer-engine"`` (``-float16``): Lightning's Transformer Engine plugin
      (needs ``transformer_engine``; built at setup, fp32 until then).
    * Lightning's short names are accepted and mapped as the Trainer maps them: ``16`` / ``"16"`` is ``"16-mixed"``,
      ``"bf16"`` is ``"bf16-mixed"``, ``32`` is ``"32-true"``, ``64`` is ``"64-true"``. One difference: on a CPU,
      Lightning's Trainer replaces ``"16-mixed"`` by ``"bf16-mixed"``; this plugin runs the fp16 autocast asked for
      (torch supports it on CPUs).

    ``precision`` (Lightning's attribute, what ``trainer.precision`` reads) is the precision chosen on ``device``;
    ``requested_precision`` keeps what was asked for and ``choice`` what setup chose and why.

    ``float32_matmul_precision`` is set through ``torch.set_float32_matmul_precision`` at setup and given back exactly
    at teardown (also after an exception; fits overlapping in one process share it: the first one's value holds until
    the last ends); where TF32 was set through torch's per-backend API the plugin leaves it alone and warns. With
    ``exact_accumulation=True`` the loss of an epoch's short last accumulation window is rescaled, so each optimizer
    step uses the mean of the micro-batch losses it saw (upstream #19987). The plugin replaces
    ``Trainer(precision=...)`` (given both, Lightning raises); FSDP, DeepSpeed and model-parallel strategies get a
    ``TypeError``: they need their own precision classes. The details are in ``docs/presets.md``.

    Args:
        precision: ``"auto"`` or any precision ``Trainer(precision=...)`` accepts (``"bf16-mixed"``, ``16``,
            ``"bf16"``...).
        float32_matmul_precision: ``"highest"``, ``"high"``, ``"medium"`` or ``None`` (leave as is).
        allow_emulated_bf16: use bf16 on a GPU without native bf16 instead of raising.
        scaler: a ``torch.amp.GradScaler`` for the fp16 path (Lightning makes one when ``None``).
        exact_accumulation: fix the short last accumulation window of an epoch (see above).
        verbose: print the whole reason for the choice at setup, for every precision (``"auto"`` prints one short
            line without it).
        device: the device type the Trainer will train on (``"cuda"``, ``"cpu"``...): Lightning's ``MixedPrecision``
            takes it, and ``"auto"`` is chosen on it before setup. ``None``: ``"cuda"`` where CUDA is available, else
            ``"cpu"``, as ``Trainer(accelerator="auto")`` picks.

    Device requirements: any; on CPU ``"auto"`` trains in fp32.

    Examples:
        >>> from lightning.pytorch import Trainer
        >>> trainer = Trainer(accelerator="cpu", plugins=[MemoryPrecision("auto")], logger=False)
        >>> trainer.precision_plugin.requested_precision, trainer.precision
        ('auto', '32-true')
        >>> from lightning.pytorch.plugins.precision import MixedPrecision
        >>> isinstance(MemoryPrecision("bf16-mixed", device="cpu"), MixedPrecision)
        True
    """

    #: The GradScaler in use: set by Lightning's ``MixedPrecision`` for fp16, ``None`` otherwise.
    scaler: torch.amp.GradScaler | None = None

    def __init__(
        self,
        precision: PrecisionInput = "auto",
        float32_matmul_precision: Literal["highest", "high", "medium"] | None = None,
        allow_emulated_bf16: bool = False,
        scaler: torch.amp.GradScaler | None = None,
        exact_accumulation: bool = True,
        verbose: bool = False,
        device: str | torch.device | None = None,
    ) -> None:
        normalized = normalize_precision(precision, "precision")
        device_type = _device_type(device)
        if float32_matmul_precision is not None:
            check_choice("float32_matmul_precision", float32_matmul_precision, _MATMUL_PRECISIONS)
        check_bool("allow_emulated_bf16", allow_emulated_bf16)
        check_bool("exact_accumulation", exact_accumulation)
        check_bool("verbose", verbose)
        if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
            raise ValueError(
                f"`scaler` must be a `torch.amp.GradScaler` or None, got {scaler!r}."
                " Pass `scaler=torch.amp.GradScaler('cuda')`, or None to have one made for fp16."
            )
        #: The precision asked for (``"auto"`` or a full Lightning name); ``precision`` is the one running.
        self.requested_precision: str = normalized
        self.float32_matmul_precision = float32_matmul_precision
        self.allow_emulated_bf16 = allow_emulated_bf16
        self.exact_accumulation = exact_accumulation
        self.verbose = verbose
        self._user_scaler = scaler
        #: What ``setup`` chose and why; ``None`` before.
        self.choice: PrecisionChoice | None = None
        #: Where the user sets ``precision``, for messages (a ``MemoryPreset`` says its own field).
        self.setting = "MemoryPrecision(precision={!r})"
        self._namespace = NAMESPACES[0]  # the Trainer's, once `setup` has seen it
        self._running: tuple[str, str] | None = None  # (precision, device type) of the Lightning plugin in place
        self._lightning_keys: tuple[str, ...] = ()  # the attributes Lightning's `__init__` set
        self._matmul: Lease | None = None  # the process's setting: shared with fits that overlap this one
        self._pending_state: tuple[Any] | None = None  # (state,): a checkpoint's state may itself be None
        self._warn = WarnOnce()
        # The class `__new__` built, unless a subclass's `__init__` passed other arguments on than it was called with.
        self._become(NAMESPACES[0], _construction_precision(normalized, device_type, allow_emulated_bf16), device_type)

    # ----------------------------------------------------------------------------------------------- resolution
    def resolve(
        self,
        device: torch.device,
        capability: tuple[int, int] | None = None,
        device_name: str | None = None,
        namespace: str | None = None,
    ) -> PrecisionChoice:
        """Choose the precision for ``device`` and become Lightning's plugin for it.

        ``capability`` and ``device_name`` are read from the device when ``None`` (CUDA only). ``namespace``
        (``"lightning.pytorch"`` or ``"pytorch_lightning"``) is where the plugin class comes from: the Trainer's.
        """
        device = torch.device(device)
        capability, device_name = _cuda_facts(device, capability, device_name)
        choice = choose_precision(
            self.requested_precision,
            device.type,
            capability,
            device_name,
            self.allow_emulated_bf16,
            setting=self.setting,
        )
        self.choice = choice
        self._namespace = namespace or self._namespace
        self._become(self._namespace, choice.precision, device.type)
        if self._pending_state is not None:
            state, self._pending_state = self._pending_state[0], None
            self.load_state_dict(state)
        return choice

    def _become(self, namespace: str, precision: str, device_type: str) -> None:
        """Run Lightning's ``__init__`` for ``precision`` on ``device_type``, as the class built for it.

        Kept as is when nothing changed (a second fit keeps the scaler state of the first). The class changes only
        where setup finds another device type or namespace than the one the plugin was built for.
        """
        lightning_class, kwargs = _lightning_plugin(namespace, precision, device_type, self._user_scaler)
        cls = _plugin_class(_called_class(type(self)), lightning_class)
        if type(self) is cls and self._running == (precision, device_type):
            return
        for key in self._lightning_keys:  # the previous plugin's attributes (a stale `scaler`, `precision`)
            self.__dict__.pop(key, None)
        ours = set(vars(self))
        self.__class__ = cls
        lightning_class.__init__(self, **kwargs)
        self._lightning_keys = tuple(sorted(set(vars(self)) - ours))
        self._running = (precision, device_type)

    @staticmethod
    def _check_strategy(trainer: pl.Trainer | None) -> None:
        strategy = getattr(trainer, "strategy", None)
        own = own_precision_strategy(strategy)
        if own is not None:
            raise TypeError(
                f"`MemoryPrecision` cannot serve `strategy={type(strategy).__name__}`: {own} needs its own"
                " precision class. Drop `MemoryPrecision` from `plugins` and pass `precision='bf16-mixed'` (or"
                " '16-mixed') to the Trainer, or call `MemoryPreset.trainer_kwargs(strategy=...)`, which does that."
                + _FSDP2_HINT
                * (own == "ModelParallelStrategy")
            )

    def _setup(self, module: Module) -> None:
        trainer = getattr(module, "_trainer", None)
        self._check_strategy(trainer)
        if trainer is not None:
            device = trainer.strategy.root_device
        else:
            device = next((p.device for p in module.parameters()), torch.device("cpu"))
        choice = self.resolve(device, namespace=namespace_of(trainer if trainer is not None else module).__name__)
        self._tell(choice, trainer, device)
        if self.float32_matmul_precision is not None and self._matmul is None:
            self._borrow_matmul(self.float32_matmul_precision)

    def _tell(self, choice: PrecisionChoice, trainer: Any, device: torch.device) -> None:
        """One line (rank zero) for ``"auto"``: what was chosen (fp32 where autocast is not chosen: a note in the
        fit's one line of inactive parts); with ``verbose``, the whole reason for any choice."""
        if self.verbose:
            text = (
                f"MemoryPrecision(precision={self.requested_precision!r}) chose {choice.precision!r}: {choice.reason}"
            )
            rank_zero_info(wrap_to_width(text))
        elif self.requested_precision == "auto" and choice.precision == "32-true" and trainer is not None:
            note_inactive(trainer, "MemoryPrecision", f"auto is fp32 on {device.type}")
        elif self.requested_precision == "auto":
            text = f"MemoryPrecision(precision='auto') chose {choice.summary}."
            rank_zero_info(textwrap.shorten(text, width=WIDTH, placeholder="..."))  # one line, always

    def _borrow_matmul(self, wanted: str) -> None:
        self._matmul = borrow(
            "torch.float32_matmul_precision", wanted, _set_matmul_state, self._warn, "MemoryPrecision"
        )
        if self._matmul is None:
            self._warn.warn(
                "new_matmul_api",
                f"MemoryPrecision left `float32_matmul_precision={wanted!r}` unapplied: TF32 was already set through"
                " torch's per-backend API (`torch.backends.cuda.matmul.fp32_precision`), which does not mix with"
                " `torch.set_float32_matmul_precision`. Set it through that API yourself, or drop"
                " `float32_matmul_precision` here.",
            )

    def _short_window_factor(self, module: Any) -> float:
        """``accumulate_grad_batches / len(window)`` inside a short last window of an epoch, else 1."""
        trainer = getattr(module, "_trainer", None)
        if not self.exact_accumulation or trainer is None or not getattr(module, "automatic_optimization", True):
            return 1.0
        try:
            accumulate = int(trainer.accumulate_grad_batches)
            total = trainer.num_training_batches
            if accumulate <= 1 or not trainer.training or not math.isfinite(total):
                return 1.0
            ready = trainer.fit_loop.epoch_loop.batch_progress.current.ready  # counts the current batch
        except Exception:
            return 1.0
        full = (int(total) // accumulate) * accumulate
        if full < ready <= int(total):
            return accumulate / (int(total) - full)
        return 1.0  # a full window, or a batch past the epoch's count (a resume from an end-of-epoch checkpoint)

    # ------------------------------------------------------------------ the four Lightning methods it extends
    @override
    def convert_module(self, module: Module) -> Module:
        """Choose the precision on the training device and become Lightning's plugin for it; then convert."""
        self._setup(module)
        return super().convert_module(module)

    @override
    def pre_backward(self, tensor: Tensor, module: pl.LightningModule) -> Tensor:
        """Rescale the loss of an epoch's short last accumulation window (``exact_accumulation``)."""
        factor = self._short_window_factor(module)
        return super().pre_backward(tensor * factor if factor != 1.0 else tensor, module)

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the scaler, checked: a bad or missing key warns and leaves it fresh (before setup: at setup)."""
        if self.choice is None:
            self._pending_state = (state_dict,)
            return
        checked = checked_scaler_state(state_dict, has_scaler=self.scaler is not None)
        if checked is not None:
            super().load_state_dict(checked)

    @override
    def teardown(self) -> None:
        """Lightning's teardown, then give back the float32 matmul precision (the last fit out restores it)."""
        try:
            super().teardown()
        finally:
            lease, self._matmul = self._matmul, None
            if lease is not None:
                lease.release()

    def __reduce__(self) -> tuple[Any, ...]:
        cls = type(self)
        return _unpickle, (_called_class(cls), _lightning_class(cls)), vars(self)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(precision={self.requested_precision!r})"
