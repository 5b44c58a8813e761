"""Kernels whose fake (meta) implementation reports fewer bytes than the real kernel holds, and their corrections.

A fake run counts the storages each operator returns. Most fake kernels return exactly what the real one does; the
ones below do not, found by running every zoo model (and GRU, bidirectional / multi-layer LSTM, convolution,
embedding, layer-norm and attention variants) once on fake and once on real CPU tensors with the same live-storage
counter and comparing operator by operator (``tests/test_planner_kernels.py`` keeps the comparison):

* ``aten.mkldnn_rnn_layer`` (``nn.LSTM`` on the CPU with grad mode on; one call per layer and direction): the fake
  kernel returns a workspace of 0 bytes; the real one returns oneDNN's LSTM workspace, saved for backward (about
  40 x ``T x B x max(I, H)`` bytes in fp32). Corrected exactly, fp32 and bf16: :func:`onednn_lstm_workspace_bytes`.
* The same operator for a CUDA target, where ``_cudnn_rnn`` runs instead: cuDNN's reserve space, saved for backward.
  Approximated, unverified on a GPU: :func:`cudnn_rnn_reserve_bytes`.
* ``aten._softmax``, ``aten._log_softmax`` and their backward: a contiguous copy of a non-contiguous input (and
  gradient) inside the kernel, counted while it runs: :func:`~.counter.kernel_scratch`.
* ``aten.native_batch_norm`` (and ``_native_batch_norm_legit``), ``aten.native_layer_norm``,
  ``aten.native_group_norm`` with a float16/bfloat16 input and float32 weights (mixed precision, e.g. a BatchNorm
  after a convolution under bf16 autocast): the fake kernel returns the saved mean and inverse standard deviation in
  the input's dtype, the real kernel in float32. Corrected exactly (the CPU; CUDA's kernels keep float32 too).
* ``aten.mse_loss`` and ``aten.smooth_l1_loss`` reduced (mean or sum): the real kernel reduces into the elementwise
  loss's storage, so the scalar it returns holds the broadcast inputs' size; the fake kernel's holds one element.
  Corrected exactly on the CPU (a distillation loss onto a frozen teacher was up to 28 % low); ``l1_loss`` and
  ``huber_loss`` return a scalar of their own.
* ``aten._embedding_bag`` (and its forward-only and ``padding_idx`` forms): the real kernel makes ``offset2bag`` one
  element longer than it returns (an ``EmbeddingBag`` in mean or max mode was 8 bytes low); corrected exactly.
* ``scaled_dot_product_attention`` for a CUDA target: the CPU runs its own kernels (math, with the ``L x L`` scores,
  whenever there is a mask or dropout); CUDA's dispatcher picks flash, memory-efficient or math by dtype, mask and
  GPU: :func:`~.attention.cuda_attention`.

Operators compared and found exact on torch 2.13 (fake == real to the byte over training steps in fp32 and
bf16-mixed): ``nn.GRU``, ``nn.RNN`` and the cells (native CPU kernels, no workspace), ``nn.LSTM`` with ``proj_size``
(native), 1-3d and transposed convolutions, grouped convolutions, batch / instance / group / layer / RMS norm in one
dtype, pooling, interpolation, pixel shuffle, embedding (``padding_idx``, ``max_norm``),
multi-head and scaled-dot-product attention (math and flash CPU kernels), GELU / SiLU / softplus, cross entropy,
dropout. ``ctc_loss`` cannot run on fake tensors (data-dependent shapes): the estimate says so and names the fallback.

A correction replaces what the fake kernel returned with a fake tensor of the real size, so autograd saves it for
backward and frees it with the graph, as the real one is.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["KernelOutputs", "cudnn_rnn_reserve_bytes", "fake_kernel_outputs", "onednn_lstm_workspace_bytes"]

_PAGE = 4096
#: Gates of each cuDNN RNN mode (torch's ``mode`` argument: 0 relu, 1 tanh, 2 LSTM, 3 GRU).
_CUDNN_GATES = {0: 1, 1: 1, 2: 4, 3: 3}


def _page(nbytes: int) -> int:
    return -(-nbytes // _PAGE) * _PAGE


def _good_ld(dim: int, element_size: int) -> int:
    """oneDNN's leading dimension for a GEMM operand: 64-byte aligned, never a multiple of 256 elements."""
    step = 64 // element_size
    ld = -(-dim // step) * step
    return ld + step if ld % 256 == 0 else ld


def onednn_lstm_workspace_bytes(time: int, batch: int, input_size: int, hidden_size: int, element_size: int = 4) -> int:
    """Bytes of the workspace oneDNN's LSTM forward keeps for backward: one layer, one direction (one
    ``aten.mkldnn_rnn_layer`` call, which torch makes per layer and direction when grad mode is on).

    oneDNN (``cpu/rnn/rnn_utils``) lays the workspace out as page-aligned (4 KiB) parts: the gates
    (``T x B x 4H``), the hidden outputs (``T x B x H``), the layer states (``2 x (T + 1) x B x max(I, H)``), the cell
    states (``2 x (T + 1) x B x H``), each in the input's precision, and the gradient buffers of the layer, iteration
    and cell states in float32; leading dimensions padded as oneDNN pads GEMM operands. Checked against the real
    kernel of torch 2.13 on 80 random shapes in float32 and bfloat16 (``tests/test_planner_kernels.py``).

    Args:
        time: sequence length ``T``.
        batch: batch size ``B``.
        input_size: features of the layer's input ``I`` (``2 H`` above a bidirectional layer).
        hidden_size: ``H``.
        element_size: bytes per element of the input (4: float32; 2: bfloat16/float16).

    Examples:
        >>> onednn_lstm_workspace_bytes(16, 8, 24, 32)  # one layer of the zoo's LSTM at batch 8: 65 pages
        266240
    """
    es = element_size
    states = _good_ld(max(input_size, hidden_size), es)
    diff_states = _good_ld(max(input_size, hidden_size), 4)
    rows = 2 * (time + 1) * batch
    parts = (
        time * batch * _good_ld(4 * hidden_size, es) * es,  # gates
        time * batch * _good_ld(hidden_size, es) * es,  # hidden outputs
        rows * states * es,  # layer (and iteration) states
        rows * hidden_size * es,  # cell states
        rows * diff_states * 4,  # gradients of the layer states
        rows * diff_states * 4,  # gradients of the iteration states
        rows * hidden_size * 4,  # gradients of the cell states
    )
    return sum(_page(p) for p in parts)


def cudnn_rnn_reserve_bytes(time: int, batch: int, hidden_size: int, gates: int = 4, element_size: int = 4) -> int:
    """An approximation of cuDNN's RNN reserve space for one layer and direction (UNVERIFIED: no GPU measured it).

    ``_cudnn_rnn`` (``aten/src/ATen/native/cudnn/RNN.cpp``) returns a reserve buffer of
    ``cudnnGetRNNTrainingReserveSize`` bytes and saves it for backward. cuDNN does not document that size. Modelled
    as what backward needs from each step: the gate activations (``gates x H``), the hidden output and, for an LSTM,
    the cell state, in the input's precision: ``T x B x (gates + 2) x H`` elements, rounded to 512-byte blocks.
    The fake CPU run counts the per-layer outputs besides (cuDNN keeps the inner layers' outputs in the reserve),
    so this errs high by about one ``T x B x H`` per inner layer.

    Args:
        time: sequence length.
        batch: batch size.
        hidden_size: ``H``.
        gates: 4 for an LSTM, 3 for a GRU, 1 for a plain RNN.
        element_size: bytes per element of the input.

    Examples:
        >>> cudnn_rnn_reserve_bytes(16, 8, 32)  # 16 x 8 x 6 x 32 floats
        98304
    """
    nbytes = time * batch * (gates + 2) * hidden_size * element_size
    return -(-nbytes // 512) * 512


def _named(func: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    names = [a.name for a in func._schema.arguments]
    return {**dict(zip(names, args)), **kwargs}


def _grown(tensor: Tensor, nbytes: int) -> Tensor:
    """A tensor like ``tensor`` (fake where it is fake) of ``nbytes`` bytes."""
    return torch.empty(nbytes // tensor.element_size(), dtype=tensor.dtype, device=tensor.device)


#: Normalizations whose outputs 1 and 2 are the saved mean and inverse standard deviation.
_NORMS = (
    "native_batch_norm",
    "_native_batch_norm_legit",
    "_native_batch_norm_legit_no_training",
    "native_layer_norm",
    "native_group_norm",
)


def _float32_statistic(t: Tensor) -> Tensor:
    """``t`` when it is float32 already, else an empty float32 tensor of its shape."""
    if t.dtype == torch.float32:
        return t
    return torch.empty(t.shape, dtype=torch.float32)


def _norm_statistics(func: Any, args: tuple, kwargs: dict, out: Any) -> Any:
    """A half-precision input normalized with float32 weights (mixed precision): the kernel keeps its mean and
    inverse standard deviation in float32 (the fake kernel: in the input's dtype)."""
    a = _named(func, args, kwargs)
    x, weight = a.get("input"), a.get("weight")
    if not (isinstance(x, Tensor) and isinstance(weight, Tensor) and isinstance(out, tuple) and len(out) >= 3):
        return out
    if x.dtype not in (torch.float16, torch.bfloat16) or weight.dtype != torch.float32:
        return out
    stats = [_float32_statistic(t) for t in out[1:3]]
    return (out[0], *stats, *out[3:])


#: What each correction says in an estimate's assumptions, by target.
_SAID = {
    ("rnn", "cpu"): "nn.LSTM: oneDNN's workspace counted per layer and direction (the fake kernel reports none)",
    ("rnn", "cuda"): "nn.LSTM: cuDNN's reserve space approximated as T x B x (gates + 2) x H per layer and direction"
    " (cuDNN does not document it; not measured on a GPU)",
    ("norm", "cpu"): "mixed-precision batch/layer/group norm: mean and inverse std kept in float32",
    ("norm", "cuda"): "mixed-precision batch/layer/group norm: mean and inverse std kept in float32",
    ("loss", "cpu"): "mse_loss/smooth_l1_loss reduced to a scalar that keeps the unreduced loss's storage",
    ("loss", "cuda"): "mse_loss/smooth_l1_loss reduced to a scalar that keeps the unreduced loss's storage (the CPU's"
    " kernel; the same ATen code on CUDA, not measured on a GPU)",
}

#: Embedding bags, whose output 1 (``offset2bag``, each index's bag) the real kernel makes one element longer and trims.
_EMBEDDING_BAGS = ("_embedding_bag", "_embedding_bag_forward_only", "embedding_bag")


def _offset2bag(out: Any) -> Any:
    """An embedding bag's outputs with ``offset2bag`` in a storage one element longer than its size, as the real
    kernel leaves it (the fake kernel: exactly its size)."""
    if not (isinstance(out, tuple) and len(out) == 4 and isinstance(out[1], Tensor)):
        return out
    bags = out[1]
    size = bags.numel()
    if size == 0 or bags.untyped_storage().nbytes() > size * bags.element_size():
        return out
    longer = torch.empty(size + 1, dtype=bags.dtype, device=bags.device)[:size]
    return (out[0], longer, *out[2:])


#: Losses whose reduced (mean or sum) output, a scalar, keeps the storage of the elementwise loss it was reduced from.
_REDUCED_IN_PLACE = ("mse_loss", "smooth_l1_loss")


def _reduced_loss(func: Any, args: tuple, kwargs: dict, out: Any) -> Any:
    """The scalar of a reduced ``mse_loss``/``smooth_l1_loss`` with the storage the real kernel gives it: the
    elementwise loss's, of the broadcast inputs' size (the fake kernel: one element)."""
    a = _named(func, args, kwargs)
    x, target = a.get("self"), a.get("target")
    if not (isinstance(out, Tensor) and isinstance(x, Tensor) and isinstance(target, Tensor)) or out.dim() != 0:
        return out
    nbytes = torch.broadcast_shapes(x.shape, target.shape).numel() * out.element_size()
    if out.untyped_storage().nbytes() >= nbytes:
        return out
    return torch.empty(nbytes // out.element_size(), dtype=out.dtype, device=out.device)[0]  # its first element


class KernelOutputs:
    """``fix(op, args, kwargs, out) -> out``: the outputs of ``op`` with the sizes the real kernel gives them.

    For :class:`~.counter.LiveBytes` (``outputs=``): an output the fake kernel returned smaller than the real one is
    replaced by a tensor of the real size before it is counted; real outputs (already that size) are left alone.
    :attr:`applied` counts the corrections made, by kind (``"rnn"``, ``"norm"``); :meth:`assumptions` says them.

    Args:
        target: ``"cpu"`` (oneDNN's LSTM workspace) or ``"cuda"`` (cuDNN's reserve space instead).
    """

    def __init__(self, target: str = "cpu") -> None:
        if target not in ("cpu", "cuda"):
            raise ValueError(f"`target` must be 'cpu' or 'cuda', got {target!r}.")
        self.target = target
        self.applied: dict[str, int] = {}
        aten = torch.ops.aten
        self._rnn_layer = getattr(aten, "mkldnn_rnn_layer", None)
        self._norms = {getattr(aten, name, None) for name in _NORMS} - {None}
        self._losses = {getattr(aten, name, None) for name in _REDUCED_IN_PLACE} - {None}
        self._bags = {getattr(aten, name, None) for name in _EMBEDDING_BAGS} - {None}

    def assumptions(self) -> list[str]:
        """The corrections made, in words (for an estimate's assumptions)."""
        return [f"{_SAID[kind, self.target]} (x{n})" for kind, n in sorted(self.applied.items())]

    def _count(self, kind: str) -> None:
        self.applied[kind] = self.applied.get(kind, 0) + 1

    def __call__(self, func: Any, args: tuple, kwargs: dict, out: Any) -> Any:
        packet = getattr(func, "overloadpacket", None)
        if packet in self._norms:
            fixed = _norm_statistics(func, args, kwargs, out)
            if fixed is not out:
                self._count("norm")
            return fixed
        if packet in self._losses:
            fixed = _reduced_loss(func, args, kwargs, out)
            if fixed is not out:
                self._count("loss")
            return fixed
        if packet in self._bags:
            return _offset2bag(out)
        if self._rnn_layer is None or packet is not self._rnn_layer:
            return out
        workspace = out[3] if isinstance(out, tuple) and len(out) == 4 else None
        a = _named(func, args, kwargs)
        if not isinstance(workspace, Tensor) or not a.get("train", False):
            return out
        x, hidden = a["input"], int(a["hidden_size"])
        time, batch = x.shape[0], x.shape[1]  # time-major here, whatever ``batch_first`` says
        if self.target == "cpu":
            nbytes = onednn_lstm_workspace_bytes(time, batch, x.shape[-1], hidden, x.element_size())
        else:
            gates = _CUDNN_GATES.get(int(a["mode"]), 4)
            nbytes = cudnn_rnn_reserve_bytes(time, batch, hidden, gates, x.element_size())
        if workspace.untyped_storage().nbytes() >= nbytes:
            return out
        self._count("rnn")
        return (*out[:3], _grown(workspace, nbytes))


def fake_kernel_outputs(target: str = "cpu") -> KernelOutputs:
    """The corrections of fake kernel outputs for ``target`` (``"cpu"`` or ``"cuda"``): a :class:`KernelOutputs`.

    Examples:
        >>> from torch._subclasses.fake_tensor import FakeTensorMode
        >>> fix = fake_kernel_outputs("cpu")
        >>> with FakeTensorMode():
        ...     lstm, x = torch.nn.LSTM(24, 32), torch.randn(16, 8, 24)
        ...     w = lstm.weight_ih_l0, lstm.weight_hh_l0, lstm.bias_ih_l0, lstm.bias_hh_l0
        ...     h = torch.zeros(8, 32)
        ...     op = torch.ops.aten.mkldnn_rnn_layer.default
        ...     args = (x, *w, h, h, False, [], 2, 32, 1, True, False, False, True)
        ...     out = op(*args)
        ...     out[3].numel(), fix(op, args, {}, out)[3].numel()
        (0, 266240)
        >>> fix.applied
        {'rnn': 1}
    """
    return KernelOutputs(target)
