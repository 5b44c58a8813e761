"""Byte accounting of a training step without the memory: a live-storage counter over fake CPU tensors.

The engine behind :func:`lightning_memopt.estimate_memory`. A twin of the model is built on fake tensors
(``torch._subclasses.fake_tensor.FakeTensorMode``: shapes, dtypes and strides, no data), training steps run on it in
Lightning's order, and :class:`LiveBytes` adds a storage's bytes when it first appears and subtracts them when the
storage is freed. On CPU this counts the same bytes a real step holds (the tests compare with the same counter over
real tensors); what CUDA does differently is modelled here (:func:`cuda_attention`, :func:`use_foreach`, the
allocator's 512-byte blocks, cuBLAS workspaces) and listed in the estimate's ``assumptions``.

Nothing here imports Lightning: the step is given as plain callables.
"""

from __future__ import annotations

import contextlib
import copy
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from lightning_memopt.utilities._torch_private import backward_outside_torch_function

__all__ = [
    "CUDA_BLOCK_BYTES",
    "CUBLAS_WORKSPACE_BYTES",
    "CUDA_AUTOCAST_FP32",
    "PEAK_PARTS",
    "FakeStepError",
    "LiveBytes",
    "StepCount",
    "count_training_steps",
    "cuda_attention",
    "cuda_autocast",
    "fake_twin",
    "kernel_scratch",
    "use_foreach",
]

#: The CUDA caching allocator hands out blocks in multiples of 512 bytes.
CUDA_BLOCK_BYTES = 512
#: cuBLAS workspaces taken from the caching allocator by default: 4096 KiB x 2 + 16 KiB x 8 per (handle, stream), one
#: for forward and one for backward's own thread (``CUBLAS_WORKSPACE_CONFIG`` changes it; sm90 GPUs take 32 MiB).
CUBLAS_WORKSPACE_BYTES = 2 * (2 * 4096 + 8 * 16) * 1024
#: What the bytes alive at the peak are, in the order they are reported.
PEAK_PARTS = ("parameters", "buffers", "batch", "gradients", "optimizer_states", "activations", "temporaries")

_PHASE_PARTS = {
    "forward": "activations",
    "backward": "temporaries",
    "optimizer step": "temporaries",
    "zero_grad": "temporaries",
    "setup": "temporaries",
    "scratch": "temporaries",
}


def kernel_scratch(func: Any, args: tuple, kwargs: dict) -> int:
    """Bytes a softmax kernel holds inside itself: a contiguous copy of each non-contiguous input.

    ``softmax``/``log_softmax`` and their backward make their inputs contiguous inside the kernel, on the CPU and on
    CUDA alike (``F.cross_entropy(logits.T, ...)`` in a CLIP loss copies the whole logits matrix; its backward
    copies the gradient and the output). No operator shows these copies, so they are counted while the kernel runs.
    Measured as process RSS on torch 2.13 (``benchmarks/planner.py``).
    """
    packet = getattr(func, "overloadpacket", None)
    aten = torch.ops.aten
    if packet in (aten._softmax, aten._log_softmax):
        tensors = args[:1]
    elif packet in (aten._softmax_backward_data, aten._log_softmax_backward_data):
        tensors = args[:2]
    else:
        return 0
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, Tensor) and not t.is_contiguous())


class FakeStepError(RuntimeError):
    """A training step that cannot run on fake tensors (data-dependent shapes, ``.item()``, custom ops)."""

    def __init__(self, message: str, op: str | None = None) -> None:
        super().__init__(message)
        self.op = op


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of the tensor storages alive, and their peak, as operators create and free them.

    Each storage is counted once, when an operator's output shows it first (views and in-place results share it),
    and leaves the count when torch frees it. Storages are labelled with the phase that created them; a label can
    change later (a gradient, an optimizer state), so the totals at the peak say what the peak was made of.

    Args:
        block_bytes: round each storage up to a multiple of this (512 models the CUDA caching allocator; 1: none).
        scratch: ``scratch(op, args, kwargs) -> bytes`` a kernel holds inside itself beside its outputs while it runs
            (no operator shows them); counted at that moment only (e.g. :func:`kernel_scratch`).
    """

    def __init__(self, block_bytes: int = 1, scratch: Callable[[Any, tuple, dict], int] | None = None) -> None:
        super().__init__()
        self.block_bytes = block_bytes
        self.scratch = scratch
        self.phase = "setup"
        self.step = 0
        self.now = 0
        self.peak = 0
        self.peak_phase = "setup"
        self.peak_step = 0
        self.peak_seq = 0
        self.peak_totals: dict[str, int] = {}
        self.phase_peaks: dict[str, int] = {}
        self.totals: dict[str, int] = {}
        self._seq = 0
        self._info: dict[int, list[Any]] = {}  # id(storage) -> [bytes, label, seq, step]

    def _bytes(self, nbytes: int) -> int:
        block = self.block_bytes
        return nbytes if block <= 1 else -(-nbytes // block) * block

    def track(self, tensor: Tensor, label: str | None = None) -> None:
        """Count ``tensor``'s storage if it is new; ``label`` (default: the current phase) says what it is."""
        storage = tensor.untyped_storage()
        key = id(storage)
        if key in self._info:
            return
        nbytes = self._bytes(storage.nbytes())
        label = label or self.phase
        self._seq += 1
        self._info[key] = [nbytes, label, self._seq, self.step]
        self.totals[label] = self.totals.get(label, 0) + nbytes
        self.now += nbytes
        weakref.finalize(storage, self._free, key)
        if self.now > self.phase_peaks.get(self.phase, 0):
            self.phase_peaks[self.phase] = self.now
        if self.now > self.peak:
            self.peak, self.peak_phase, self.peak_step, self.peak_seq = self.now, self.phase, self.step, self._seq
            self.peak_totals = dict(self.totals)

    def relabel(self, tensor: Tensor, label: str) -> None:
        """Say what an already counted storage is (e.g. ``"gradients"``); unknown storages are counted first."""
        key = id(tensor.untyped_storage())
        info = self._info.get(key)
        if info is None:
            self.track(tensor, label)
            return
        if info[1] != label:
            self.totals[info[1]] -= info[0]
            self.totals[label] = self.totals.get(label, 0) + info[0]
            info[1] = label

    def info(self, tensor: Tensor) -> tuple[int, str, int, int] | None:
        """(bytes, label, creation number, step) of ``tensor``'s storage, if it is counted and alive."""
        found = self._info.get(id(tensor.untyped_storage()))
        return None if found is None else tuple(found)  # type: ignore[return-value]

    def _free(self, key: int) -> None:
        info = self._info.pop(key, None)
        if info is not None:
            self.now -= info[0]
            self.totals[info[1]] -= info[0]

    def _transient(self, nbytes: int) -> None:
        level = self.now + nbytes
        if level > self.phase_peaks.get(self.phase, 0):
            self.phase_peaks[self.phase] = level
        if level > self.peak:
            self.peak, self.peak_phase, self.peak_step, self.peak_seq = level, self.phase, self.step, self._seq
            self.peak_totals = {**self.totals, "scratch": nbytes}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        for value in tree_flatten(out)[0]:
            if isinstance(value, Tensor):
                self.track(value)
        if self.scratch is not None:
            extra = self.scratch(func, args, kwargs)
            if extra:
                self._transient(self._bytes(extra))
        return out


@dataclass(frozen=True, kw_only=True)
class StepCount:
    """What :func:`count_training_steps` counted (bytes; ``at_peak`` adds up to ``peak_bytes``)."""

    peak_bytes: int
    peak_phase: str
    peak_step: int
    at_peak: dict[str, int]
    parameter_bytes: int
    trainable_parameter_bytes: int
    buffer_bytes: int
    gradient_bytes: int
    optimizer_state_bytes: int
    batch_bytes: int
    phase_peaks: dict[str, int] = field(default_factory=dict)


def _tensors(value: Any) -> list[Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, Tensor)]


def _optimizer_state_tensors(optimizers: list[torch.optim.Optimizer]) -> Iterator[Tensor]:
    for optimizer in optimizers:
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, Tensor):
                    yield value


def _describe_fake_failure(err: BaseException) -> FakeStepError | None:
    from torch._subclasses import fake_tensor as ft

    kinds = {
        ft.DataDependentOutputException: "its output depends on the data (e.g. `.item()`, `.tolist()`, a Python"
        " `if` on a tensor)",
        ft.DynamicOutputShapeException: "its output shape depends on the data (e.g. `nonzero`, boolean masking,"
        " `unique`)",
        ft.UnsupportedOperatorException: "it has no fake (meta) implementation (a custom C++/CUDA op?)",
    }
    for kind, why in kinds.items():
        if isinstance(err, kind):
            op = str(getattr(err, "func", "?"))
            return FakeStepError(f"operator `{op}` cannot run on fake tensors: {why}.", op)
    if isinstance(err, ft.UnsupportedFakeTensorException):
        return FakeStepError(f"the step cannot run on fake tensors: {err}", None)
    return None


def fake_twin(module: nn.Module, mode: Any | None, dtype: torch.dtype | None = None) -> nn.Module:
    """A copy of ``module`` whose parameters and buffers are fake tensors of ``mode`` (no data copied).

    Tied weights stay tied; the module itself is not changed. Parameters and buffers that are fake already (a model
    built inside ``mode``) are used as they are. ``dtype`` casts the floating ones (``"bf16-true"``); with ``mode``
    ``None`` the copy holds real copies of the tensors. A model built on the meta device (``with torch.device("meta")``)
    gets fake CPU tensors of the same shapes: a large model can be estimated without ever holding its weights.
    """
    memo: dict[int, Any] = {}
    for tensor in [*module.parameters(), *module.buffers()]:
        if id(tensor) in memo:
            continue
        if tensor.device.type == "meta":
            if mode is None:
                raise FakeStepError(
                    "a model on the meta device has no data to run a real step with; estimate it on"
                    " fake tensors (fake=True)"
                )
            with mode:  # a model built on the meta device: the same shapes on fake CPU tensors
                fake = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="cpu")
        elif mode is None:
            fake = tensor.detach().clone()
        else:
            fake = tensor if getattr(tensor, "fake_mode", None) is mode else mode.from_tensor(tensor)
        if dtype is not None and fake.is_floating_point():
            fake = fake.to(dtype)
        if isinstance(tensor, nn.Parameter) and not isinstance(fake, nn.Parameter):
            fake = nn.Parameter(fake, requires_grad=tensor.requires_grad)
        memo[id(tensor)] = fake
    return copy.deepcopy(module, memo)


@contextlib.contextmanager
def cuda_attention() -> Iterator[None]:
    """``scaled_dot_product_attention`` as CUDA's fused kernels hold memory: no ``L x L`` attention matrix.

    On CUDA, flash or memory-efficient attention keep the output and a per-row log-sum-exp for backward; the CPU
    falls back to the math path (which keeps the full attention matrix) whenever there is a mask or dropout. The
    attribute ``torch.nn.functional.scaled_dot_product_attention`` is replaced (so calls from
    ``F.multi_head_attention_forward`` and Hugging Face models are seen) with the CPU flash kernel, whose memory is
    the fused kernels'. Code that imported the function by name before keeps the original.
    """
    original = torch.nn.functional.scaled_dot_product_attention

    def fused(
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attn_mask: Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> Tensor:
        if query.dim() != 4 or key.dim() != 4 or (query.size(1) != key.size(1) and not enable_gqa):
            return original(
                query,
                key,
                value,
                attn_mask=attn_mask,
                dropout_p=dropout_p,
                is_causal=is_causal,
                scale=scale,
                enable_gqa=enable_gqa,
            )
        if query.size(1) != key.size(1):
            repeat = query.size(1) // key.size(1)
            key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
        out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
        )
        return out[0]

    torch.nn.functional.scaled_dot_product_attention = fused
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = original


#: Functions CUDA's autocast runs in float32 (torch's autocast op reference); the CPU's autocast leaves most of them in
#: the lower precision (layer_norm, group_norm, softmax, log_softmax, exp, pow, sum, ... stay bf16 there).
CUDA_AUTOCAST_FP32 = frozenset(
    {
        "__pow__",
        "__rdiv__",
        "__rpow__",
        "__rtruediv__",
        "acos",
        "asin",
        "binary_cross_entropy_with_logits",
        "cosh",
        "cosine_embedding_loss",
        "cdist",
        "cosine_similarity",
        "cross_entropy",
        "cumprod",
        "cumsum",
        "dist",
        "erfinv",
        "exp",
        "expm1",
        "group_norm",
        "hinge_embedding_loss",
        "kl_div",
        "l1_loss",
        "layer_norm",
        "log",
        "log_softmax",
        "log10",
        "log1p",
        "log2",
        "margin_ranking_loss",
        "mse_loss",
        "multilabel_margin_loss",
        "multi_margin_loss",
        "nll_loss",
        "norm",
        "normalize",
        "pdist",
        "poisson_nll_loss",
        "pow",
        "prod",
        "reciprocal",
        "rsqrt",
        "sinh",
        "smooth_l1_loss",
        "soft_margin_loss",
        "softmax",
        "softmin",
        "softplus",
        "sum",
        "renorm",
        "tan",
        "triplet_margin_loss",
    }
)


class _CudaAutocastFloat32(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if (
            getattr(func, "__name__", None) in CUDA_AUTOCAST_FP32
            and kwargs.get("dtype") is None  # an explicit dtype= is not autocast
            and torch.is_autocast_enabled("cpu")
        ):

            def up(value: Any) -> Any:
                if isinstance(value, Tensor) and value.dtype in (torch.float16, torch.bfloat16):
                    return value.float()
                return value

            args, kwargs = tree_map(up, args), tree_map(up, kwargs)
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_autocast() -> Iterator[None]:
    """Inside CPU autocast, run the functions CUDA's autocast runs in float32 (:data:`CUDA_AUTOCAST_FP32`) in float32.

    Their bf16/fp16 inputs are cast to float32 first, as CUDA's autocast does, so their outputs (and what they save
    for backward) have CUDA's sizes. Functions called from inside another torch function (e.g. the softmax inside
    ``F.multi_head_attention_forward``) keep the CPU's behaviour.
    """
    with _CudaAutocastFloat32():
        yield


def use_foreach(optimizers: list[torch.optim.Optimizer]) -> bool:
    """Set ``foreach=True`` where it was left to torch (``None``), as torch's default does on CUDA; whether any was."""
    changed = False
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            if "foreach" in group and group["foreach"] is None and not group.get("fused"):
                group["foreach"] = True
                changed = True
    return changed


def count_training_steps(
    module: nn.Module,
    batch: Any,
    step_fn: Callable[[nn.Module, Any, int], Tensor],
    make_optimizers: Callable[[nn.Module], list[torch.optim.Optimizer]],
    *,
    fake: bool = True,
    steps: int = 2,
    block_bytes: int = 1,
    scratch: Callable[[Any, tuple, dict], int] | None = None,
    prepare: Callable[[nn.Module], None] | None = None,
    step_context: Callable[[], contextlib.AbstractContextManager] | None = None,
    prepare_optimizers: Callable[[list[torch.optim.Optimizer]], None] | None = None,
    batch_fn: Callable[[Any], Any] | None = None,
    dtype: torch.dtype | None = None,
) -> StepCount:
    """Run ``steps`` training steps in Lightning's order and count the bytes alive at every moment.

    Lightning's order is: ``step_fn`` (the training step), ``zero_grad(set_to_none=True)``, backward, the optimizer
    step; the previous step's gradients are alive during the next forward, and optimizer states appear at the first
    step, so two steps see every peak.

    Args:
        module: the model; never changed: a fake twin runs (``fake=False``: a real copy).
        batch: the batch (any nesting of tensors); with ``fake=True`` real tensors are faked (no data copied).
        step_fn: ``step_fn(model, batch, step_index) -> loss``.
        make_optimizers: builds the optimizers over the model that runs.
        fake: run on fake CPU tensors (no memory); ``False`` runs a real step on the CPU and counts its bytes.
        steps: training steps to run.
        block_bytes: round storages up to this many bytes.
        scratch: bytes a kernel holds inside itself (see :class:`LiveBytes`).
        prepare: called with the model that runs, before counting (checkpointing, dtype casts).
        step_context: a fresh context around each step (autocast, attention modelling).
        prepare_optimizers: called with the optimizers once they exist (e.g. :func:`use_foreach`).
        batch_fn: called with the (faked) batch before counting (e.g. a dtype cast).
        dtype: cast the model's floating parameters and buffers to it (``"bf16-true"``).

    Raises:
        FakeStepError: an operator of the step cannot run on fake tensors; the message names it.
    """
    counter = LiveBytes(block_bytes, scratch)
    mode = None
    if fake:
        from torch._subclasses.fake_tensor import FakeTensorMode

        mode = FakeTensorMode(allow_non_fake_inputs=False)
        batch = tree_map(
            lambda t: t if not isinstance(t, Tensor) or getattr(t, "fake_mode", None) is mode else mode.from_tensor(t),
            batch,
        )
    model = fake_twin(module, mode, dtype)  # with fake=False a real copy: the user's module is never trained
    handles = []
    try:
        with mode if mode is not None else contextlib.nullcontext():
            if prepare is not None:
                prepare(model)
            if batch_fn is not None:
                batch = batch_fn(batch)
            params = list(model.parameters())
            for p in params:
                counter.track(p, "parameters")
            for b in model.buffers():
                counter.track(b, "buffers")
            for t in _tensors(batch):
                counter.track(t, "batch")
            parameter_bytes = sum(
                counter._bytes(p.untyped_storage().nbytes())
                for p in {id(p.untyped_storage()): p for p in params}.values()
            )
            trainable = [p for p in params if p.requires_grad]
            trainable_bytes = sum(
                counter._bytes(p.untyped_storage().nbytes())
                for p in {id(p.untyped_storage()): p for p in trainable}.values()
            )
            buffer_bytes = sum(counter._bytes(b.untyped_storage().nbytes()) for b in model.buffers())
            batch_bytes = sum(
                counter._bytes(t.untyped_storage().nbytes())
                for t in {id(t.untyped_storage()): t for t in _tensors(batch)}.values()
            )
            for p in trainable:
                handles.append(p.register_post_accumulate_grad_hook(lambda p: counter.relabel(p.grad, "gradients")))
            with counter:
                optimizers = make_optimizers(model)
                if prepare_optimizers is not None:
                    prepare_optimizers(optimizers)
                for step in range(steps):
                    counter.step = step
                    counter.phase = "forward"
                    with step_context() if step_context is not None else contextlib.nullcontext():
                        loss = step_fn(model, batch, step)
                    counter.phase = "zero_grad"
                    for optimizer in optimizers:
                        optimizer.zero_grad(set_to_none=True)
                    counter.phase = "backward"
                    backward_outside_torch_function(loss)  # CUDA modes stay on for checkpointed recomputes
                    del loss
                    counter.phase = "optimizer step"
                    for optimizer in optimizers:
                        optimizer.step()
                    for state in _optimizer_state_tensors(optimizers):
                        counter.relabel(state, "optimizer_states")
                    counter.phase = "setup"
            gradient_bytes = sum(
                counter._bytes(p.grad.untyped_storage().nbytes()) for p in trainable if p.grad is not None
            )
            states = {id(t.untyped_storage()): t for t in _optimizer_state_tensors(optimizers)}
            state_bytes = sum(counter._bytes(t.untyped_storage().nbytes()) for t in states.values())
            totals = dict(counter.peak_totals)
            if counter.peak_phase == "optimizer step":
                # states created by the peak's own optimizer step before the peak were still labelled as its temporaries
                for t in states.values():
                    info = counter.info(t)
                    if info is not None and info[3] == counter.peak_step and info[2] <= counter.peak_seq:
                        totals["optimizer step"] = totals.get("optimizer step", 0) - info[0]
                        totals["optimizer_states"] = totals.get("optimizer_states", 0) + info[0]
    except Exception as err:
        described = _describe_fake_failure(err) if fake else None
        if described is not None:
            raise described from err
        raise
    finally:
        for handle in handles:
            handle.remove()
    parts = dict.fromkeys(PEAK_PARTS, 0)
    for label, nbytes in totals.items():
        parts[_PHASE_PARTS.get(label, label)] += nbytes
    return StepCount(
        peak_bytes=counter.peak,
        peak_phase=counter.peak_phase,
        peak_step=counter.peak_step,
        at_peak=parts,
        parameter_bytes=parameter_bytes,
        trainable_parameter_bytes=trainable_bytes,
        buffer_bytes=buffer_bytes,
        gradient_bytes=gradient_bytes,
        optimizer_state_bytes=state_bytes,
        batch_bytes=batch_bytes,
        phase_peaks={k: v for k, v in counter.phase_peaks.items() if k in ("forward", "backward", "optimizer step")},
    )
