"""StreamingRetrievalMetric: exact video<->text recall and ranks without the full similarity matrix, across ranks.

The metric keeps its rows in list states and ranks them with the shared orchestration
(:func:`~lightning_memopt.functional.retrieval.rank_rows`), to which it hands ``torch.distributed`` collectives
(:class:`_DistributedCollectives`); :class:`_StoredTexts` remembers where each stored caption sits in its states.
"""

from __future__ import annotations

import bisect
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torchmetrics import Metric
from torchmetrics.utilities.data import dim_zero_cat
from torchmetrics.utilities.distributed import gather_all_tensors
from typing_extensions import override

from lightning_memopt.functional.retrieval import (
    DEFAULT_MEMORY_BUDGET_BYTES,
    MEDIANS,
    PROTOCOLS,
    TIES,
    V2T_GALLERIES,
    Collectives,
    Median,
    Protocol,
    RankCounts,
    RetrievalRanks,
    Ties,
    V2TGallery,
    as_id_tensor,
    rank_rows,
    summarize_rank_histogram,
)
from lightning_memopt.functional.retrieval.options import check_features, check_state_tensors, repeated_text_message
from lightning_memopt.functional.retrieval.ranking import ReduceOp
from lightning_memopt.functional.retrieval.summaries import top_k_tuple
from lightning_memopt.utilities.checks import check_choice, check_positive_int
from lightning_memopt.utilities.warnings import WarnOnce

__all__ = ["StreamingRetrievalMetric"]

#: The first thing every process sends in ``compute()``: a value no other collective is likely to carry.
_HANDSHAKE = 0x5EED_C0DE_2025

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


class _DistributedCollectives(Collectives):
    """The collectives of a process group; a no-op world of one when not distributed.

    Args:
        group: the process group (``None``: the default group).

    Examples:
        >>> comm = _DistributedCollectives()  # not distributed here: a world of one
        >>> comm.rank, comm.world, comm.all_gather_rows(torch.ones(2, 1)).shape
        (0, 1, torch.Size([2, 1]))
    """

    def __init__(self, group: Any = None) -> None:
        self.group = group
        self.active = dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
        if self.active:
            self.rank = dist.get_rank(group)
            self.world = dist.get_world_size(group)
        else:
            self.rank = 0
            self.world = 1
        self.device = torch.device("cpu")
        if self.active and dist.get_backend(group) == "nccl":
            self.device = torch.device("cuda", torch.cuda.current_device())

    def handshake(self) -> None:
        """Check that every process is in ``compute()``: the first collective, with a token only it sends."""
        if not self.active:
            return
        token = torch.tensor([[_HANDSHAKE, self.rank, _HANDSHAKE]], dtype=torch.int64, device=self.device)
        out = [torch.zeros_like(token) for _ in range(self.world)]
        problem = (
            "Every process must call `StreamingRetrievalMetric.compute()` (it synchronises): call it on all ranks, not"
            ' under `if trainer.is_global_zero`, and log its values with `sync_dist=True, reduce_fx="max"`.'
        )
        try:  # a plain all_gather: gather_all_tensors would first enter a barrier, which carries no token
            dist.all_gather(out, token, group=self.group)
        except RuntimeError as err:
            raise RuntimeError(f"{problem} The first collective of compute() failed: {err}") from err
        got = torch.cat(out).cpu()
        stray = ((got[:, 0] != _HANDSHAKE) | (got[:, 2] != _HANDSHAKE)).nonzero().flatten().tolist()
        if stray:
            raise RuntimeError(f"{problem} Process(es) {stray} were in another collective.")

    def all_reduce(self, values: Tensor, op: ReduceOp) -> Tensor:
        if not self.active:
            return values
        reduced = values.to(self.device).clone()
        dist.all_reduce(reduced, op=_OPS[op], group=self.group)
        return reduced.to(values.device)

    def all_gather_rows(self, rows: Tensor) -> Tensor:
        """Concatenate every process's rows of a 2-D tensor (row counts may differ), in rank order.

        torchmetrics' ``gather_all_tensors`` exchanges the shapes, pads to the longest and trims what it gathered.
        """
        if not self.active:
            return rows
        return torch.cat(gather_all_tensors(rows.to(self.device), group=self.group)).to(rows.device)


def _chunks(state: Any) -> list[Tensor]:
    """A list state as its tensors (a synced state is one tensor)."""
    return [state] if isinstance(state, Tensor) else list(state)


class _StoredTexts:
    """Caption id -> position in the ``text_features`` state, valid for the exact state objects it was built from.

    A load, merge, sync, reset or in-place concatenation replaces the state's objects: :meth:`positions` notices
    (by the state's length and its first and last tensors) and rebuilds from the state itself.

    Examples:
        >>> texts = _StoredTexts()
        >>> ids = [torch.tensor([7, 3])]
        >>> texts.positions(ids)
        {7: 0, 3: 1}
        >>> ids.append(torch.tensor([5])); texts.stored(ids, [5])
        >>> texts.positions(ids)[5], texts.features([torch.zeros(2, 1), torch.ones(1, 1)], [5]).tolist()
        (2, [[1.0]])
    """

    def __init__(self) -> None:
        self._positions: dict[int, int] = {}
        self._starts: list[int] = [0]  # where each chunk of the state starts, and the total at the end
        self._token: tuple[Any, ...] | None = None

    @staticmethod
    def _token_of(state: Any) -> tuple[Any, ...]:
        if isinstance(state, Tensor):
            return (state,)
        return (len(state), state[0] if state else None, state[-1] if state else None)

    def _same(self, state: Any) -> bool:
        token, cached = self._token_of(state), self._token
        return (
            cached is not None
            and len(token) == len(cached)
            and all(a is b if not isinstance(a, int) else a == b for a, b in zip(token, cached))
        )

    def positions(self, id_state: Any) -> dict[int, int]:
        """Each stored caption id's position in the concatenated state (the first one, if an id is there twice)."""
        if not self._same(id_state):
            self._positions, self._starts, at = {}, [0], 0
            for chunk in _chunks(id_state):
                for text_id in chunk.tolist():
                    self._positions.setdefault(int(text_id), at)
                    at += 1
                self._starts.append(at)
            self._token = self._token_of(id_state)
        return self._positions

    def stored(self, id_state: Any, ids: list[int]) -> None:
        """Record that ``ids`` were just appended to ``id_state`` as one chunk."""
        at = self._starts[-1]
        for offset, text_id in enumerate(ids):
            self._positions.setdefault(text_id, at + offset)
        self._starts.append(at + len(ids))
        self._token = self._token_of(id_state)

    def features(self, feature_state: Any, ids: list[int]) -> Tensor:
        """The stored features of ``ids`` (each must be stored), one row per id, on the state's device."""
        chunks = _chunks(feature_state)
        if len(chunks) != len(self._starts) - 1:  # not cut as the ids are: index the whole
            return dim_zero_cat(chunks)[[self._positions[text_id] for text_id in ids]]
        rows = []
        for text_id in ids:
            at = self._positions[text_id]
            chunk = bisect.bisect_right(self._starts, at) - 1
            rows.append(chunks[chunk][at - self._starts[chunk]])
        return torch.stack(rows)

    def clear(self) -> None:
        self.__init__()  # type: ignore[misc]


class StreamingRetrievalMetric(Metric):
    r"""Exact video->text and text->video R@K, median and mean rank, computed in blocks from CPU-held features.

    Each ``update`` adds one row per sample (video features, the features of its caption, ids). Features are
    detached and kept on the CPU; a caption repeated across rows (same ``text_ids``) is stored once, with its first
    embedding (a later one with other features is ignored and warns once per metric). ``compute``
    multiplies blocks of videos and texts on the metric's device and counts, for every query, the non-positive
    gallery items scoring above its best positive (``rank0``); no similarity matrix, sort or top-k is materialised.
    Under DDP **every process calls** ``compute()`` (it synchronises; video features never leave their process) and
    gets the same values. Definitions, protocols, ties, block sizes and the DDP recipe: ``docs/retrieval.md``.

    Args:
        top_k: the K of the R@K keys.
        protocol: ``"dedup"`` (captions deduplicated by id) or ``"paired"`` (row i <-> row i, no deduplication).
        v2t_gallery: ``"texts"`` (any caption of the video counts) or ``"groups"`` (one gallery item per video,
            scored by its best caption: CLIP4Clip's multi-sentence protocol).
        ties: ``"optimistic"`` (a negative must score strictly higher to count) or ``"pessimistic"`` (ties count).
        median: ``"floor"`` (floor of numpy's median, open_clip / VSE++), ``"mean"`` (numpy's median, may end in
            .5), or ``"lower"`` (lower middle value, torchmetrics).
        video_block_size: videos per block (``None``: chosen from ``memory_budget_bytes``).
        text_block_size: texts per block (``None``: chosen from ``memory_budget_bytes``).
        memory_budget_bytes: working-set budget of one block on the compute device (default 2 GiB).
        accumulate_on: ``"cpu"`` keeps features in host memory (pinned when CUDA is available) between updates;
            ``"device"`` keeps them where the metric lives.
        kwargs: torchmetrics ``Metric`` keyword arguments (``process_group`` is honoured; ``sync_on_compute`` is
            always off: the metric synchronises only ids and texts itself).

    Outputs:
        ``compute()``: ``{"v2t/R@{k}", "v2t/MedR", "v2t/MeanR", "t2v/R@{k}", "t2v/MedR", "t2v/MeanR"}`` as scalar
        tensors; R@K as fractions in [0, 1], ranks 1-based. Log them from every process with
        ``self.log_dict(metric.compute(), sync_dist=True, reduce_fx="max")``.
        ``compute_ranks()``: the per-query ``rank0`` values and ids (:class:`RetrievalRanks`).
        ``last_compute_stats``: after either, a dict of what the last call ranked, the same on every process except
        where noted: ``num_rows`` (rows counted, repeated ``sample_ids`` once), ``num_videos``, ``num_texts`` (the
        unique captions), ``embed_dim``, ``block_sizes`` (``(videos, texts)`` per block on this process),
        ``stored_feature_bytes`` (features this process held); ``None`` before the first call.

    States: ``video_features``, ``row_text_ids``, ``sample_ids``, ``video_ids`` (one entry per row) and
    ``unique_text_ids``, ``text_features`` (one per stored caption).

    Examples:
        >>> import torch
        >>> metric = StreamingRetrievalMetric(top_k=(1,))
        >>> feats = torch.eye(4)
        >>> metric.update(feats, feats.clone(), text_ids=[0, 1, 2, 3], sample_ids=[0, 1, 2, 3])
        >>> metric.update(feats[:1], feats[:1].clone(), text_ids=[0], sample_ids=[0])  # a padding repeat
        >>> {k: round(v.item(), 3) for k, v in metric.compute().items()}
        {'v2t/R@1': 1.0, 'v2t/MedR': 1.0, 'v2t/MeanR': 1.0, 't2v/R@1': 1.0, 't2v/MedR': 1.0, 't2v/MeanR': 1.0}
        >>> metric.last_compute_stats["num_rows"], metric.last_compute_stats["num_texts"]
        (4, 4)
    """

    is_differentiable: bool = False
    higher_is_better: bool | None = None
    full_state_update: bool = False

    video_features: list[Tensor]
    text_features: list[Tensor]
    row_text_ids: list[Tensor]
    sample_ids: list[Tensor]
    video_ids: list[Tensor]
    unique_text_ids: list[Tensor]

    def __init__(
        self,
        top_k: Sequence[int] = (1, 5, 10),
        protocol: Protocol = "dedup",
        v2t_gallery: V2TGallery = "texts",
        ties: Ties = "optimistic",
        median: Median = "floor",
        video_block_size: int | None = None,
        text_block_size: int | None = None,
        memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES,
        accumulate_on: str = "cpu",
        **kwargs: Any,
    ) -> None:
        sync_on_compute = kwargs.pop("sync_on_compute", False)
        if sync_on_compute is not False:
            raise ValueError(
                f"`sync_on_compute` must be left unset (or False), got {sync_on_compute!r}: syncing would gather every"
                " video feature to every process; StreamingRetrievalMetric synchronises only ids and texts itself."
            )
        super().__init__(sync_on_compute=False, **kwargs)
        top_k = top_k_tuple(top_k)
        check_choice("protocol", protocol, PROTOCOLS)
        check_choice("v2t_gallery", v2t_gallery, V2T_GALLERIES)
        check_choice("ties", ties, TIES)
        check_choice("median", median, MEDIANS)
        check_choice("accumulate_on", accumulate_on, ("cpu", "device"))
        check_positive_int("video_block_size", video_block_size, allow_none=True)
        check_positive_int("text_block_size", text_block_size, allow_none=True)
        check_positive_int("memory_budget_bytes", memory_budget_bytes, hint="Give the budget in bytes, e.g. 2**31.")
        self.top_k = top_k
        self.protocol = protocol
        self.v2t_gallery = v2t_gallery
        self.ties = ties
        self.median = median
        self.video_block_size = video_block_size
        self.text_block_size = text_block_size
        self.memory_budget_bytes = memory_budget_bytes
        self.accumulate_on = accumulate_on
        # per row: video feature, caption id, sample id, video id; per unique caption: id and feature
        for name in ("video_features", "row_text_ids", "sample_ids", "video_ids", "unique_text_ids", "text_features"):
            self.add_state(name, default=[], dist_reduce_fx="cat")
        #: What the last `compute()` / `compute_ranks()` ranked (see the class docstring).
        self.last_compute_stats: dict[str, Any] | None = None
        # Derived from the `unique_text_ids` state: valid only for the exact state objects it was built from, so a
        # load, merge, sync or reset can never leave it stale.
        self._texts = _StoredTexts()
        self._warned_text_repeat = False  # caption ids given again with other features: warned once, then unchecked
        self._warn = WarnOnce()

    # ------------------------------------------------------------------------------------------- update

    def _store(self, x: Tensor) -> Tensor:
        x = x.detach()
        if self.accumulate_on == "device":
            if x.device == self.device:
                return x.to(self.device).clone()
            return x.to(self.device)
        if torch.cuda.is_available():
            out = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
            return out.copy_(x)
        if x.device.type == "cpu":
            return x.to("cpu").clone()
        return x.to("cpu")

    def _feature_dim(self) -> int | None:
        """The feature dim of the stored rows, read from the state (never cached: states can be replaced)."""
        features = self.video_features
        if isinstance(features, Tensor):
            return int(features.shape[1]) if features.ndim == 2 else None
        return int(features[0].shape[1]) if features else None

    @override
    def update(
        self,
        video_features: Tensor,
        text_features: Tensor,
        text_ids: Any = None,
        sample_ids: Any = None,
        video_ids: Any = None,
    ) -> None:
        """Add one row per sample.

        Args:
            video_features: ``(B, D)`` video embeddings.
            text_features: ``(B, D)`` the embedding of each row's caption.
            text_ids: ``B`` caption ids (ints, or strings hashed stably); required unless ``protocol="paired"``. An id
                seen before keeps its first features: other features for it are ignored, with one warning.
            sample_ids: ``B`` sample ids; repeated samples count once. Give them under DDP validation.
            video_ids: ``B`` video ids, for datasets with several captions per video.
        """
        t_ids, s_ids, v_ids = self._checked_ids(video_features, text_features, text_ids, sample_ids, video_ids)
        if t_ids.numel() == 0:
            return
        self.video_features.append(self._store(video_features))
        self.row_text_ids.append(t_ids)
        if s_ids is not None:
            self.sample_ids.append(s_ids)
        if v_ids is not None:
            self.video_ids.append(v_ids)
        if self.protocol == "paired":
            self.text_features.append(self._store(text_features))
        else:
            self._store_new_captions(t_ids, text_features)

    def _checked_ids(
        self, video_features: Tensor, text_features: Tensor, text_ids: Any, sample_ids: Any, video_ids: Any
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """The rows' caption, sample and video ids as int64 tensors, after checking the update against the states."""
        check_features(video_features, text_features)
        n, dim = video_features.shape
        stored_dim = self._feature_dim()
        if stored_dim is not None and dim != stored_dim:
            raise ValueError(
                f"`video_features` has feature dim {dim} but earlier updates had {stored_dim}. Use one embedding"
                " size per metric, or call `reset()` between evaluations."
            )
        if self.protocol == "dedup" and text_ids is None:
            raise ValueError("`text_ids` is required with protocol='dedup': pass one caption id (int or str) per row.")
        t_ids = _optional_ids(text_ids, "text_ids", n)
        if t_ids is None:
            t_ids = torch.zeros(n, dtype=torch.int64)
        s_ids = _optional_ids(sample_ids, "sample_ids", n)
        v_ids = _optional_ids(video_ids, "video_ids", n)
        for name, ids, state in (("sample_ids", s_ids, self.sample_ids), ("video_ids", v_ids, self.video_ids)):
            if (ids is None) != (len(state) == 0) and self.video_features:
                raise ValueError(f"`{name}` must be given in every update or in none, got a mix.")
        return t_ids, s_ids, v_ids

    def _store_new_captions(self, t_ids: Tensor, text_features: Tensor) -> None:
        """Store the captions not stored before (the first row of each); check the repeated ones until one warns."""
        known = self._texts.positions(self.unique_text_ids)
        first_rows: dict[int, int] = {}  # caption id -> its first row in this update, for captions new here
        repeats: list[tuple[int, int]] = []
        for row, tid in enumerate(t_ids.tolist()):
            if tid in known or tid in first_rows:
                repeats.append((row, tid))
            else:
                first_rows[tid] = row
        if repeats and not self._warned_text_repeat:
            self._check_repeats(text_features, repeats, first_rows)
        if first_rows:
            idx = torch.tensor(list(first_rows.values()), dtype=torch.int64)
            self.unique_text_ids.append(t_ids[idx])
            self.text_features.append(self._store(text_features.detach().index_select(0, idx.to(text_features.device))))
            self._texts.stored(self.unique_text_ids, list(first_rows))

    def _check_repeats(self, text_features: Tensor, repeats: list[tuple[int, int]], first_rows: dict[int, int]) -> None:
        """Warn once when a caption id comes again with other features than the ones stored (which are kept)."""
        rows = torch.tensor([row for row, _ in repeats], dtype=torch.int64, device=text_features.device)
        new = text_features.detach().index_select(0, rows)
        earlier = [tid for _, tid in repeats if tid not in first_rows]
        stored: Iterator[Tensor] = iter(())
        if earlier:
            stored = iter(self._texts.features(self.text_features, earlier))
        kept = []
        for _, tid in repeats:
            if tid in first_rows:
                kept.append(text_features.detach()[first_rows[tid]].to("cpu", new.dtype))
            else:
                kept.append(next(stored).to("cpu", new.dtype))
        ids = torch.tensor([tid for _, tid in repeats], dtype=torch.int64)
        message = repeated_text_message(ids, new.cpu(), torch.stack(kept), "StreamingRetrievalMetric")
        if message is not None:
            self._warned_text_repeat = True
            # this, _store_new_captions, update, torchmetrics' update wrapper: the caller's line
            warnings.warn(message, UserWarning, stacklevel=5)

    @override
    def forward(self, *args: Any, **kwargs: Any) -> None:
        """Same as :meth:`update`: a per-batch retrieval value has no meaning, so nothing is computed."""
        self.update(*args, **kwargs)

    @override
    def reset(self) -> None:
        super().reset()
        self._texts.clear()

    @override
    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: Any, **kwargs: Any) -> None:
        for name in self._defaults:  # a mangled state fails here, naming it, rather than in a later update
            if prefix + name in state_dict:
                check_state_tensors("StreamingRetrievalMetric", name, state_dict[prefix + name])
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        # torchmetrics keeps the caller's list objects as the states: later updates would append to the caller's
        # state dict (and to every other metric loaded from it). Own copies of the lists instead; a state saved as
        # one tensor (concatenated, as a sync leaves it) becomes a list of that one chunk, or of none without rows.
        for name in self._defaults:
            value = getattr(self, name)
            if isinstance(value, Tensor):
                setattr(self, name, [value] if value.shape[0] else [])
            elif isinstance(value, list):
                setattr(self, name, list(value))

    @override
    def _apply(self, fn: Any, exclude_state: Sequence[str] = "") -> torch.nn.Module:
        # accumulated states stay in host memory when accumulate_on="cpu", whatever `.to(device)` the module sees
        on_cpu = self.__dict__.get("accumulate_on") == "cpu"
        excluded = tuple(exclude_state) + (tuple(self._defaults) if on_cpu else ())
        return super()._apply(fn, exclude_state=excluded)

    # ------------------------------------------------------------------------------------------- compute

    @override
    def compute(self) -> dict[str, Tensor]:
        """``{"v2t/R@1": ..., "v2t/MedR": ..., "v2t/MeanR": ..., "t2v/R@1": ..., ...}`` as scalar tensors."""
        counts = self._rank(gather_v2t=False)
        out = summarize_rank_histogram(counts.v2t_histogram, self.top_k, self.median, prefix="v2t/")
        t2v_hist = torch.bincount(counts.t2v, minlength=1)
        out.update(summarize_rank_histogram(t2v_hist, self.top_k, self.median, prefix="t2v/"))
        return out

    def compute_ranks(self) -> RetrievalRanks:
        """Per-query ``rank0`` in both directions with the ids of the queries (gathered on every process).

        Examples:
            >>> m = StreamingRetrievalMetric()
            >>> m.update(torch.eye(2), torch.eye(2), text_ids=["a", "b"])
            >>> m.compute_ranks().v2t.tolist()
            [0, 0]
        """
        return self._rank(gather_v2t=True).ranks()

    def _rank(self, gather_v2t: bool) -> RankCounts:
        """Check that every process is here, then rank the stored rows with the shared orchestration."""
        comm = _DistributedCollectives(self.process_group)
        comm.handshake()
        stored = sum(t.numel() * t.element_size() for t in (*self.video_features, *self.text_features))
        counts = rank_rows(
            _cat_state(self, "video_features"),
            _cat_state(self, "row_text_ids"),
            _cat_state(self, "text_features"),
            self._caption_ids(),
            sample_ids=_cat_state_or_none(self, "sample_ids"),
            video_ids=_cat_state_or_none(self, "video_ids"),
            protocol=self.protocol,
            v2t_gallery=self.v2t_gallery,
            ties=self.ties,
            video_block_size=self.video_block_size,
            text_block_size=self.text_block_size,
            memory_budget_bytes=self.memory_budget_bytes,
            device=self.device,
            collectives=comm,
            gather_v2t=gather_v2t,
        )
        if comm.active and not counts.sample_ids_given and comm.rank == 0:
            self._warn.warn(
                "padding",
                f"StreamingRetrievalMetric runs on {comm.world} processes without `sample_ids`: the samples Lightning's"
                " DistributedSampler repeats to pad the last batches are counted twice. Pass"
                " `update(..., sample_ids=...)` (e.g. the dataset index of each row) so repeats count once.",
            )
        self.last_compute_stats = {
            "num_rows": counts.num_rows,
            "num_videos": int(counts.plan.video_keys.numel()),
            "num_texts": int(counts.plan.text_keys.numel()),
            "embed_dim": counts.embed_dim,
            "block_sizes": counts.block_sizes,
            "stored_feature_bytes": stored,
        }
        return counts

    def _caption_ids(self) -> Tensor | None:
        """The stored caption ids, one per stored caption; ``None`` under ``protocol="paired"``."""
        if self.protocol == "paired":
            return None
        return _cat_state(self, "unique_text_ids")


def _optional_ids(ids: Any, name: str, n: int) -> Tensor | None:
    """``ids`` as an int64 id tensor (see ``as_id_tensor``), or ``None`` when not given."""
    if ids is None:
        return None
    return as_id_tensor(ids, name, n)


def _cat_state_or_none(metric: Metric, name: str) -> Tensor | None:
    """The state concatenated as :func:`_cat_state` does, or ``None`` when it is empty."""
    if not getattr(metric, name):
        return None
    return _cat_state(metric, name)


def _cat_state(metric: Metric, name: str) -> Tensor:
    """A list state concatenated (``dim_zero_cat``), kept as its one tensor; an empty tensor when it has no rows."""
    parts: list[Tensor] | Tensor = getattr(metric, name)
    if isinstance(parts, list) and not parts:
        features = name.endswith("features")
        return torch.empty((0, 0) if features else (0,), dtype=torch.float32 if features else torch.int64)
    joined = dim_zero_cat(parts)
    if isinstance(parts, list) and len(parts) > 1:
        parts[:] = [joined]  # the next compute does not concatenate again
    return joined
