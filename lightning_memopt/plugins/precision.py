"""MemoryPrecision: AMP fp16 / bf16 with a real hardware check, true-half modes and TF32 through one API."""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import math
from collections.abc import Callable, Generator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor
from torch.nn import Module
from typing_extensions import override

from lightning_memopt.functional.precision import (
    UNSUPPORTED_STRATEGIES,
    PrecisionChoice,
    PrecisionInput,
    choose_precision,
    has_own_precision,
    load_delegate_state,
    normalize_precision,
    own_precision_strategy,
)
from lightning_memopt.utilities.checks import check_bool, check_choice
from lightning_memopt.utilities.namespaces import NAMESPACES, Precision, namespace_of
from lightning_memopt.utilities.shared_state import Lease, Restore, borrow
from lightning_memopt.utilities.warnings import WarnOnce

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["MemoryPrecision", "UNSUPPORTED_STRATEGIES", "has_own_precision"]

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


def _plugin_class(namespace: str, name: str) -> type:
    """Lightning's precision plugin ``name`` (``"Precision"``, ``"MixedPrecision"``, ...) in ``namespace``."""
    return getattr(importlib.import_module(f"{namespace}.plugins.precision"), name)


def _plain_plugin(namespace: str, precision: str) -> Any:
    """Lightning's plugin for a precision without autocast, built as Lightning's Trainer builds it."""
    if precision in ("16-true", "bf16-true"):
        return _plugin_class(namespace, "HalfPrecision")(precision)
    if precision == "64-true":
        return _plugin_class(namespace, "DoublePrecision")()
    if precision.startswith("transformer-engine"):
        dtype = torch.float16 if precision.endswith("float16") else torch.bfloat16
        cls = _plugin_class(namespace, "TransformerEnginePrecision")
        keyword = "weights_dtype" if "weights_dtype" in inspect.signature(cls).parameters else "dtype"  # Lightning 2.1
        return cls(**{keyword: dtype})
    return _plugin_class(namespace, "Precision")()


class MemoryPrecision(Precision):
    """A Lightning precision plugin that picks mixed precision from what the GPU really supports.

    The mode is resolved in ``setup`` on the device the Trainer trains on:

    * ``"auto"``: ``bf16-mixed`` where the GPU has native bf16 (compute capability >= 8.0), else ``16-mixed`` with a
      ``GradScaler``; ``32-true`` on CPU and other devices. A warning (rank zero) says what was chosen and why.
    * ``"16-mixed"``, ``"bf16-mixed"``: autocast; asking for bf16 on a GPU without native bf16 raises an error that
      names the GPU and suggests fp16 (``torch.cuda.is_bf16_supported()`` would say True there: it counts emulation).
    * ``"16-true"``, ``"bf16-true"``: weights, inputs and tensors created in ``trainer.init_module()`` are half.
    * ``"32-true"``: plain fp32; ``"64-true"``: fp64; ``"transformer-engine"`` (``-float16``): Lightning's
      Transformer Engine plugin (needs ``transformer_engine``).
    * Lightning's short names are accepted and mapped as the Trainer maps them: ``16`` / ``"16"`` is ``"16-mixed"``,
      ``"bf16"`` is ``"bf16-mixed"``, ``32`` is ``"32-true"``, ``64`` is ``"64-true"``. One difference: on a CPU,
      Lightning's Trainer replaces ``"16-mixed"`` by ``"bf16-mixed"``; this plugin runs the fp16 autocast asked for
      (torch supports it on CPUs).

    ``float32_matmul_precision`` is set through ``torch.set_float32_matmul_precision`` at setup and given back exactly
    at teardown (also after an exception; fits overlapping in one process share it: the first one's value holds until
    the last ends); where TF32 was set through torch's per-backend API the plugin leaves it alone and warns. With
    ``exact_accumulation=True`` the loss of an epoch's short last accumulation window is rescaled, so each optimizer
    step uses the mean of the micro-batch losses it saw (upstream #19987). The plugin replaces
    ``Trainer(precision=...)`` (given both, Lightning raises); FSDP, DeepSpeed and model-parallel strategies get a
    ``TypeError``: they need their own precision classes. The details are in ``docs/presets.md``.

    Args:
        mode: ``"auto"`` or any precision ``Trainer(precision=...)`` accepts (``"bf16-mixed"``, ``16``, ``"bf16"``...).
        float32_matmul_precision: ``"highest"``, ``"high"``, ``"medium"`` or ``None`` (leave as is).
        allow_emulated_bf16: use bf16 on a GPU without native bf16 instead of raising.
        scaler: a ``torch.amp.GradScaler`` for the fp16 path (one is made when ``None``).
        exact_accumulation: fix the short last accumulation window of an epoch (see above).

    Device requirements: any; on CPU ``"auto"`` trains in fp32.

    Example:
        >>> from lightning.pytorch import Trainer
        >>> trainer = Trainer(accelerator="cpu", plugins=[MemoryPrecision("auto")], logger=False)
        >>> trainer.precision_plugin.mode
        'auto'
    """

    precision: str = "32-true"

    def __init__(
        self,
        mode: PrecisionInput = "auto",
        float32_matmul_precision: Literal["highest", "high", "medium"] | None = None,
        allow_emulated_bf16: bool = False,
        scaler: torch.amp.GradScaler | None = None,
        exact_accumulation: bool = True,
    ) -> None:
        normalized = normalize_precision(mode, "mode")
        if float32_matmul_precision is not None:
            check_choice("float32_matmul_precision", float32_matmul_precision, _MATMUL_PRECISIONS)
        check_bool("allow_emulated_bf16", allow_emulated_bf16)
        check_bool("exact_accumulation", exact_accumulation)
        if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
            raise ValueError(
                f"`scaler` must be a `torch.amp.GradScaler` or None, got {scaler!r}."
                " Pass `scaler=torch.amp.GradScaler('cuda')`, or None to have one made for fp16."
            )
        self.mode: str = normalized
        self.float32_matmul_precision = float32_matmul_precision
        self.allow_emulated_bf16 = allow_emulated_bf16
        self.exact_accumulation = exact_accumulation
        self._scaler = scaler
        self.choice: PrecisionChoice | None = None
        self.precision = normalized if normalized != "auto" else "32-true"
        #: The Lightning namespace whose plugins do the work: the Trainer's, once ``setup`` has seen it.
        self._namespace = NAMESPACES[0]
        #: Where the user sets ``mode``, for messages (a ``MemoryPreset`` says its own field).
        self.setting = "MemoryPrecision(mode={!r})"
        # the true-dtype modes act before setup too (`trainer.init_module()`); the others are chosen in `setup`
        self._delegate: Any = _plain_plugin(
            self._namespace, normalized if normalized in ("16-true", "bf16-true", "64-true") else "32-true"
        )
        self._matmul: Lease | None = None  # the process's setting: shared with fits that overlap this one
        self._pending_state: tuple[Any] | None = None  # (state,): a checkpoint's state may itself be None
        self._warn = WarnOnce()

    # ----------------------------------------------------------------------------------------------- resolution
    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        """The GradScaler in use (fp16 mixed precision only)."""
        return getattr(self._delegate, "scaler", None)

    def resolve(
        self,
        device: torch.device,
        capability: tuple[int, int] | None = None,
        device_name: str | None = None,
        namespace: str | None = None,
    ) -> PrecisionChoice:
        """Choose the precision for ``device`` and build the Lightning plugin that implements it.

        ``capability`` and ``device_name`` are read from the device when ``None`` (CUDA only). ``namespace``
        (``"lightning.pytorch"`` or ``"pytorch_lightning"``) is where the plugin comes from: the Trainer's.
        """
        device = torch.device(device)
        if device.type == "cuda" and torch.cuda.is_available():
            if capability is None:
                major, minor = torch.cuda.get_device_capability(device)
                capability = (major, minor)
            if device_name is None:
                device_name = torch.cuda.get_device_name(device)
        choice = choose_precision(
            self.mode, device.type, capability, device_name, self.allow_emulated_bf16, setting=self.setting
        )
        self.choice = choice
        self.precision = choice.precision
        namespace = namespace or self._namespace
        same_namespace, self._namespace = namespace == self._namespace, namespace
        mixed: Any = _plugin_class(namespace, "MixedPrecision")
        current = self._delegate
        if isinstance(current, mixed) and current.precision == choice.precision and current.device == device.type:
            pass  # a second fit keeps the scaler state of the first
        elif choice.precision in ("16-mixed", "bf16-mixed"):
            scaler = self._scaler if choice.precision == "16-mixed" else None
            self._delegate = mixed(choice.precision, device.type, scaler=scaler)
        elif (
            not same_namespace or isinstance(current, mixed) or getattr(current, "precision", None) != choice.precision
        ):
            self._delegate = _plain_plugin(namespace, choice.precision)
        if self._pending_state is not None:
            load_delegate_state(self._delegate, self._pending_state[0])
        self._pending_state = None
        return choice

    @staticmethod
    def _check_strategy(trainer: pl.Trainer | None) -> None:
        strategy = getattr(trainer, "strategy", None)
        own = own_precision_strategy(strategy)
        if own is not None:
            raise TypeError(
                f"`MemoryPrecision` cannot serve `strategy={type(strategy).__name__}`: {own} needs its own"
                " precision class. Drop `MemoryPrecision` from `plugins` and pass `precision='bf16-mixed'` (or"
                " '16-mixed') to the Trainer, or call `MemoryPreset.trainer_kwargs(strategy=...)`, which does that."
            )

    def _setup(self, module: Module) -> None:
        trainer = getattr(module, "_trainer", None)
        self._check_strategy(trainer)
        if trainer is not None:
            device = trainer.strategy.root_device
        else:
            device = next((p.device for p in module.parameters()), torch.device("cpu"))
        choice = self.resolve(device, namespace=namespace_of(trainer if trainer is not None else module).__name__)
        if self.mode == "auto" and getattr(trainer, "global_rank", 0) == 0:
            message = f"MemoryPrecision(mode='auto') chose precision={choice.precision!r}: {choice.reason}"
            self._warn.warn("choice", message)
        if self.float32_matmul_precision is not None and self._matmul is None:
            wanted, key = self.float32_matmul_precision, "torch.float32_matmul_precision"
            self._matmul = borrow(key, wanted, _set_matmul_state, self._warn, "MemoryPrecision")
            if self._matmul is None:
                self._warn.warn(
                    "new_matmul_api",
                    f"MemoryPrecision left `float32_matmul_precision={self.float32_matmul_precision!r}` unapplied:"
                    " TF32 was already set through torch's per-backend API (`torch.backends.cuda.matmul."
                    "fp32_precision`), which does not mix with `torch.set_float32_matmul_precision`. Set it through"
                    " that API yourself, or drop `float32_matmul_precision` here.",
                )

    # ------------------------------------------------------------------------------------------- Precision API
    @override
    def convert_module(self, module: Module) -> Module:
        self._setup(module)
        return self._delegate.convert_module(module)

    @override
    def tensor_init_context(self) -> AbstractContextManager:
        return self._delegate.tensor_init_context()

    @override
    def module_init_context(self) -> AbstractContextManager:
        return self._delegate.module_init_context()

    @override
    def forward_context(self) -> AbstractContextManager:
        return self._delegate.forward_context()

    @override
    @contextlib.contextmanager
    def train_step_context(self) -> Generator[None, None, None]:
        with self._delegate.train_step_context():
            yield

    @override
    @contextlib.contextmanager
    def val_step_context(self) -> Generator[None, None, None]:
        with self._delegate.val_step_context():
            yield

    @override
    @contextlib.contextmanager
    def test_step_context(self) -> Generator[None, None, None]:
        with self._delegate.test_step_context():
            yield

    @override
    @contextlib.contextmanager
    def predict_step_context(self) -> Generator[None, None, None]:
        with self._delegate.predict_step_context():
            yield

    @override
    def convert_input(self, data: Any) -> Any:
        return self._delegate.convert_input(data)

    @override
    def convert_output(self, data: Any) -> Any:
        return self._delegate.convert_output(data)

    @override
    def connect(self, model: Any, optimizers: Any, lr_schedulers: Any) -> Any:
        return self._delegate.connect(model, optimizers, lr_schedulers)

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

    @override
    def pre_backward(self, tensor: Tensor, module: pl.LightningModule) -> Tensor:
        factor = self._short_window_factor(module)
        if factor != 1.0:
            tensor = tensor * factor
        return self._delegate.pre_backward(tensor, module)

    @override
    def backward(self, tensor: Tensor, model: pl.LightningModule, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        self._delegate.backward(tensor, model, optimizer, *args, **kwargs)

    @override
    def post_backward(self, tensor: Tensor, module: pl.LightningModule) -> Tensor:
        return self._delegate.post_backward(tensor, module)

    @override
    def optimizer_step(
        self, optimizer: Any, model: pl.LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        return self._delegate.optimizer_step(optimizer, model=model, closure=closure, **kwargs)

    @override
    def clip_gradients(self, optimizer: Any, clip_val: int | float = 0.0, gradient_clip_algorithm: Any = None) -> None:
        kwargs = {} if gradient_clip_algorithm is None else {"gradient_clip_algorithm": gradient_clip_algorithm}
        self._delegate.clip_gradients(optimizer, clip_val=clip_val, **kwargs)

    @override
    def main_params(self, optimizer: Any) -> Any:
        return self._delegate.main_params(optimizer)

    @override
    def state_dict(self) -> dict[str, Any]:
        return self._delegate.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the scaler; a bad or missing key warns and leaves it fresh (``load_delegate_state``)."""
        if self.choice is None:  # restored before setup: applied once the delegate exists
            self._pending_state = (state_dict,)
        else:
            load_delegate_state(self._delegate, state_dict)

    @override
    def teardown(self) -> None:
        try:
            self._delegate.teardown()
        finally:
            lease, self._matmul = self._matmul, None
            if lease is not None:
                lease.release()  # the last fit out gives back the state from before the first

    def __repr__(self) -> str:
        return f"{type(self).__name__}(mode={self.mode!r}, precision={self.precision!r})"
