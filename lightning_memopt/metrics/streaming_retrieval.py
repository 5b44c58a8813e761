"""StreamingRetrievalMetric: exact video<->text recall and ranks without the full similarity matrix, across ranks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torchmetrics import Metric
from typing_extensions import override

from lightning_memopt.functional.retrieval import (
    DEFAULT_MEMORY_BUDGET_BYTES,
    MEDIANS,
    PROTOCOLS,
    TIES,
    V2T_GALLERIES,
    Median,
    Protocol,
    RetrievalRanks,
    Ties,
    V2TGallery,
    _check_features,
    _first_occurrence,
    _top_k_tuple,
    as_id_tensor,
    count_ranks,
    embedding_keys,
    pair_scores,
    plan_retrieval,
    positive_thresholds,
    summarize_rank_histogram,
)
from lightning_memopt.utilities.checks import check_choice, check_positive_int
from lightning_memopt.utilities.warnings import WarnOnce

__all__ = ["StreamingRetrievalMetric"]


class StreamingRetrievalMetric(Metric):
    r"""Exact video->text and text->video R@K, median and mean rank, computed in blocks from CPU-held features.

    Each ``update`` adds one row per sample. Features are detached and kept on CPU (pinned when a GPU is present);
    captions repeated across rows (same ``text_ids``) are stored once. ``compute`` multiplies blocks of videos and
    texts on the metric's device and counts, for every query, the non-positive gallery items scoring above its best
    positive (``rank0``); no similarity matrix, sort or top-k is ever materialised. Definitions, with
    :math:`P(q)` the positives of query :math:`q`:

    .. math::

        \mathrm{rank0}(q) = \#\{g \notin P(q) : S[q, g] > \max_{p \in P(q)} S[q, p]\},\quad
        \mathrm{R@K} = \operatorname{mean}[\mathrm{rank0} < K],\quad
        \mathrm{MeanR} = \operatorname{mean}(\mathrm{rank0}) + 1,\quad
        \mathrm{MedR} = \lfloor\operatorname{median}(\mathrm{rank0})\rfloor + 1.

    Default protocol (``"dedup"``): the v2t gallery is the unique texts and a video's positives are its captions;
    the t2v gallery is the videos and a text's positives are all videos with that caption (rank of the best one).
    See :mod:`lightning_memopt.functional.retrieval` for the other protocols.

    Distributed: video features never leave their process. Processes share row ids, the unique text embeddings
    and per-text vectors; each counts its own videos against all texts, and the counts are summed (t2v ranks, v2t
    rank histogram) or max-reduced (best positive score per text). Repeated samples (the padding of Lightning's
    distributed validation sampler) count once when ``sample_ids`` are given; without them, under DDP, a warning
    says (once) that such repeats count twice. Synchronisation is done here, so torchmetrics' own gather-everything
    sync is turned off.

    **Every process calls** ``compute()``: it synchronises. Called on rank zero only (under ``if
    trainer.is_global_zero``) it cannot finish; its first collective is a handshake that turns the resulting
    collective error (after the process group's timeout) or a mismatch with another collective into an error that
    says so. The values it returns are the same on every process, so log them from every process with
    ``sync_dist=True, reduce_fx="max"``: that silences Lightning's "It is recommended to use ``sync_dist=True``"
    warning, and the max of equal values is exact (a mean over 3 processes may round)::

        def on_validation_epoch_end(self):
            self.log_dict(self.retrieval.compute(), sync_dist=True, reduce_fx="max")
            self.retrieval.reset()

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
            always off, see above).

    Ties are decided by ``ties`` alone: a caption or video embedded twice (an exact copy of a positive, under
    another id, on any process) ties with the positive whatever the block sizes and the world size. float64
    features are ranked in float32 (a warning says so once).

    Device requirements: none; on a GPU the blocks run there in full float32 (TF32 is switched off during
    ``compute`` and restored).

    Logged keys (from ``compute()``): ``v2t/R@{k}``, ``v2t/MedR``, ``v2t/MeanR``, ``t2v/R@{k}``, ``t2v/MedR``,
    ``t2v/MeanR``; R@K as fractions in [0, 1], ranks 1-based.

    Example:
        >>> import torch
        >>> metric = StreamingRetrievalMetric(top_k=(1,))
        >>> feats = torch.eye(4)
        >>> metric.update(feats, feats.clone(), text_ids=[0, 1, 2, 3], sample_ids=[0, 1, 2, 3])
        >>> metric.update(feats[:1], feats[:1].clone(), text_ids=[0], sample_ids=[0])  # a padding repeat
        >>> {k: round(v.item(), 3) for k, v in metric.compute().items()}
        {'v2t/R@1': 1.0, 'v2t/MedR': 1.0, 'v2t/MeanR': 1.0, 't2v/R@1': 1.0, 't2v/MedR': 1.0, 't2v/MeanR': 1.0}
    """

    is_differentiable: bool = False
    higher_is_better: bool | None = None
    full_state_update: bool = False

    video_features: list[Tensor]
    text_features: list[Tensor]
    row_text_ids: list[Tensor]
    sample_ids: list[Tensor]
    video_ids: list[Tensor]
    text_ids: list[Tensor]

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
        top_k = _top_k_tuple(top_k)
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
        for name in ("video_features", "row_text_ids", "sample_ids", "video_ids", "text_ids", "text_features"):
            self.add_state(name, default=[], dist_reduce_fx="cat")
        # Derived from the `text_ids` state: valid only for the exact state objects it was built from (see
        # `_known_text_ids`), so a load, merge, sync or reset can never leave it stale.
        self._seen_text_ids: set[int] = set()
        self._seen_token: tuple[Any, ...] | None = None
        self._warn = WarnOnce()

    # ------------------------------------------------------------------------------------------- update

    def _store(self, x: Tensor) -> Tensor:
        x = x.detach()
        if self.accumulate_on == "device":
            return x.to(self.device).clone() if x.device == self.device else x.to(self.device)
        if torch.cuda.is_available():
            out = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
            return out.copy_(x)
        return x.to("cpu").clone() if x.device.type == "cpu" else x.to("cpu")

    def _text_ids_token(self) -> tuple[Any, ...]:
        """What identifies the current `text_ids` state: its length and its first and last tensor objects."""
        ids = self.text_ids
        if isinstance(ids, Tensor):  # a synced state is one tensor
            return (ids,)
        return (len(ids), ids[0] if ids else None, ids[-1] if ids else None)

    def _known_text_ids(self) -> set[int]:
        """The caption ids stored so far; rebuilt whenever the state is not the one the cache was built from."""
        token, cached = self._text_ids_token(), self._seen_token
        same = (
            cached is not None
            and len(token) == len(cached)
            and all(a is b if not isinstance(a, int) else a == b for a, b in zip(token, cached))
        )
        if not same:  # loaded, merged, synced or reset: rebuild from the state itself
            ids = self.text_ids if isinstance(self.text_ids, list) else [self.text_ids]
            self._seen_text_ids = {int(i) for t in ids for i in t.tolist()}
            self._seen_token = token
        return self._seen_text_ids

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
            text_ids: ``B`` caption ids (ints, or strings hashed stably); required unless ``protocol="paired"``.
            sample_ids: ``B`` sample ids; repeated samples count once. Give them under DDP validation.
            video_ids: ``B`` video ids, for datasets with several captions per video.
        """
        _check_features(video_features, text_features)
        n, dim = video_features.shape
        stored_dim = self._feature_dim()
        if stored_dim is not None and dim != stored_dim:
            raise ValueError(
                f"`video_features` has feature dim {dim} but earlier updates had {stored_dim}. Use one embedding"
                " size per metric, or call `reset()` between evaluations."
            )
        if self.protocol == "dedup" and text_ids is None:
            raise ValueError("`text_ids` is required with protocol='dedup': pass one caption id (int or str) per row.")
        t_ids = as_id_tensor(text_ids, "text_ids", n) if text_ids is not None else torch.zeros(n, dtype=torch.int64)
        s_ids = as_id_tensor(sample_ids, "sample_ids", n) if sample_ids is not None else None
        v_ids = as_id_tensor(video_ids, "video_ids", n) if video_ids is not None else None
        for name, ids, state in (("sample_ids", s_ids, self.sample_ids), ("video_ids", v_ids, self.video_ids)):
            if (ids is None) != (len(state) == 0) and self.video_features:
                raise ValueError(f"`{name}` must be given in every update or in none, got a mix.")
        if n == 0:
            return
        self.video_features.append(self._store(video_features))
        self.row_text_ids.append(t_ids)
        if s_ids is not None:
            self.sample_ids.append(s_ids)
        if v_ids is not None:
            self.video_ids.append(v_ids)
        if self.protocol == "paired":
            self.text_features.append(self._store(text_features))
            return
        known = self._known_text_ids()
        new_rows = []
        for row, tid in enumerate(t_ids.tolist()):
            if tid not in known:
                known.add(tid)
                new_rows.append(row)
        if new_rows:
            idx = torch.tensor(new_rows, dtype=torch.int64)
            self.text_ids.append(t_ids[idx])
            self.text_features.append(self._store(text_features.detach().index_select(0, idx.to(text_features.device))))
            self._seen_token = self._text_ids_token()  # the cache already holds what was just appended

    @override
    def forward(self, *args: Any, **kwargs: Any) -> None:
        """Same as :meth:`update`: a per-batch retrieval value has no meaning, so nothing is computed."""
        self.update(*args, **kwargs)

    @override
    def reset(self) -> None:
        super().reset()
        self._seen_text_ids = set()
        self._seen_token = None

    @override
    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: Any, **kwargs: Any) -> None:
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        # torchmetrics keeps the caller's list objects as the states: later updates would append to the caller's
        # state dict (and to every other metric loaded from it). Own copies of the lists instead.
        for name in self._defaults:
            value = getattr(self, name)
            if isinstance(value, list):
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
        v2t_hist, t2v_ranks, _ = self._compute_ranks(gather_v2t=False)
        out = summarize_rank_histogram(v2t_hist, self.top_k, self.median, prefix="v2t/")
        t2v_hist = torch.bincount(t2v_ranks, minlength=1)
        out.update(summarize_rank_histogram(t2v_hist, self.top_k, self.median, prefix="t2v/"))
        return out

    def compute_ranks(self) -> RetrievalRanks:
        """Per-query ``rank0`` in both directions with the ids of the queries (gathered on every process).

        Example:
            >>> m = StreamingRetrievalMetric()
            >>> m.update(torch.eye(2), torch.eye(2), text_ids=["a", "b"])
            >>> m.compute_ranks().v2t.tolist()
            [0, 0]
        """
        _, t2v_ranks, extra = self._compute_ranks(gather_v2t=True)
        assert extra is not None
        v2t, video_keys, text_keys, v2t_size, t2v_size = extra
        return RetrievalRanks(v2t, t2v_ranks, video_keys, text_keys, v2t_size, t2v_size)

    def _compute_ranks(self, gather_v2t: bool) -> tuple[Tensor, Tensor, tuple | None]:
        comm = _Comm(self.process_group)
        comm.handshake()
        n_local = sum(t.shape[0] for t in self.video_features)
        dim_local = int(self.video_features[0].shape[1]) if self.video_features else 0
        has_samples = 1 if self.sample_ids else 0
        has_videos = 1 if self.video_ids else 0
        meta = comm.all_gather_rows(torch.tensor([[n_local, dim_local, has_samples, has_videos]]))
        sizes = meta[:, 0].tolist()
        nonempty = meta[meta[:, 0] > 0]
        if nonempty.shape[0] == 0:
            raise ValueError(
                "`StreamingRetrievalMetric.compute()` found no rows on any process: call `update()` with features"
                " first (or check that the validation loop ran)."
            )
        dims = set(nonempty[:, 1].tolist())
        if len(dims) > 1:
            raise ValueError(f"Processes hold features of different dims {sorted(dims)}; use one embedding size.")
        for col, name in ((2, "sample_ids"), (3, "video_ids")):
            if len(set(nonempty[:, col].tolist())) > 1:
                raise ValueError(f"`{name}` were given on some processes and not on others; give them everywhere.")
        dim = dims.pop()
        use_samples, use_videos = bool(nonempty[0, 2]), bool(nonempty[0, 3])
        if comm.active and not use_samples and comm.rank == 0:
            self._warn.warn(
                "padding",
                f"StreamingRetrievalMetric runs on {comm.world} processes without `sample_ids`: the samples Lightning's"
                " DistributedSampler repeats to pad the last batches are counted twice. Pass"
                " `update(..., sample_ids=...)` (e.g. the dataset index of each row) so repeats count once.",
            )
        rank = comm.rank
        offset = sum(sizes[:rank])

        # compact the row states into one tensor each (frees the per-batch pieces)
        video = _cat_state(self, "video_features", (0, dim))
        row_text = _cat_state(self, "row_text_ids", (0,))
        local_row_keys = _cat_state(self, "sample_ids", (0,)) if use_samples else torch.arange(offset, offset + n_local)
        local_video_keys = _cat_state(self, "video_ids", (0,)) if use_videos else local_row_keys
        paired = self.protocol == "paired"
        local_text_keys = local_row_keys if paired else row_text

        # global id tables (ints only), in rank order
        table = comm.all_gather_rows(torch.stack([local_row_keys, local_video_keys, local_text_keys], 1))
        row_rank = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
        plan = plan_retrieval(table[:, 0], table[:, 1], table[:, 2])
        n_video, n_text = plan.video_keys.numel(), plan.text_keys.numel()

        # the text gallery: each unique text is sent once, by the first process that holds it
        if paired:
            my_text_keys, my_text_feats = local_row_keys, _cat_state(self, "text_features", (0, dim))
        else:
            my_text_keys = _cat_state(self, "text_ids", (0,))
            my_text_feats = _cat_state(self, "text_features", (0, dim))
        all_text_keys = comm.all_gather_rows(my_text_keys.unsqueeze(1)).squeeze(1)
        text_counts = comm.all_gather_rows(torch.tensor([[my_text_keys.numel()]]))[:, 0].tolist()
        my_start = sum(text_counts[:rank])
        _, first, _ = _first_occurrence(all_text_keys)
        owned = first[(first >= my_start) & (first < my_start + my_text_keys.numel())] - my_start
        wanted = torch.isin(my_text_keys[owned], plan.text_keys)
        owned = owned[wanted]
        sent_keys = comm.all_gather_rows(my_text_keys[owned].unsqueeze(1)).squeeze(1)
        sent_feats = comm.all_gather_rows(my_text_feats[owned].float(), width=dim)
        text = torch.empty(n_text, dim, dtype=torch.float32)
        text[torch.searchsorted(plan.text_keys, sent_keys)] = sent_feats
        del sent_feats, all_text_keys

        # this process's videos: those whose first kept row lives here
        video_owner = row_rank[plan.video_rows]
        mine = (video_owner == rank).nonzero().squeeze(1)
        local_rows = plan.video_rows[mine] - offset
        if local_rows.numel() == video.shape[0] and bool((local_rows == torch.arange(video.shape[0])).all()):
            my_video = video
        else:
            my_video = video.index_select(0, local_rows)
        local_index = torch.full((n_video,), -1, dtype=torch.int64)
        local_index[mine] = torch.arange(mine.numel())
        pair_mask = local_index[plan.pair_video] >= 0
        pv = local_index[plan.pair_video[pair_mask]]
        pt = plan.pair_text[pair_mask]

        # exact copies of a positive video may sit on another process: share one key per video, so every process
        # gives its copies the positive's own score (see `count_ranks`); only keys held more than once travel on
        keys = comm.all_gather_rows(torch.stack([mine, embedding_keys(my_video)], 1))
        video_key = torch.empty(n_video, dtype=torch.int64)
        video_key[keys[:, 0]] = keys[:, 1]
        _, key_index, key_count = torch.unique(video_key, return_inverse=True, return_counts=True)
        shared = key_count[key_index[plan.pair_video]] > 1
        positive_video_keys = (plan.pair_text[shared], video_key[plan.pair_video[shared]])

        device = self.device
        with torch.no_grad():
            scores = pair_scores(my_video, text, pv, pt)
        v_thr = positive_thresholds(scores, pv, mine.numel())
        t_thr = comm.all_reduce(positive_thresholds(scores, pt, n_text), dist.ReduceOp.MAX)
        grouped = self.v2t_gallery == "groups"
        v_counts, t_counts = count_ranks(
            my_video,
            text,
            pv,
            pt,
            v_thr,
            t_thr,
            ties=self.ties,
            video_groups=mine if grouped else None,
            group_pairs=(plan.pair_text, plan.pair_video, n_video) if grouped else None,
            positive_scores=scores,
            positive_video_keys=positive_video_keys,
            video_block_size=self.video_block_size,
            text_block_size=self.text_block_size,
            memory_budget_bytes=self.memory_budget_bytes,
            device=device,
        )
        t2v = comm.all_reduce(t_counts, dist.ReduceOp.SUM)
        v2t_size = n_video if grouped else n_text
        hist = comm.all_reduce(torch.bincount(v_counts, minlength=v2t_size), dist.ReduceOp.SUM)
        extra = None
        if gather_v2t:
            gathered = comm.all_gather_rows(torch.stack([mine, v_counts], 1))
            v2t = torch.empty(n_video, dtype=torch.int64)
            v2t[gathered[:, 0]] = gathered[:, 1]
            extra = (v2t, plan.video_keys, plan.text_keys, v2t_size, n_video)
        return hist, t2v, extra


def _cat_state(metric: Metric, name: str, empty_shape: tuple[int, ...]) -> Tensor:
    """Concatenate a list state in place (one tensor afterwards) and return it; empty tensor when no rows."""
    parts: list[Tensor] = getattr(metric, name)
    if not parts:
        dtype = torch.float32 if len(empty_shape) == 2 else torch.int64
        return torch.empty(empty_shape, dtype=dtype)
    if len(parts) > 1:
        joined = torch.cat(parts, 0)
        parts.clear()
        parts.append(joined)
    return parts[0]


#: The first thing every process sends in ``compute()``: a value no other collective is likely to carry.
_HANDSHAKE = 0x5EED_C0DE_2025


class _Comm:
    """The few collectives the metric needs; a no-op world of one when not distributed."""

    def __init__(self, group: Any = None) -> None:
        self.group = group
        self.active = dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
        self.rank = dist.get_rank(group) if self.active else 0
        self.world = dist.get_world_size(group) if self.active else 1
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
        try:
            dist.all_gather(out, token, group=self.group)
        except RuntimeError as err:
            raise RuntimeError(f"{problem} The first collective of compute() failed: {err}") from err
        got = torch.cat(out).cpu()
        stray = ((got[:, 0] != _HANDSHAKE) | (got[:, 2] != _HANDSHAKE)).nonzero().flatten().tolist()
        if stray:
            raise RuntimeError(f"{problem} Process(es) {stray} were in another collective.")

    def all_reduce(self, x: Tensor, op: Any) -> Tensor:
        if not self.active:
            return x
        y = x.to(self.device).clone()
        dist.all_reduce(y, op=op, group=self.group)
        return y.to(x.device)

    def all_gather_rows(self, x: Tensor, width: int | None = None) -> Tensor:
        """Concatenate every process's rows of a 2-D tensor (row counts may differ), in rank order."""
        if x.dim() == 1:
            x = x.unsqueeze(1)
        if width is not None and x.shape[1] != width:
            x = x.reshape(0, width)
        if not self.active:
            return x
        n = torch.tensor([x.shape[0]], dtype=torch.int64, device=self.device)
        counts = [torch.zeros_like(n) for _ in range(self.world)]
        dist.all_gather(counts, n, group=self.group)
        counts_i = [int(c.item()) for c in counts]
        most = max(counts_i)
        padded = torch.zeros((most, *x.shape[1:]), dtype=x.dtype, device=self.device)
        padded[: x.shape[0]] = x.to(self.device)
        out = [torch.empty_like(padded) for _ in range(self.world)]
        dist.all_gather(out, padded, group=self.group)
        return torch.cat([o[:c] for o, c in zip(out, counts_i)], 0).to(x.device)
