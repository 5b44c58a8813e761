"""Real values beside fake tensors that depend on no data, so a step's small checks on them get the real answer.

A fake tensor has a shape and no data, so ``torch.equal(mask, causal)``, ``mask.any().item()`` or ``nonzero`` cannot
run on one. Many such checks in torch and Hugging Face code read tensors the step built from shapes alone (a causal
mask from ``torch.triu(torch.ones(L, L))``, positions from ``arange``) or from the batch's integer tensors (token ids,
attention masks, lengths). :class:`KnownValues` computes those tensors for real beside their fake twins and answers
the checks from them; a tensor that depends on parameters or on random numbers stays unknown, and a check on it still
fails as before.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor
from torch._subclasses import fake_tensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass_type
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from lightning_memopt.utilities._torch_private import (
    active_fake_mode,
    outside_fake_mode,
    without_subclass_functions,
)

__all__ = ["KNOWN_NUMEL_LIMIT", "KnownValues"]

#: The most elements a known tensor may have (64 MiB of float32): a larger one is left unknown.
KNOWN_NUMEL_LIMIT = 1 << 24

aten = torch.ops.aten
#: Operators whose output holds no values yet.
_UNINITIALISED = frozenset(
    {aten.empty, aten.empty_like, aten.empty_strided, aten.new_empty, aten.new_empty_strided, aten.empty_permuted}
)
#: Operators that index by a list of tensors (argument 1), where a boolean mask stands for the positions it holds.
_INDEXING = frozenset({aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_})
#: In-place operators that overwrite the whole of their first argument, whatever it held.
_OVERWRITES = frozenset({aten.fill_, aten.zero_, aten.copy_})
#: Operators that reorganise a sequence's data by its lengths' values: how many leading dimensions of the data
#: (argument 0) they reorganise; the rest (the features) they carry over.
_PACKING = {aten._pack_padded_sequence: 2, aten._pad_packed_sequence: 1}
#: How a tensor literal (``torch.tensor(0.0)``) enters a fake mode: new memory, not a constant read.
_LITERALS = frozenset({aten.lift_fresh.default, aten.lift_fresh_copy.default})
#: What fake tensors raise for a check they cannot answer; a known tensor answers it.
_NEEDS_VALUES = (fake_tensor.DataDependentOutputException, fake_tensor.DynamicOutputShapeException)


@functools.cache
def _computable(func: Any) -> bool:
    """Whether ``func``'s output is a function of its arguments (not random, not uninitialised)."""
    return func.overloadpacket not in _UNINITIALISED and torch.Tag.nondeterministic_seeded not in func.tags


@functools.cache
def _written(func: Any) -> tuple[int, ...]:
    """The positions of the arguments ``func`` writes to (in-place and ``out=`` operators)."""
    return tuple(i for i, a in enumerate(func._schema.arguments) if a.alias_info is not None and a.alias_info.is_write)


def _argument(func: Any, args: tuple, kwargs: dict, index: int) -> Any:
    """Argument ``index`` of a call of ``func``: positional, else by its schema name (``None`` when not passed)."""
    if index < len(args):
        return args[index]
    return kwargs.get(func._schema.arguments[index].name)


def _strided(tensor: Tensor) -> bool:
    """Whether ``tensor`` has a storage of its own to keep values for (a sparse one, such as the gradient of
    ``nn.Embedding(sparse=True)``, has none)."""
    return tensor.layout == torch.strided


def _answer_hf_fake_checks(still_fake: Callable[[Tensor], bool]) -> Callable[[], None]:
    """Have Hugging Face's ``is_fake_tensor`` (asked by its ``is_tracing`` before a data-dependent check) answer
    ``still_fake`` for fake tensors; returns the function that puts the original back. Nothing where transformers is
    not imported or has no such function."""
    module: Any = sys.modules.get("transformers.utils.import_utils")
    original = getattr(module, "is_fake_tensor", None)
    if module is None or original is None:
        return lambda: None

    def is_fake_tensor(value: Any) -> bool:
        return bool(original(value)) and still_fake(value)

    module.is_fake_tensor = is_fake_tensor

    def restore() -> None:
        module.is_fake_tensor = original

    return restore


class _BatchSizes(Tensor):
    """A packed sequence's ``batch_sizes``: the real tensor (the RNN kernels read its values in C++), which also has
    ``pad_packed_sequence`` run outside the fake mode, where its C++ kernel can write the lengths it returns into a
    real tensor (the data stays fake). ``plain``: the same tensor as a plain one."""

    plain: Tensor

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch._VF._pad_packed_sequence:
            with outside_fake_mode(), without_subclass_functions():
                return func(*args, **kwargs)
        with without_subclass_functions():
            return func(*args, **kwargs)


#: The types of real tensors a step reads in the fake mode.
_REAL = frozenset({Tensor, _BatchSizes})


def _batch_sizes(real: Tensor) -> _BatchSizes:
    wrapped = real.as_subclass(_BatchSizes)
    wrapped.plain = real
    return wrapped


def _plain(value: Any) -> Any:
    """A real tensor the step reads as the plain tensor it is (a :class:`_BatchSizes` unwrapped)."""
    return getattr(value, "plain", value) if type(value) is _BatchSizes else value


#: Checks in torch that only raise, on values a fake tensor has not (the model's outputs): ``(file, function)`` of
#: the frame that asks. Answered as passing: where the check fails, the real step raises instead of training.
_RAISE_ONLY_CHECKS = frozenset({("torch/nn/functional.py", "gaussian_nll_loss")})  # var < 0
#: Frames between a check and this module: torch's operator dispatch, this package.
_DISPATCH_FILES = ("torch/_ops.py", "torch/_compile.py", "torch/_dynamo/", "torch/utils/_stats.py", "lightning_memopt/")


def _passing_check(func: Any, args: tuple, kwargs: dict) -> tuple[Any] | None:
    """``False`` for the truth of a tensor asked by one of :data:`_RAISE_ONLY_CHECKS` (``any(var < 0)``): the
    check passes; ``None`` for anything else."""
    if func not in (aten._local_scalar_dense.default, aten.is_nonzero.default):
        return None
    frame: Any = sys._getframe(1)
    while frame is not None and any(part in frame.f_code.co_filename for part in _DISPATCH_FILES):
        frame = frame.f_back
    if frame is None:
        return None
    asked = (frame.f_code.co_filename.replace("\\", "/"), frame.f_code.co_name)
    if any(asked[0].endswith(where) and asked[1] == name for where, name in _RAISE_ONLY_CHECKS):
        return (False,)
    return None


class KnownValues:
    """Keep real values beside the fake tensors of ``mode`` that depend on no data.

    :meth:`run` runs each operator of the step (a counter's ``run``, see
    :class:`~lightning_memopt.functional.planning.LiveBytes`): an operator whose tensor arguments are all known (or
    that has none and is neither random nor uninitialised) is computed for real too, up to ``numel_limit`` elements
    per output. Values live per storage, so views of a known tensor are known and an in-place write by an unknown
    value makes its storage unknown. A check fake tensors cannot answer (``aten._local_scalar_dense``,
    ``aten.equal``, ``nonzero``) is answered from the real values when its arguments are known; otherwise its error
    is raised as it was. While :meth:`library_checks` is entered, Hugging Face's fake-tensor test answers ``False``
    for a known tensor, so its shortcuts (an all-ones attention mask dropped) are taken as in the real step.

    Args:
        mode: the fake tensor mode the step runs in.
        numel_limit: the most elements of one known tensor.

    Examples:
        >>> from lightning_memopt.functional.planning.counter import LiveBytes
        >>> mode = fake_tensor.FakeTensorMode()
        >>> known = KnownValues(mode)
        >>> with mode, LiveBytes(run=known.run):
        ...     mask = torch.triu(torch.full((4, 4), float("-inf")), diagonal=1)
        ...     torch.equal(mask, torch.triu(torch.full((4, 4), float("-inf")), diagonal=1)), int((mask == 0).sum())
        (True, 10)
    """

    def __init__(self, mode: fake_tensor.FakeTensorMode, numel_limit: int = KNOWN_NUMEL_LIMIT) -> None:
        self.mode = mode
        self.numel_limit = numel_limit
        self._values: dict[int, torch.UntypedStorage] = {}  # id(fake storage) -> real storage of the same layout
        #: ids of the storages of fake twins of real tensors the step reads (a real constant's memory is not new)
        self.constants: set[int] = set()

    @contextlib.contextmanager
    def library_checks(self) -> Iterator[None]:
        """Hugging Face skips its checks (an all-ones attention mask dropped, a causal mask made implicit) for a
        fake tensor: while entered, a known one is not fake to it, so the estimate takes the real step's path."""
        restore = _answer_hf_fake_checks(lambda t: self.value(t) is None)
        try:
            yield
        finally:
            restore()

    def remember(self, fake: Tensor, real: Tensor) -> None:
        """Say that ``fake`` holds ``real``'s values (copied: ``real`` is never written to); too large: not kept."""
        if real.device.type != "cpu" or real.numel() > self.numel_limit or fake.shape != real.shape:
            return
        if not (_strided(fake) and _strided(real)):
            return
        with outside_fake_mode():
            copy = torch.empty_strided(fake.shape, fake.stride(), dtype=fake.dtype).copy_(real)
        storage = fake.untyped_storage()
        if fake.storage_offset() == 0 and storage.nbytes() == copy.untyped_storage().nbytes():
            self._keep(storage, copy.untyped_storage())

    def value(self, fake: Tensor) -> Tensor | None:
        """``fake``'s real values, or ``None`` where they are not known."""
        if not isinstance(fake, fake_tensor.FakeTensor) or fake.fake_mode is not self.mode or not _strided(fake):
            return None
        storage = self._values.get(id(fake.untyped_storage()))
        if storage is None:
            return None
        with outside_fake_mode():
            return torch.empty(0, dtype=fake.dtype).set_(storage, fake.storage_offset(), fake.shape, fake.stride())

    def _keep(self, storage: torch.UntypedStorage, real: torch.UntypedStorage) -> None:
        key = id(storage)
        if key not in self._values:
            weakref.finalize(storage, self._values.pop, key, None)
        self._values[key] = real

    def _forget(self, value: Any) -> None:
        if isinstance(value, Tensor) and _strided(value):
            self._values.pop(id(value.untyped_storage()), None)

    def _real_arguments(self, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """The arguments with every tensor replaced by its real values; ``None`` when one is not known."""
        leaves, spec = tree_flatten((args, kwargs))
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, fake_tensor.FakeTensor):
                leaves[i] = self.value(leaf)
                if leaves[i] is None:
                    return None
            elif isinstance(leaf, Tensor) and is_traceable_wrapper_subclass_type(type(leaf)):
                return None  # a DTensor; a plain real tensor (``torch.tensor([...])`` in the fake mode) is its value
        real_args, real_kwargs = tree_unflatten(leaves, spec)
        return real_args, real_kwargs

    def _known(self, value: Any) -> bool:
        """Whether every fake tensor in ``value`` (an argument: a tensor, a list of them, anything else) is known."""
        if isinstance(value, fake_tensor.FakeTensor):
            return value.fake_mode is self.mode and _strided(value) and id(value.untyped_storage()) in self._values
        if isinstance(value, (list, tuple)):
            return all(self._known(v) for v in value)
        return not (isinstance(value, Tensor) and is_traceable_wrapper_subclass_type(type(value)))

    def run(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """``func(*args, **kwargs)`` on the fake tensors, followed on the known values (see the class)."""
        if func not in _LITERALS and any(type(arg) in _REAL for arg in args):
            args = self._with_constants(args)
        try:
            out = func(*args, **kwargs)
        except _NEEDS_VALUES:
            for rule in (self._answer, self._indexed_by_known_masks, self._ctc_loss, self._packed, _passing_check):
                answer = rule(func, args, kwargs)
                if answer is not None:
                    return answer[0]
            raise
        written = _written(func)
        if written:
            self._after_write(func, args, kwargs, written)
        elif _computable(func) and self._all_known(args, kwargs):
            self._compute(func, args, kwargs, out)
        return out

    def _all_known(self, args: tuple, kwargs: dict) -> bool:
        if not self._values:  # nothing known (yet): only an operator without fake tensors makes something known
            return not any(isinstance(a, fake_tensor.FakeTensor) for a in (*args, *kwargs.values()))
        return all(map(self._known, args)) and all(map(self._known, kwargs.values()))

    def _as_fake(self, value: Any) -> Any:
        """A tensor as a fake tensor of this mode; any other value as it is."""
        if isinstance(value, Tensor):
            return self.mode.from_tensor(value)
        return value

    def _answer(self, func: Any, args: tuple, kwargs: dict) -> tuple[Any] | None:
        """A check fake tensors could not answer, computed on the real values (as a 1-tuple); ``None``: unknown."""
        real = self._real_arguments(args, kwargs)
        if real is None:
            return None
        with outside_fake_mode():
            out = func(*real[0], **real[1])
        # a data-sized output (nonzero, masked_select) becomes a fake tensor of its real shape, known itself
        fake = tree_map(self._as_fake, out)
        for f, r in zip(tree_flatten(fake)[0], tree_flatten(out)[0]):
            if isinstance(f, Tensor):
                self.remember(f, r)
        return (fake,)

    def _indexed_by_known_masks(self, func: Any, args: tuple, kwargs: dict) -> tuple[Any] | None:
        """Indexing by boolean masks whose values are known (``logits[labels != -100]``; its backward's
        ``index_put``): run with the masks' positions as integer indices, the output's size the real one. ``None``
        for another operator or an unknown mask."""
        if func.overloadpacket is aten.masked_select:
            return self._masked_select(_argument(func, args, kwargs, 0), _argument(func, args, kwargs, 1))
        if func.overloadpacket not in _INDEXING or len(args) < 2 or not isinstance(args[1], (list, tuple)):
            return None
        indices: list[Any] = []
        for index in args[1]:
            if isinstance(index, Tensor) and index.dtype in (torch.bool, torch.uint8):
                mask = self.value(index)
                if mask is None:
                    return None
                with outside_fake_mode():
                    positions = mask.nonzero().unbind(1)
                indices.extend(self._as_known_fake(p) for p in positions)
            else:
                indices.append(index)
        return (func(args[0], indices, *args[2:], **kwargs),)

    def _masked_select(self, x: Tensor, mask: Tensor) -> tuple[Any] | None:
        """``x.masked_select(mask)`` for a known ``mask``: the elements it selects, as many as it holds."""
        real = self.value(mask)
        if real is None:
            return None
        with outside_fake_mode():
            count = int(real.expand(torch.broadcast_shapes(x.shape, real.shape)).sum())
        return (torch.empty((count,), dtype=x.dtype, device=x.device),)

    def _ctc_loss(self, func: Any, args: tuple, kwargs: dict) -> tuple[Any] | None:
        """``_ctc_loss`` with known target lengths: the loss per sample and ``log_alpha`` (batch x input length x (2 x
        the longest target + 1)), as the CPU and CUDA kernels make them. ``None`` for another operator or unknown
        lengths."""
        if func.overloadpacket is not aten._ctc_loss:
            return None
        log_probs, lengths = _argument(func, args, kwargs, 0), _argument(func, args, kwargs, 3)
        if isinstance(lengths, Tensor):
            lengths = self.value(lengths)
            if lengths is None:
                return None
            with outside_fake_mode():
                lengths = lengths.tolist()
        longest, batch = max(lengths, default=0), log_probs.size(1)
        return ((log_probs.new_empty((batch,)), log_probs.new_empty((batch, log_probs.size(0), 2 * longest + 1))),)

    def _with_constants(self, args: tuple) -> tuple:
        """``args`` with each real tensor an operator in the fake mode reads (a constant, or ``batch_sizes`` of a
        packed sequence) as its known fake twin (:meth:`_constant`); as they are where the operator runs for real."""
        args = tuple(map(_plain, args))
        if active_fake_mode() is not self.mode:
            return args
        return tuple(map(self._constant, args))

    def _constant(self, real: Any) -> Any:
        """A real tensor an operator reads (a constant, or ``batch_sizes`` of a packed sequence): the fake tensor the
        mode makes of it (the same one each time), its values known, so the operator's output is known too
        (``batch_sizes[0]``); ``real`` itself where it is not a small CPU tensor (or not a real tensor)."""
        if type(real) is not Tensor or real.device.type != "cpu" or real.numel() > self.numel_limit:
            return real
        if not _strided(real):
            return real
        fake = self.mode.from_tensor(real)
        storage = fake.untyped_storage()
        if id(storage) not in self._values:
            self.remember(fake, real)
            self.constants.add(id(storage))
            weakref.finalize(storage, self.constants.discard, id(storage))
        return fake

    def _packed(self, func: Any, args: tuple, kwargs: dict) -> tuple[Any] | None:
        """Packing and padding a sequence (``_pack_padded_sequence``, ``_pad_packed_sequence``) with known lengths:
        run for real on a stand-in for the data with one feature (the op reads only the lengths), the data's output
        a fake tensor of that size with the data's features, the rest real CPU tensors, as the real op makes them
        (``batch_sizes``: the RNN kernels and the backward read its values in C++, where a fake tensor has none).
        ``None`` for another operator or unknown lengths."""
        leading = _PACKING.get(func.overloadpacket)
        if leading is None:
            return None
        data = _argument(func, args, kwargs, 0)
        real = self._real_arguments((None, *args[1:]), kwargs)
        if real is None:
            return None
        with outside_fake_mode():
            stand_in = torch.zeros((*data.shape[:leading], 1))
            rows, *rest = func(stand_in, *real[0][1:], **real[1])
        if func.overloadpacket is aten._pack_padded_sequence:
            rest = [_batch_sizes(rest[0])]
        return ((data.new_empty((*rows.shape[:-1], *data.shape[leading:])), *rest),)

    def _as_known_fake(self, real: Tensor) -> Tensor:
        """A fake tensor of this mode holding ``real``'s values (known)."""
        with outside_fake_mode():
            real = real.contiguous()
        fake = self.mode.from_tensor(real)
        self.remember(fake, real)
        return fake

    def _compute(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """Compute ``func`` (whose arguments are known) for real where its outputs are new and small enough."""
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, Tensor) and _strided(t)]
        fresh = [t for t in outputs if id(t.untyped_storage()) not in self._values]  # views of known ones are known
        if not fresh or any(t.numel() > self.numel_limit for t in fresh):
            return
        real = self._real_arguments(args, kwargs)
        if real is None:
            return
        with outside_fake_mode():
            real_out = func(*real[0], **real[1])
        for fake, value in zip(tree_flatten(out)[0], tree_flatten(real_out)[0]):
            if isinstance(fake, Tensor) and isinstance(value, Tensor) and any(fake is f for f in fresh):
                self.remember(fake, value)

    def _after_write(self, func: Any, args: tuple, kwargs: dict, written: tuple[int, ...]) -> None:
        """Follow an in-place write: computed on the real values when they are known, else its storage forgotten."""
        targets = [_argument(func, args, kwargs, i) for i in written]
        rest_known = all(map(self._known, args[1:])) and all(map(self._known, kwargs.values()))
        if rest_known and self._known(args[0] if args else None):
            real = self._real_arguments(args, kwargs)
            with outside_fake_mode():
                func(*real[0], **real[1])  # type: ignore[index]  # the real views write into the known storages
            return
        first: Any = targets[0] if targets else None
        overwrites = func.overloadpacket in _OVERWRITES and isinstance(first, Tensor)
        if rest_known and overwrites and self._covers_storage(first):
            rest = self._real_arguments(args[1:], kwargs)
            with outside_fake_mode():
                fresh = torch.empty_strided(first.shape, first.stride(), dtype=first.dtype)
                func(fresh, *rest[0], **rest[1])  # type: ignore[index]
            self.remember(first, fresh)
            return
        if self._values:  # an unknown value written: what it wrote to is no longer known
            for target in targets:
                for value in tree_flatten(target)[0]:
                    self._forget(value)

    def _covers_storage(self, tensor: Tensor) -> bool:
        return (
            tensor.storage_offset() == 0
            and tensor.is_contiguous()
            and tensor.numel() * tensor.element_size() == tensor.untyped_storage().nbytes()
            and tensor.numel() <= self.numel_limit
        )
