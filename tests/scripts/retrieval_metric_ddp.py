"""Two gloo processes (forked) and one process run the same StreamingRetrievalMetric scenarios; results go to JSON.

Usage: ``python retrieval_metric_ddp.py PORT``; writes ``res_1_0.json`` (world size 1) and ``res_2_{rank}.json``.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_memopt import StreamingRetrievalMetric
from tests.helpers.retrieval import duplicated_data, make_data


def scenarios():
    video, text, ids = make_data(n=41, d=4, n_captions=13, seed=5)
    sample = torch.arange(41)
    # a caption whose videos all sit on rank 1, repeated captions, and the sampler's padding (samples 0, 1 again)
    ids[21:25] = 99
    text[21:25] = text[21]
    padded = torch.cat([sample, sample[:1]])
    rank_rows = {0: padded[0::2], 1: padded[1::2]}
    yield "padded", video, text, ids, sample, None, rank_rows, {}
    yield "empty_rank", video, text, ids, sample, None, {0: sample, 1: sample[:0]}, {"ties": "pessimistic"}
    vid_ids = sample // 3  # a video's captions split over both ranks
    vfeat = video[vid_ids * 3]
    yield "video_ids", vfeat, text, ids, sample, vid_ids, rank_rows, {"v2t_gallery": "groups"}
    yield "paired", video, text, ids, sample, None, rank_rows, {"protocol": "paired", "median": "mean"}
    # exact copies of captions and videos under other ids, split over both ranks (rows alternate between ranks)
    video, text, ids = duplicated_data()
    sample = torch.arange(48)
    split = {0: sample[0::2], 1: sample[1::2]}
    for blocks in (1, 7, None):
        for ties in ("optimistic", "pessimistic"):
            opts = {"ties": ties, "video_block_size": blocks, "text_block_size": blocks}
            yield f"copies_{blocks}_{ties}", video, text, ids, sample, None, split, opts


def run(rank, world, out, port):
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        dist.init_process_group("gloo", rank=rank, world_size=world)
    results = {}
    for name, video, text, ids, sample, vid_ids, rank_rows, opts in scenarios():
        rows = torch.cat(list(rank_rows.values())) if world == 1 else rank_rows[rank]
        m = StreamingRetrievalMetric(top_k=(1, 3), **({"video_block_size": 3, "text_block_size": 4} | opts))
        for start in range(0, rows.numel(), 4):
            r = rows[start : start + 4]
            m.update(
                video[r],
                text[r],
                ids[r],
                sample_ids=sample[r],
                video_ids=vid_ids[r] if vid_ids is not None else None,
            )
        res = {k: v.item() for k, v in m.compute().items()}
        ranks = m.compute_ranks()
        res["v2t_ranks"] = dict(zip(ranks.video_ids.tolist(), ranks.v2t.tolist()))
        res["t2v_ranks"] = dict(zip(ranks.text_ids.tolist(), ranks.t2v.tolist()))
        res["stored_videos"] = sum(t.shape[0] for t in m.video_features)
        stats = m.last_compute_stats  # global sizes: the same in every world size
        res["stats"] = {k: stats[k] for k in ("num_rows", "num_videos", "num_texts", "embed_dim")}
        results[name] = res
    with open(f"{out}_{world}_{rank}.json", "w") as f:
        json.dump(results, f)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    # fork before any parallel work in this process: the children start in milliseconds, imports inherited
    mp.start_processes(run, args=(2, "res", sys.argv[1]), nprocs=2, start_method="fork")
    run(0, 1, "res", sys.argv[1])
