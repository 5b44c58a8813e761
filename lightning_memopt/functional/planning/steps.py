"""Training steps on a fake twin of the model, counted by :class:`~.counter.LiveBytes`."""

from __future__ import annotations

import bisect
import contextlib
import copy
import functools
import itertools
import os
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch._subclasses import fake_tensor
from torch.utils._pytree import tree_flatten, tree_map

from lightning_memopt.functional.planning.counter import LiveBytes, unique_storages
from lightning_memopt.functional.planning.known_values import KnownValues
from lightning_memopt.functional.planning.manual import CountedOptimizer, counted_backward
from lightning_memopt.utilities._torch_private import backward_outside_torch_function, uncounted_dtensor_metadata

__all__ = [
    "PEAK_PARTS",
    "FakeStepError",
    "StepCount",
    "count_evaluation_steps",
    "count_training_steps",
    "fake_tensor_of",
    "fake_twin",
]

#: What the bytes alive at the peak are, in the order they are reported.
PEAK_PARTS = ("parameters", "buffers", "batch", "gradients", "optimizer_states", "activations", "temporaries")

#: The part of the peak a storage counts as, by the phase that created it (other labels are parts already).
_PHASE_PARTS = {
    "forward": "activations",
    "backward": "temporaries",
    "optimizer step": "temporaries",
    "zero_grad": "temporaries",
    "setup": "temporaries",
    "scratch": "temporaries",
}

#: Why an operator cannot run on fake tensors, by the exception fake tensors raise.
_FAKE_FAILURES: dict[type[Exception], str] = {
    fake_tensor.DataDependentOutputException: "its output depends on the data (e.g. `.item()`, `.tolist()`, a Python"
    " `if` on a tensor)",
    fake_tensor.DynamicOutputShapeException: "its output shape depends on the data (e.g. `nonzero`, boolean masking,"
    " `unique`)",
    fake_tensor.UnsupportedOperatorException: "it has no fake (meta) implementation (a custom C++/CUDA op?)",
}
_FAKE_EXCEPTIONS: tuple[type[Exception], ...] = (*_FAKE_FAILURES, fake_tensor.UnsupportedFakeTensorException)
#: What torch says when C++ code reads the data of a fake tensor (one made inside a composite kernel).
_READS_FAKE_DATA = "its data is not allocated yet"
#: What a fake run catches to name: the failures above, and the RuntimeError of C++ code reading a fake's data.
_CAUGHT: tuple[type[Exception], ...] = (*_FAKE_EXCEPTIONS, RuntimeError)


class FakeStepError(RuntimeError):
    """A training step that cannot run on fake tensors (data-dependent shapes, ``.item()``, custom ops).

    Args:
        message: what failed, in words.
        op: the operator's name (e.g. ``"aten.nonzero.default"``), where one is to blame.
        where: the line of the step that asked for it (``file:line in function``), outside torch and this package.
        hint: the fix for a known case (torch's Transformer reading its mask), else ``None``; it ends in a comma, the
            fallback follows it.
    """

    def __init__(self, message: str, op: str | None = None, where: str | None = None, hint: str | None = None) -> None:
        super().__init__(message)
        self.op, self.where, self.hint = op, where, hint


#: Where torch and this package live: a failing frame outside them is the step's own (or its model library's).
_LIBRARY_DIRS = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
#: torch's Transformer layers compare their mask with a causal one by its values.
_CAUSAL_HINT = (
    "torch's Transformer compares the mask with a causal one by its values, which are not known here (the mask comes"
    " from the batch or the parameters): pass `is_causal=True` with a causal mask (`tgt_is_causal=True` /"
    " `src_is_causal=True` for nn.Transformer), build the mask in the step from its shape"
    " (`nn.Transformer.generate_square_subsequent_mask(L)`),"
)


_DISTRIBUTION_HINT = (
    "A torch.distributions object checks its arguments' values when it is built (`validate_args`), and they are not"
    " known here: pass `validate_args=False` to it (or call"
    " `torch.distributions.Distribution.set_default_validate_args(False)` before estimating),"
)


def _hint(frames: traceback.StackSummary) -> str | None:
    """The fix for a known check that reads values, by where it was asked for; ``None`` for any other."""
    if any(f.name == "_detect_is_causal_mask" for f in frames):
        return _CAUSAL_HINT
    if any(f.name == "__init__" and f"torch{os.sep}distributions{os.sep}" in f.filename for f in frames):
        return _DISTRIBUTION_HINT
    return None


def _where(err: BaseException) -> tuple[str | None, str | None]:
    """The innermost frame of ``err`` outside torch and this package (``file:line in function: `code```), and the hint
    for a known check."""
    frames = traceback.extract_tb(err.__traceback__)
    hint = _hint(frames)
    for frame in reversed(frames):
        if not frame.filename.startswith(_LIBRARY_DIRS):
            code = ""
            if frame.line:
                code = f": `{frame.line.strip()}`"
            return f"{frame.filename}:{frame.lineno} in {frame.name}{code}", hint
    return None, hint


@dataclass(frozen=True, kw_only=True)
class StepCount:
    """What :func:`count_training_steps` counted, in bytes.

    Attributes:
        peak_bytes: the most bytes alive at once.
        peak_phase: ``"forward"``, ``"zero_grad"``, ``"backward"`` or ``"optimizer step"``.
        peak_step: the step of the peak (counted from 0).
        at_peak: what the peak is made of, by :data:`PEAK_PARTS`; adds up to ``peak_bytes``.
        parameter_bytes / trainable_parameter_bytes / buffer_bytes / gradient_bytes / optimizer_state_bytes /
            batch_bytes: the totals after the last step.
        phase_peaks: the highest count seen in ``forward``, ``backward`` and ``optimizer step``.
        peak_micro_batch: the micro-batch of the peak within its optimizer step (0: the first, which starts from no
            gradients; 1: a later one, whose backward adds into the gradients kept since the first).
        accumulate_grad_batches: micro-batches per optimizer step.
        apart_peak_bytes: the peak of the bytes counted apart (``count_training_steps``' ``apart`` labels).
    """

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
    peak_micro_batch: int = 0
    accumulate_grad_batches: int = 1
    apart_peak_bytes: int = 0


class _StepBytes(LiveBytes):
    """:class:`LiveBytes` that also notes the micro-batch of the peak and, while ``passes`` is a :class:`_Passes`,
    what :class:`_StepLoop` needs to replay the step's passes."""

    micro_batch = 0
    peak_micro_batch = 0
    passes: _Passes | None = None
    #: every count of an optimizer step, with what it is made of and the last storage created by then
    moments: list[tuple[int, dict[str, int], int]] | None = None

    def _record(self, level: int, totals: dict[str, int]) -> None:
        before = self.peak
        super()._record(level, totals)
        if self.peak != before:
            self.peak_micro_batch = self.micro_batch
        if self.passes is not None:
            self.passes.note((self.micro_batch, self.phase), level, totals, self._seq)
        if self.moments is not None:
            self.moments.append((level, dict(totals), self._seq))

    def _relabelled(self, key: int, info: list[Any], label: str) -> None:
        if self.passes is not None:
            self.passes.relabels.append((key, info[2], info[0], info[1], label))


def _tensors(value: Any) -> list[Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, Tensor)]


def _optimizer_state_tensors(optimizers: list[torch.optim.Optimizer]) -> Iterator[Tensor]:
    for optimizer in optimizers:
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, Tensor):
                    yield value


def _fake_step_error(err: Exception) -> FakeStepError:
    where, hint = _where(err)
    at = f" It is asked for at {where}." if where else ""
    for kind, why in _FAKE_FAILURES.items():
        if isinstance(err, kind):
            op = str(getattr(err, "func", "?"))
            return FakeStepError(f"operator `{op}` cannot run on fake tensors: {why}.{at}", op, where, hint)
    if _READS_FAKE_DATA in str(err):
        why = "a C++ kernel reads the values of a fake tensor (`pad_packed_sequence` of a hand-built `PackedSequence`?)"
        return FakeStepError(f"the step cannot run on fake tensors: {why}.{at}", None, where, hint)
    return FakeStepError(f"the step cannot run on fake tensors: {err}{at}", None, where, hint)


def fake_tensor_of(tensor: Tensor, mode: Any) -> Tensor:
    """``tensor`` as a fake CPU tensor of ``mode``: a fake tensor of ``mode`` as it is, a meta tensor (shapes, no data)
    as a fake CPU tensor of its shape, stride and dtype, a real one through ``mode.from_tensor`` (no data copied).

    Nothing is allocated for a meta tensor of any size: ``lightning-memopt estimate`` builds its batches and the
    model on the meta device.

    Examples:
        >>> mode = fake_tensor.FakeTensorMode()
        >>> fake = fake_tensor_of(torch.empty(10**9, 4096, device="meta"), mode)  # 16 TB, never allocated
        >>> type(fake).__name__, fake.device.type, fake.shape[0]
        ('FakeTensor', 'cpu', 1000000000)
    """
    if getattr(tensor, "fake_mode", None) is mode:
        return tensor
    if tensor.device.type != "meta":
        return mode.from_tensor(tensor)
    with mode:
        fake = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="cpu")
    if tensor.is_leaf and tensor.requires_grad:
        return fake.requires_grad_(tensor.requires_grad)
    return fake


def fake_twin(module: nn.Module, mode: Any | None, dtype: torch.dtype | None = None) -> nn.Module:
    """A copy of ``module`` whose parameters and buffers are fake tensors of ``mode`` (no data copied).

    Tied weights stay tied; the module itself is not changed. Tensors a module holds as plain attributes (torchmetrics
    metric states) are faked too. Parameters and buffers that are fake already (a model
    built inside ``mode``) are used as they are. ``dtype`` casts the floating ones (``"bf16-true"``); with ``mode``
    ``None`` the copy holds real copies of the tensors. A model built on the meta device (``with torch.device("meta")``)
    gets fake CPU tensors of the same shapes: a large model can be estimated without ever holding its weights.

    Raises:
        FakeStepError: ``mode`` is ``None`` (a real copy) but the model is on the meta device.

    Examples:
        >>> twin = fake_twin(nn.Linear(4, 4), fake_tensor.FakeTensorMode())
        >>> type(twin.weight.data).__name__, twin.weight.shape
        ('FakeTensor', torch.Size([4, 4]))
    """
    memo: dict[int, Any] = {}
    for tensor in [*module.parameters(), *module.buffers()]:
        if id(tensor) not in memo:
            memo[id(tensor)] = _twin_tensor(tensor, mode, dtype)
    for tensor in _attribute_tensors(module):  # tensors held as plain attributes (torchmetrics states, defaults)
        if id(tensor) in memo:
            continue
        if mode is not None:
            memo[id(tensor)] = fake_tensor_of(tensor, mode)
        elif tensor.device.type != "meta":
            memo[id(tensor)] = tensor.detach().clone()
    return copy.deepcopy(module, memo)


def _copy_of(tensor: Tensor, mode: Any | None) -> Tensor:
    """A fake tensor of ``mode`` like ``tensor``; a real copy of it without ``mode``."""
    if mode is None:
        return tensor.detach().clone()
    return fake_tensor_of(tensor, mode)


def _twin_tensor(tensor: Tensor, mode: Any | None, dtype: torch.dtype | None) -> Tensor:
    """A parameter's or buffer's twin: fake (or a real copy without ``mode``), cast to ``dtype``, still a Parameter."""
    if tensor.device.type == "meta" and mode is None:
        raise FakeStepError(
            "a model on the meta device has no data to run a real step with; estimate it on fake tensors (fake=True)"
        )
    twin = _copy_of(tensor, mode)
    if dtype is not None and twin.is_floating_point():
        twin = twin.to(dtype)
    if isinstance(tensor, nn.Parameter) and not isinstance(twin, nn.Parameter):
        twin = nn.Parameter(twin, requires_grad=tensor.requires_grad)
    return twin


def _attribute_tensors(module: nn.Module) -> Iterator[Tensor]:
    """The tensors the modules hold as plain attributes (outside their parameters, buffers and submodules)."""
    for sub in module.modules():
        for name, value in vars(sub).items():
            if name not in ("_parameters", "_buffers", "_modules"):
                yield from (t for t in tree_flatten(value)[0] if isinstance(t, Tensor))


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
    outputs: Callable[[Any, tuple, dict, Any], Any] | None = None,
    prepare: Callable[[nn.Module], None] | None = None,
    step_context: Callable[[], contextlib.AbstractContextManager] | None = None,
    prepare_optimizers: Callable[[list[torch.optim.Optimizer]], None] | None = None,
    batch_fn: Callable[[Any], Any] | None = None,
    dtype: torch.dtype | None = None,
    accumulate_grad_batches: int = 1,
    manual: Callable[[nn.Module, list[CountedOptimizer], Callable[..., None]], None] | None = None,
    labels: Callable[[Any, tuple, dict], Iterable[tuple[Tensor, str]]] | None = None,
    apart: Iterable[str] = (),
    replay: bool = True,
) -> StepCount:
    """Run ``steps`` training steps in Lightning's order and count the bytes alive at every moment.

    Lightning's order is: ``step_fn`` (the training step), ``zero_grad(set_to_none=True)``, backward, the optimizer
    step; the previous step's gradients are alive during the next forward, and optimizer states appear at the first
    step, so two steps see every peak. With ``accumulate_grad_batches`` over 1 an optimizer step is made of that many
    micro-batches (forward, backward of the loss divided by it, as Lightning does); the first micro-batch's
    ``zero_grad`` frees the gradients, later ones add into them, so their backward holds the gradients and new ones
    at once. Micro-batches from the third on repeat the second's memory exactly: two per optimizer step are run.

    The second step runs the first's operators on tensors of the same sizes, so it is replayed rather than run
    (``replay``): its forward and backward are the first step's counts at each micro-batch and phase plus the
    optimizer states the first step created and, until the first ``zero_grad``, its gradients; its optimizer step is
    the first's counts with every state alive from the start. A first step that leaves anything else behind (a
    tensor kept for the next step) has its second step run, as has a manually optimized one or one with ``apart``
    labels.

    With ``manual``, the step is manually optimized: ``manual(model, optimizers, backward)`` is called once the
    optimizers exist, with :class:`CountedOptimizer` wrappers and a counted ``backward(loss, *args, **kwargs)``, to
    hand them to the step (``self.optimizers()``, ``self.manual_backward``); ``step_fn`` then runs the whole step and
    its return value is not used.

    Args:
        module: the model; never changed: a fake twin runs (``fake=False``: a real copy).
        batch: the batch (any nesting of tensors); with ``fake=True`` real tensors are faked (no data copied).
        step_fn: ``step_fn(model, batch, step_index) -> loss``.
        make_optimizers: builds the optimizers over the model that runs.
        fake: run on fake CPU tensors (no memory); ``False`` runs a real step on the CPU and counts its bytes.
        steps: training steps to run.
        block_bytes: round storages up to this many bytes.
        scratch: bytes a kernel holds inside itself (see :class:`LiveBytes`).
        outputs: corrects outputs a fake kernel returns smaller than the real one (see :class:`LiveBytes`).
        prepare: called with the model that runs, before counting (checkpointing, ``train()``).
        step_context: a fresh context around each step's ``step_fn`` (autocast).
        prepare_optimizers: called with the optimizers once they exist (e.g. :func:`use_foreach`).
        batch_fn: called with the (faked) batch before counting (e.g. a dtype cast).
        dtype: cast the model's floating parameters and buffers to it (``"bf16-true"``).
        accumulate_grad_batches: micro-batches per optimizer step (gradient accumulation).
        manual: binds the counted optimizers and backward to the model for a manually optimized step.
        labels: says what operators' arguments are (see :class:`LiveBytes`), e.g. FSDP2's collective buffers.
        apart: labels counted apart from the peak (see :class:`LiveBytes`), e.g. what CPU offload keeps on the host:
            their peak is ``StepCount.apart_peak_bytes``, and ``at_peak`` leaves them out.
        replay: replay the second step's passes where they repeat the first's (``False``: run every step).

    Returns:
        a :class:`StepCount`.

    Raises:
        FakeStepError: an operator of the step cannot run on fake tensors; the message names it.

    Examples:
        >>> model = nn.Linear(64, 64, bias=False)
        >>> count = count_training_steps(
        ...     model, torch.randn(32, 64), lambda m, b, i: m(b).sum(), lambda m: [torch.optim.SGD(m.parameters())]
        ... )
        >>> count.peak_bytes == 4 * (2 * 64 * 64 + 2 * 32 * 64) + 4, count.peak_phase  # W, its grad, x, y, the loss
        (True, 'forward')
    """
    counter = _StepBytes(block_bytes, scratch, outputs, labels, apart)
    loop = _StepLoop(counter, step_fn, steps, accumulate_grad_batches, step_context, manual, replay)
    handles: list[Any] = []
    try:
        with _ready(counter, module, batch, fake, dtype, prepare, batch_fn) as (model, batch, sizes):
            trainable = [p for p in model.parameters() if p.requires_grad]
            for p in trainable:
                handles.append(p.register_post_accumulate_grad_hook(lambda p: counter.relabel(p.grad, "gradients")))
            with counter, uncounted_dtensor_metadata(counter.pause, counter.resume):
                optimizers = make_optimizers(model)
                if prepare_optimizers is not None:
                    prepare_optimizers(optimizers)
                loop.run(model, batch, optimizers)
            return _step_count(counter, optimizers, trainable, sizes, loop.accumulate_grad_batches)
    finally:
        for handle in handles:
            handle.remove()


def count_evaluation_steps(
    module: nn.Module,
    batch: Any,
    step_fn: Callable[[nn.Module, Any, int], Any],
    *,
    fake: bool = True,
    steps: int = 2,
    block_bytes: int = 1,
    scratch: Callable[[Any, tuple, dict], int] | None = None,
    outputs: Callable[[Any, tuple, dict, Any], Any] | None = None,
    prepare: Callable[[nn.Module], None] | None = None,
    step_context: Callable[[], contextlib.AbstractContextManager] | None = None,
    batch_fn: Callable[[Any], Any] | None = None,
    dtype: torch.dtype | None = None,
    keep_outputs: bool = False,
) -> StepCount:
    """Run ``steps`` evaluation steps as Lightning's evaluation loops do and count the bytes alive at every moment.

    Each step is ``step_fn`` under ``torch.inference_mode()``, as Lightning's default ``Trainer(inference_mode=True)``
    runs it (no graph, no gradients, no optimizer; some kernels hold less than under ``no_grad``: the CPU's LSTM);
    its output lives to the end of the step, or with ``keep_outputs`` to the end of the run
    (``trainer.predict`` keeps every batch's predictions, on the CPU). The arguments are
    :func:`count_training_steps`'s; ``prepare`` puts the model in eval mode.

    Returns:
        a :class:`StepCount` with no gradients or optimizer states; ``peak_phase`` is ``"forward"``.

    Raises:
        FakeStepError: an operator of the step cannot run on fake tensors; the message names it.

    Examples:
        >>> model = nn.Linear(64, 64, bias=False)
        >>> count = count_evaluation_steps(model, torch.randn(32, 64), lambda m, b, i: m(b))
        >>> count.peak_bytes == 4 * (64 * 64 + 2 * 32 * 64), count.gradient_bytes  # W, x and y
        (True, 0)
    """
    counter = _StepBytes(block_bytes, scratch, outputs)
    kept: list[Any] = []
    context = step_context or contextlib.nullcontext
    with _ready(counter, module, batch, fake, dtype, prepare, batch_fn) as (model, batch, sizes):
        with counter, uncounted_dtensor_metadata(counter.pause, counter.resume), torch.inference_mode():
            for step in range(steps):
                counter.step, counter.phase = step, "forward"
                with context():
                    out = step_fn(model, batch, step)
                if keep_outputs:
                    kept.append(out)
                del out
                counter.phase = "setup"
        return _step_count(counter, [], [], sizes, 1)


@contextlib.contextmanager
def _ready(
    counter: LiveBytes,
    module: nn.Module,
    batch: Any,
    fake: bool,
    dtype: torch.dtype | None,
    prepare: Callable[[nn.Module], None] | None,
    batch_fn: Callable[[Any], Any] | None,
) -> Iterator[tuple[nn.Module, Any, dict[str, int]]]:
    """The model and batch a counted run steps, in their fake mode (a real copy with ``fake=False``): prepared, the
    batch cast, the inputs tracked by ``counter`` (which runs every operator through :class:`KnownValues`); yields
    ``(model, batch, sizes)``. An operator that cannot run on fake tensors is raised as a :class:`FakeStepError`."""
    given = batch
    mode, batch = _fake_batch(batch, fake)
    known = _known_values(mode, given, batch)
    counter.run = known.run if known else None
    if known is not None:
        counter.uncounted = known.constants  # a real constant is there before the step, as in the real one
    model = fake_twin(module, mode, dtype)  # with fake=False a real copy: the user's module is never trained
    if known is not None:
        _remember_integer_buffers(known, module, model)
    try:
        with _mode_or_nothing(mode), _library_checks(known):
            if prepare is not None:
                prepare(model)
            if batch_fn is not None:
                batch = batch_fn(batch)
            yield model, batch, _track_inputs(counter, model, batch)
    except _CAUGHT as err:
        if not fake or not (isinstance(err, _FAKE_EXCEPTIONS) or _READS_FAKE_DATA in str(err)):
            raise
        raise _fake_step_error(err) from err


def _remember_integer_buffers(known: KnownValues, module: nn.Module, twin: nn.Module) -> None:
    """The module's integer and boolean buffers on the CPU (BatchNorm's ``num_batches_tracked``, position ids) are
    known in the twin: a step that reads them gets their values."""
    twins = dict(twin.named_buffers())
    for name, real in module.named_buffers():
        fake = twins.get(name)
        if fake is not None and real.device.type == "cpu" and not (real.is_floating_point() or real.is_complex()):
            known.remember(fake, real)


def _mode_or_nothing(mode: Any) -> contextlib.AbstractContextManager[Any]:
    """The fake tensor mode to run in; a context that does nothing for a real run (``None``)."""
    if mode is not None:
        return mode
    return contextlib.nullcontext()


def _library_checks(known: KnownValues | None) -> contextlib.AbstractContextManager[Any]:
    """``known``'s answers to the library checks fake tensors cannot answer; nothing for a real run (``None``)."""
    if known:
        return known.library_checks()
    return contextlib.nullcontext()


def _fake_leaf(value: Any, mode: Any) -> Any:
    """A tensor of a batch as a fake tensor of ``mode``; any other value as it is."""
    if isinstance(value, Tensor):
        return fake_tensor_of(value, mode)
    return value


def _fake_batch(batch: Any, fake: bool) -> tuple[Any, Any]:
    """The fake tensor mode (``None`` for a real step) and the batch in it."""
    if not fake:
        if any(t.device.type == "meta" for t in _tensors(batch)):
            raise FakeStepError(
                "a batch on the meta device has no data to run a real step with; estimate it on fake tensors"
            )
        return None, batch
    # a real tensor the step reads from outside the module (a module-level constant, a captured `pos_weight`) is a
    # constant, there before the step as in the real one: faked where it is used, its bytes not the step's
    mode = fake_tensor.FakeTensorMode(allow_non_fake_inputs=True)
    return mode, tree_map(functools.partial(_fake_leaf, mode=mode), batch)


def _known_values(mode: Any, given: Any, batch: Any) -> KnownValues | None:
    """:class:`KnownValues` for a fake run (the batch's integer and boolean tensors known: ids, masks, lengths) that
    the counter runs every operator through; ``None`` for a real run."""
    if mode is None:
        return None
    known = KnownValues(mode)
    for real, twin in zip(tree_flatten(given)[0], tree_flatten(batch)[0]):
        if isinstance(real, Tensor) and real.device.type == "cpu" and not real.is_floating_point():
            known.remember(twin, real)
    return known


def _track_inputs(counter: LiveBytes, model: nn.Module, batch: Any) -> dict[str, int]:
    """Label the parameters, buffers and batch; their sizes before the steps run (forward may replace buffers)."""
    params = list(model.parameters())
    for p in params:
        counter.track(p, "parameters")
    for b in model.buffers():
        counter.track(b, "buffers")
    for t in _tensors(batch):
        counter.track(t, "batch")
    return {
        "parameter_bytes": sum(counter.storage_bytes(p) for p in unique_storages(params)),
        "trainable_parameter_bytes": sum(
            counter.storage_bytes(p) for p in unique_storages([p for p in params if p.requires_grad])
        ),
        "buffer_bytes": sum(counter.storage_bytes(b) for b in model.buffers()),
        "batch_bytes": sum(counter.storage_bytes(t) for t in unique_storages(_tensors(batch))),
    }


def _step_count(
    counter: _StepBytes,
    optimizers: list[torch.optim.Optimizer],
    trainable: Sequence[Tensor],
    sizes: dict[str, int],
    accumulate_grad_batches: int,
) -> StepCount:
    states = unique_storages(_optimizer_state_tensors(optimizers))
    return StepCount(
        peak_bytes=counter.peak,
        peak_phase=counter.peak_phase,
        peak_step=counter.peak_step,
        at_peak=_parts_at_peak(counter, states),
        # FSDP2's sharded gradients are views of one flat buffer per unit: each storage once
        gradient_bytes=sum(
            counter.storage_bytes(g) for g in unique_storages([p.grad for p in trainable if p.grad is not None])
        ),
        optimizer_state_bytes=sum(counter.storage_bytes(t) for t in states),
        phase_peaks={k: v for k, v in counter.phase_peaks.items() if k in ("forward", "backward", "optimizer step")},
        peak_micro_batch=counter.peak_micro_batch,
        accumulate_grad_batches=accumulate_grad_batches,
        apart_peak_bytes=counter.apart_peak,
        **sizes,
    )


class _StepLoop:
    """Lightning's order of a training step, run on a counted model (see :func:`count_training_steps`)."""

    def __init__(
        self,
        counter: _StepBytes,
        step_fn: Callable[[nn.Module, Any, int], Tensor],
        steps: int,
        accumulate_grad_batches: int,
        step_context: Callable[[], contextlib.AbstractContextManager] | None,
        manual: Callable[[nn.Module, list[CountedOptimizer], Callable[..., None]], None] | None,
        replay: bool = True,
    ) -> None:
        self.counter, self.step_fn, self.steps, self.replay = counter, step_fn, steps, replay
        self.step_context = step_context or contextlib.nullcontext
        self.manual = manual
        #: micro-batches per optimizer step (a manually optimized step does its own)
        self.accumulate_grad_batches = 1 if manual is not None else accumulate_grad_batches
        self._scale = accumulate_grad_batches  # the index of a step's first batch counts every micro-batch
        self.micro_batches = min(self.accumulate_grad_batches, 2)  # from the third on they repeat the second

    def run(self, model: nn.Module, batch: Any, optimizers: list[torch.optim.Optimizer]) -> None:
        counter = self.counter
        label_states = functools.partial(_label_states, counter, optimizers)
        if self.manual is not None:
            counted = [CountedOptimizer(o, counter, label_states) for o in optimizers]
            self.manual(model, counted, functools.partial(counted_backward, counter))
        replay = self.replay and self.manual is None and self.steps > 1 and not counter.apart
        first: _Passes | None = None
        moments: list[tuple[int, dict[str, int], int]] = []  # the first optimizer step's counts
        for step in range(self.steps):
            counter.step = step
            replayed = first is not None and self._replayed(first)
            if not replayed:
                first = _Passes(dict(counter.totals))
                counter.passes = first if replay and step == 0 else None
                for micro_batch in range(self.micro_batches):
                    self._micro_batch(model, batch, optimizers, step, micro_batch)
                counter.passes = None
            if replayed:
                self._replay_optimizer_step(moments, optimizers)
            elif self.manual is None:
                counter.phase = "optimizer step"
                counter.moments = [] if replay and step == 0 else None
                for optimizer in optimizers:
                    optimizer.step()
                label_states()
                moments, counter.moments = counter.moments or [], None
            counter.phase = "setup"
            if step > 0 or not replay:
                first = None

    def _replay_optimizer_step(
        self, moments: list[tuple[int, dict[str, int], int]], optimizers: list[torch.optim.Optimizer]
    ) -> None:
        """Count the second optimizer step from the first's counts: the same operators, with every optimizer state
        alive from the start (the first step created them as it went, counted as its temporaries until then)."""
        counter = self.counter
        created = sorted(
            (info[2], info[0])
            for info in map(counter.info, unique_storages(_optimizer_state_tensors(optimizers)))
            if info is not None
        )
        when = [seq for seq, _ in created]
        made_by = [0, *itertools.accumulate(nbytes for _, nbytes in created)]  # states made by the k-th creation
        states = made_by[-1]
        counter.phase = "optimizer step"
        for level, totals, seq in moments:
            made = made_by[bisect.bisect_right(when, seq)]
            totals = dict(totals)
            totals["optimizer step"] = totals.get("optimizer step", 0) - made
            totals["optimizer_states"] = totals.get("optimizer_states", 0) + made
            totals["optimizer_states"] += states - made
            counter._record(level - made + states, totals)

    def _replayed(self, first: _Passes) -> bool:
        """Count the second step's forward and backward passes without running them, if the first step left only
        optimizer states and gradients: the first step's counts, with those states alive throughout and its
        gradients alive until the first micro-batch's ``zero_grad`` frees them (see :class:`_Passes`); whether it
        did (the optimizer step is then replayed too: :meth:`_replay_optimizer_step`). Halves the operators an
        estimate runs."""
        counter = self.counter
        carried = first.carried(counter.totals)
        if carried is None:
            return False
        for micro_batch, phase in list(first.peaks):
            extra = dict(carried)
            if micro_batch > 0 or phase != "forward":  # after the first zero_grad: the old gradients are gone
                extra.pop("gradients", None)
            totals = first.totals_then((micro_batch, phase), counter._info)
            for label, nbytes in extra.items():
                totals[label] = totals.get(label, 0) + nbytes
            counter.micro_batch, counter.phase = micro_batch, phase
            counter._record(first.peaks[micro_batch, phase][0] + sum(extra.values()), totals)
        return True

    def _micro_batch(
        self, model: nn.Module, batch: Any, optimizers: list[torch.optim.Optimizer], step: int, micro_batch: int
    ) -> None:
        counter = self.counter
        counter.micro_batch = micro_batch
        counter.phase = "forward"
        with self.step_context():
            loss = self.step_fn(model, batch, step * self._scale + micro_batch)
            if self.accumulate_grad_batches > 1:
                loss = loss / self.accumulate_grad_batches  # Lightning's normalised closure loss
        if self.manual is not None:
            del loss  # the step optimized itself
            return
        if micro_batch == 0:  # Lightning zeroes the gradients at the first micro-batch only
            counter.phase = "zero_grad"
            for optimizer in optimizers:
                optimizer.zero_grad(set_to_none=True)
        counter.phase = "backward"
        backward_outside_torch_function(loss)  # CUDA modes stay on for checkpointed recomputes
        del loss


#: What a training step leaves to the next one when it keeps nothing else.
_CARRIED = ("optimizer_states", "gradients")


@dataclass
class _Passes:
    """The first training step's passes, for :meth:`_StepLoop._replay_passes`: the totals by label before them; per
    (micro-batch, phase) their highest count, what it was made of, the last storage created by then and how many
    relabels had happened; and the relabels, as ``(key, creation number, bytes, old label, new label)``.

    A later step runs the same operators on tensors of the same sizes. What differs is what the first step left: its
    optimizer states (alive throughout the next step), its gradients (alive until the next step's first
    ``zero_grad``), and the labels of the storages it made to keep (FSDP2's all-gather outputs are made as
    activations and said to be unsharded parameters once filled). Anything else it kept (a cache filled once) is in
    its own counts from the moment it was made."""

    started: dict[str, int]
    peaks: dict[tuple[int, str], tuple[int, dict[str, int], int, int]] = field(default_factory=dict)
    relabels: list[tuple[int, int, int, str, str]] = field(default_factory=list)

    def note(self, key: tuple[int, str], level: int, totals: dict[str, int], seq: int) -> None:
        """A count during the passes: kept if it is the highest of its (micro-batch, phase)."""
        if level > self.peaks.get(key, (-1,))[0]:
            self.peaks[key] = (level, dict(totals), seq, len(self.relabels))

    def carried(self, now: dict[str, int]) -> dict[str, int] | None:
        """The bytes of optimizer states and gradients alive now (the step's end) that were not before its passes;
        ``None`` when the step left anything else (a tensor kept to the next step, replaced there: not replayed)."""
        grown = {label: now.get(label, 0) - self.started.get(label, 0) for label in {*now, *self.started}}
        if any(nbytes for label, nbytes in grown.items() if label not in _CARRIED):
            return None
        return {label: grown[label] for label in _CARRIED if grown.get(label, 0) > 0}

    def totals_then(self, key: tuple[int, str], alive: dict[int, list[Any]]) -> dict[str, int]:
        """What the highest count of ``key`` was made of, with the labels given since to storages that are still
        alive (``alive``: the counter's storages)."""
        _, totals, seq, seen = self.peaks[key]
        totals = dict(totals)
        for storage, created, nbytes, old, new in self.relabels[seen:]:
            info = alive.get(storage)
            if created <= seq and info is not None and info[2] == created:
                moved = min(nbytes, totals.get(old, 0))
                totals[old] = totals.get(old, 0) - moved
                totals[new] = totals.get(new, 0) + moved
        return totals


def _label_states(counter: LiveBytes, optimizers: list[torch.optim.Optimizer]) -> None:
    for state in _optimizer_state_tensors(optimizers):
        counter.relabel(state, "optimizer_states")


def _parts_at_peak(counter: LiveBytes, states: list[Tensor]) -> dict[str, int]:
    """The peak's bytes by :data:`PEAK_PARTS` (a storage's phase label says which part it is)."""
    totals = dict(counter.peak_totals)
    if counter.peak_phase == "optimizer step":
        # states created by the peak's own optimizer step before the peak were still labelled as its temporaries
        for t in states:
            info = counter.info(t)
            if info is not None and info[3] == counter.peak_step and info[2] <= counter.peak_seq:
                totals["optimizer step"] = totals.get("optimizer step", 0) - info[0]
                totals["optimizer_states"] = totals.get("optimizer_states", 0) + info[0]
    parts = dict.fromkeys(PEAK_PARTS, 0)
    for label, nbytes in totals.items():
        if label not in counter.apart:
            part = _PHASE_PARTS.get(label, label)
            parts[part] = parts.get(part, 0) + nbytes
    return parts
