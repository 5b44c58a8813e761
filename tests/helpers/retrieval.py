"""Shared retrieval test data and the independent references: full-matrix ranks and exactly rounded scores."""

from __future__ import annotations

import math

import torch

__all__ = ["duplicated_data", "exact_scores", "make_data", "quantized", "reference_ranks"]


def reference_ranks(
    video,
    text,
    text_ids=None,
    video_ids=None,
    sample_ids=None,
    protocol="dedup",
    v2t_gallery="texts",
    ties="optimistic",
    scores=None,
):
    """Plain full-matrix ranks in float64, with python loops over queries: deliberately nothing shared.

    ``scores(V, T)`` gives the score matrix (default ``V @ T.T`` in float64).
    """
    n = video.shape[0]
    rows, seen = [], set()
    for i in range(n):
        key = int(sample_ids[i]) if sample_ids is not None else i
        if key not in seen:
            seen.add(key)
            rows.append(i)
    vkey = (
        (lambda i: int(video_ids[i]))
        if video_ids is not None
        else (lambda i: int(sample_ids[i]) if sample_ids is not None else i)
    )
    if protocol == "paired":
        tkey = lambda i: int(sample_ids[i]) if sample_ids is not None else i  # noqa: E731
    else:
        tkey = lambda i: int(text_ids[i])  # noqa: E731
    videos, texts = {}, {}
    for i in rows:
        videos.setdefault(vkey(i), i)
        texts.setdefault(tkey(i), i)
    vk = list(videos)
    tk = sorted(texts)
    V = torch.stack([video[videos[k]] for k in vk]).double()
    T = torch.stack([text[texts[k]] for k in tk]).double()
    S = V @ T.T if scores is None else scores(V, T)
    pos_v = {k: set() for k in vk}
    for i in rows:
        pos_v[vkey(i)].add(tk.index(tkey(i)))
    beats = (lambda a, b: a > b) if ties == "optimistic" else (lambda a, b: a >= b)
    v2t = []
    for qi, k in enumerate(vk):
        best = max(S[qi, p].item() for p in pos_v[k])
        if v2t_gallery == "texts":
            v2t.append(sum(1 for g in range(len(tk)) if g not in pos_v[k] and beats(S[qi, g].item(), best)))
        else:
            count = 0
            for gi, gk in enumerate(vk):
                if gi != qi and beats(max(S[qi, p].item() for p in pos_v[gk]), best):
                    count += 1
            v2t.append(count)
    t2v = []
    for ti in range(len(tk)):
        pos = {vi for vi, k in enumerate(vk) if ti in pos_v[k]}
        best = max(S[p, ti].item() for p in pos)
        t2v.append(sum(1 for g in range(len(vk)) if g not in pos and beats(S[g, ti].item(), best)))
    return torch.tensor(v2t), torch.tensor(t2v)


def quantized(gen, shape, scale=8, low=-8, high=9):
    """Features k/scale: every product and sum is exact in float32/float16/bfloat16, so ties are exact ties."""
    return torch.randint(low, high, shape, generator=gen).float() / scale


def make_data(n=40, d=8, n_captions=None, seed=0, kind="quantized"):
    gen = torch.Generator().manual_seed(seed)
    make = (lambda s: quantized(gen, s)) if kind == "quantized" else (lambda s: torch.randn(s, generator=gen))
    n_captions = n_captions or n
    caption_of_row = torch.randint(0, n_captions, (n,), generator=gen)
    caption_feats = make((n_captions, d))
    return make((n, d)), caption_feats[caption_of_row].clone(), caption_of_row


def exact_scores(video, text):
    """Every score as the correctly rounded sum of exact products: equal rows give equal scores, by construction."""
    vs, ts = video.tolist(), text.tolist()
    return torch.tensor([[math.fsum(a * b for a, b in zip(v, t)) for t in ts] for v in vs], dtype=torch.float64)


def duplicated_data(n=48, d=32, seed=3):
    """Gaussian features (so the float32 block products round) with exact copies under other ids.

    Rows 30-35 carry copies of the captions of rows 0-5, rows 36-41 copies of the videos of rows 6-11, rows 42-43 a
    copy of row 12's caption and video both. Every row has its own caption id and video id.
    """
    gen = torch.Generator().manual_seed(seed)
    video = torch.randn(n, d, generator=gen)
    text = video + 0.7 * torch.randn(n, d, generator=gen)
    text[30:36] = text[0:6]
    video[36:42] = video[6:12]
    text[42:44] = text[12]
    video[42:44] = video[12]
    return video, text, torch.arange(n)
