"""TokenBudgetBatchSampler: batches grouped by length, each as large as a memory budget allows, safe under DDP."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import BatchSampler, DistributedSampler

from lightning_memopt.functional.batching import (
    LargestBatch,
    as_lengths,
    check_every_sample_fits,
    group_batches,
    longest_first,
    rank_share,
    sort_by_length,
    sort_in_groups,
    table_budget,
    token_budget,
)
from lightning_memopt.utilities.checks import check_bool, check_non_negative_int, check_positive_int

__all__ = ["TokenBudgetBatchSampler"]


def _largest_batch(
    max_tokens: int | Sequence[int] | None, budget: Mapping[Any, int] | Callable[..., int] | None, axes: int
) -> tuple[LargestBatch, str]:
    """The budget as a :data:`~lightning_memopt.functional.batching.LargestBatch`, and how to name it in errors."""
    if (max_tokens is None) == (budget is None):
        raise ValueError(
            "TokenBudgetBatchSampler needs exactly one of `max_tokens` (padded tokens per batch, one count per length"
            " axis) and `budget` (a table {lengths: largest batch}, e.g. from `plan_token_budget`, or a function of"
            f" the lengths); got max_tokens={max_tokens!r}, budget={budget!r}."
        )
    if max_tokens is not None:
        counts = (max_tokens,) if isinstance(max_tokens, int) else tuple(max_tokens)
        if len(counts) != axes:
            raise ValueError(
                f"`max_tokens` is {max_tokens!r} but the samples have {axes} length axes: give one count per axis, e.g."
                f" max_tokens={(4096,) * axes}. Every axis needs a bound: a batch of short inputs with long targets"
                " grows without one."
            )
        for k, count in enumerate(counts):
            check_positive_int(f"max_tokens[{k}]", count)
        return token_budget(counts), f"max_tokens={max_tokens!r}"
    if isinstance(budget, Mapping):
        if len(budget) == 0:
            raise ValueError("`budget` is an empty table: give {lengths: largest batch} entries (`plan_token_budget`).")
        return table_budget(budget), "the budget table"
    if callable(budget):
        return lambda lengths: int(budget(lengths if len(lengths) > 1 else lengths[0])), "the budget function"
    raise ValueError(
        f"`budget` must be a table {{lengths: largest batch}} or a function of the lengths, got {budget!r}"
        f" ({type(budget).__name__})."
    )


class _EpochRelay:
    """The ``sampler`` of a sampler not given one: Lightning calls ``batch_sampler.sampler.set_epoch`` each epoch."""

    def __init__(self, owner: TokenBudgetBatchSampler) -> None:
        self.owner = owner

    def set_epoch(self, epoch: int) -> None:
        self.owner.set_epoch(epoch)


class TokenBudgetBatchSampler(BatchSampler):
    """Batches of samples of similar length, each as large as the budget allows at its padded lengths.

    Samples are sorted by length (ties in an order drawn per epoch; with several axes, by the first and then, in
    runs of about ``group_size`` batches, by the others) and cut greedily into batches: a batch takes the next sample
    while it still fits once padded to its longest sample on every axis. The batch order is shuffled per
    epoch (``set_epoch``, which Lightning calls). Under several processes every rank builds the same batch list (same
    lengths, seed and epoch) and takes every ``world_size``-th batch, the list first filled up from its start (or cut,
    with ``drop_last``) so that every rank gets as many batches and the last all-reduce of an epoch never waits.

    Ranks hold batches of different sizes: with a loss that is a mean over each rank's batch, every rank's gradient
    weighs the same whatever its samples (DDP averages them), so a sample in a small batch weighs more than one in a
    large batch. For a loss that is a mean over tokens, divide the sum of the token losses by the global token count
    (all-reduced) times the world size instead; within a rank, ``AutoMicroBatch(weight_fn=...)`` keeps token weights
    exact when a batch is split.

    Args:
        lengths: one length per sample of the map-style dataset: an int, or a tuple of ints (source and target
            tokens, frames and tokens, peaks) of one size for every sample.
        max_tokens: at most this many padded tokens per batch (batch size x its longest length), one count per axis
            (an int for one axis). Every axis is bounded: a budget on the source alone lets a batch of many short
            sources with long targets grow without limit.
        budget: instead of ``max_tokens``: a table ``{lengths: largest batch}`` (each entry: up to these lengths,
            that many samples fit; ``plan_token_budget`` plans one from the memory estimator), or a function of a
            batch's padded lengths returning its largest batch.
        sampler: Lightning passes its ``DistributedSampler`` here under DDP (``use_distributed_sampler=True``, the
            sampler made in a ``*_dataloader`` hook); its ``num_replicas``, ``rank`` and ``epoch`` are used, not its
            order.
        shuffle: shuffle the batch order and ties in length per epoch (default ``True``).
        seed: the seed of that order (the same on every rank).
        drop_last: cut the batch list to a multiple of the world size instead of filling it up (default ``False``).
        longest_first: put the costliest batches first (one per rank), so that a budget too large for the device
            fails at the first step rather than hours in (default ``False``).
        group_size: with several length axes, the samples sorted by the first axis are cut into runs of about this
            many batches, each run sorted by the other axes, so that batches pad little on every axis (default 8;
            ``None``: sorted by the first axis alone, the least padding there and the other axes unsorted).
        num_replicas: the number of processes; ``None``: from ``sampler``, else the process group, else 1.
        rank: this process's rank; ``None``: as ``num_replicas``.

    Resuming mid-epoch: ``state_dict()`` holds the epoch and the batches handed out; a sampler of the same data
    that loads it hands out the rest of that epoch. A ``DataLoader`` fetches ahead of the training loop (workers,
    Lightning's prefetch of one batch), so pass what the loop consumed: ``state_dict(batches_done=n)``.

    Examples:
        >>> sampler = TokenBudgetBatchSampler([5, 3, 8, 2, 7, 3], max_tokens=12, shuffle=False)
        >>> list(sampler)
        [[3, 1, 5], [0], [4], [2]]
        >>> TokenBudgetBatchSampler([(5, 2), (3, 9)], max_tokens=(10, 9), num_replicas=2, rank=1).__len__()
        1
    """

    def __init__(
        self,
        lengths: Sequence[int | Sequence[int]],
        max_tokens: int | Sequence[int] | None = None,
        *,
        budget: Mapping[Any, int] | Callable[..., int] | None = None,
        sampler: Any = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        longest_first: bool = False,
        group_size: int | None = 8,
        num_replicas: int | None = None,
        rank: int | None = None,
    ) -> None:
        self.lengths = as_lengths(lengths)
        self._largest, what = _largest_batch(max_tokens, budget, len(self.lengths[0]))
        check_every_sample_fits(self.lengths, self._largest, what)
        for name, flag in (("shuffle", shuffle), ("drop_last", drop_last), ("longest_first", longest_first)):
            check_bool(name, flag)
        check_non_negative_int("seed", seed)
        check_positive_int("group_size", group_size, allow_none=True)
        self.group_size = group_size
        check_positive_int("num_replicas", num_replicas, allow_none=True)
        check_non_negative_int("rank", 0 if rank is None else rank)
        self.max_tokens, self.budget = max_tokens, budget
        if sampler is not None:
            self.sampler: Any = sampler
        else:
            self.sampler = _EpochRelay(self)
        self.shuffle, self.seed, self.drop_last, self.longest_first = shuffle, seed, drop_last, longest_first
        self.num_replicas, self.rank = num_replicas, rank
        self.epoch = 0
        self._skip: tuple[int, int] | None = None  # (epoch, its batches handed out before a resume)
        self._done = 0  # batches of the epoch being handed out, so far
        self._cache: tuple[int, list[list[int]]] | None = None

    def _epoch(self) -> int:
        """The epoch: Lightning sets it on its distributed sampler when it passed one, else through ``set_epoch``."""
        return int(self.sampler.epoch) if isinstance(self.sampler, DistributedSampler) else self.epoch

    def _replicas(self) -> tuple[int, int]:
        """(world size, rank): given, from Lightning's distributed sampler, from the process group, or (1, 0)."""
        world, rank = self.num_replicas, self.rank
        if isinstance(self.sampler, DistributedSampler):
            world = self.sampler.num_replicas if world is None else world
            rank = self.sampler.rank if rank is None else rank
        elif torch.distributed.is_available() and torch.distributed.is_initialized():
            if world is None:
                world = torch.distributed.get_world_size()
            if rank is None:
                rank = torch.distributed.get_rank()
        world, rank = world or 1, rank or 0
        if rank >= world:
            raise ValueError(f"`rank` ({rank}) must be below `num_replicas` ({world}).")
        return world, rank

    def batches(self, epoch: int | None = None) -> list[list[int]]:
        """Every rank's batches of ``epoch`` (default: the current one), in order, before they are shared out."""
        if epoch is None:
            epoch = self._epoch()
        if self._cache is not None and self._cache[0] == epoch:
            return self._cache[1]
        seed = self.seed + epoch if self.shuffle else None
        order = sort_by_length(self.lengths, seed)
        batches = group_batches(self.lengths, order, self._largest)
        if self.group_size is not None and len(self.lengths[0]) > 1:  # sort runs of about group_size batches by the
            run = max(1, round(self.group_size * len(self.lengths) / len(batches)))  # other axes too
            batches = group_batches(self.lengths, sort_in_groups(self.lengths, order, run), self._largest)
        if seed is not None:
            random.Random(seed).shuffle(batches)
        if self.longest_first:
            batches = longest_first(batches, self.lengths, self._replicas()[0])
        self._cache = (epoch, batches)
        return batches

    def _share(self) -> list[list[int]]:
        batches = self.batches()
        world, rank = self._replicas()
        return [batches[k] for k in rank_share(len(batches), rank, world, self.drop_last)]

    def __iter__(self) -> Iterator[list[int]]:
        share = self._share()
        skip, self._skip = self._skip, None
        self._done = skip[1] if skip is not None and skip[0] == self._epoch() else 0
        for batch in share[self._done :]:
            self._done += 1
            yield batch

    def __len__(self) -> int:
        return len(self._share())

    def set_epoch(self, epoch: int) -> None:
        """Use the order of ``epoch`` (Lightning calls it before each epoch, through ``sampler``)."""
        self.epoch = epoch
        if isinstance(self.sampler, DistributedSampler):
            self.sampler.set_epoch(epoch)

    def state_dict(self, batches_done: int | None = None) -> dict[str, Any]:
        """Where this rank is in the epoch: ``batches_done`` batches of it consumed (default: handed out)."""
        done = self._done if batches_done is None else batches_done
        check_non_negative_int("batches_done", done)
        return {"epoch": self._epoch(), "batches_done": done, "seed": self.seed, "samples": len(self.lengths)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Hand out the rest of the epoch ``state`` was saved in (the same data and seed)."""
        if state.get("samples") != len(self.lengths) or state.get("seed") != self.seed:
            raise ValueError(
                f"TokenBudgetBatchSampler state of {state.get('samples')} samples with seed {state.get('seed')} cannot"
                f" resume a sampler of {len(self.lengths)} samples with seed {self.seed}: the batches would differ."
                " Build the sampler from the same lengths and seed, or start the epoch afresh."
            )
        epoch, done = int(state["epoch"]), int(state["batches_done"])
        self.set_epoch(epoch)
        self._skip, self._done = (epoch, done), done
