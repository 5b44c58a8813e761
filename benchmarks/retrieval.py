"""StreamingRetrievalMetric vs the chunked matrix-product floor, the naive full matrix and torchmetrics.

Times are measured side by side in one process, alternating the configurations, repeated; the medians and
their ratios are printed. Peak memory is the peak RSS (CPU) or peak allocated bytes (CUDA) of each
configuration run alone in its own process.

    python benchmarks/retrieval.py --quick                  # seconds: a smoke test of every path
    python benchmarks/retrieval.py                          # 20,000 x 5,000 x 512 and 117,000 x 23,000 x 512
    python benchmarks/retrieval.py --device cuda --sizes 117k --out benchmarks/results/gpu/retrieval_cuda.json

Rows are samples (one video each); captions repeat: 117,000 rows share 23,000 unique captions, as in the
CLIP-style run that motivated the metric. The metric holds the unique captions once and counts both directions.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from _machine import machine_info  # noqa: E402  (benchmarks/_machine.py)

from lightning_memopt.functional.retrieval import choose_block_sizes, full_fp32_matmul  # noqa: E402
from lightning_memopt.metrics.streaming_retrieval import StreamingRetrievalMetric  # noqa: E402

SIZES = {
    "quick": (2_000, 500, 64),
    "20k": (20_000, 5_000, 512),
    "117k": (117_000, 23_000, 512),
}
BATCH = 1024
TORCHMETRICS_MAX_PAIRS = 100_000_000  # 20k x 5k: ~8 GB at compute; larger sizes are refused


# ----------------------------------------------------------------------------------------------- data
def caption_ids(n_rows: int, n_captions: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    ids = torch.cat([torch.arange(n_captions), torch.randint(0, n_captions, (n_rows - n_captions,), generator=gen)])
    return ids[torch.randperm(n_rows, generator=gen)]


def caption_table(n_captions: int, dim: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(2)
    return torch.nn.functional.normalize(torch.randn(n_captions, dim, generator=gen), dim=1)


def video_batch(start: int, stop: int, ids: torch.Tensor, captions: torch.Tensor) -> torch.Tensor:
    """Videos correlated with their caption (so ranks are spread out), generated batch by batch."""
    gen = torch.Generator().manual_seed(1000 + start)
    noise = torch.randn(stop - start, captions.shape[1], generator=gen)
    return torch.nn.functional.normalize(
        captions[ids[start:stop]] + 1.5 * noise / math.sqrt(captions.shape[1]) * 8, dim=1
    )


def filled_metric(size: str, device: str) -> tuple[StreamingRetrievalMetric, float]:
    n, n_captions, dim = SIZES[size]
    ids, captions = caption_ids(n, n_captions), caption_table(n_captions, dim)
    metric = StreamingRetrievalMetric(compute_with_cache=False).to(device)
    start_t = time.perf_counter()
    for start in range(0, n, BATCH):
        stop = min(n, start + BATCH)
        metric.update(
            video_batch(start, stop, ids, captions).to(device),
            captions[ids[start:stop]].to(device),
            ids[start:stop],
            sample_ids=torch.arange(start, stop),
        )
    return metric, time.perf_counter() - start_t


def gallery(metric: StreamingRetrievalMetric) -> tuple[torch.Tensor, torch.Tensor]:
    video = torch.cat(metric.video_features)
    text = torch.cat(metric.text_features)
    return video, text


# ----------------------------------------------------------------------------------------------- configs
def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_floor(video: torch.Tensor, text: torch.Tensor, device: str) -> None:
    """The compute floor: the same blocked matrix product, nothing else (blocks moved to the device the same way)."""
    bv, bt = choose_block_sizes(video.shape[0], text.shape[0], video.shape[1], device)
    text32 = text.to(device=device, dtype=torch.float32)
    buf = torch.empty(bv * min(bt, text.shape[0]), device=device)
    with full_fp32_matmul(), torch.no_grad():
        for v0 in range(0, video.shape[0], bv):
            vb = video[v0 : v0 + bv].to(device=device, dtype=torch.float32, non_blocking=True)
            for t0 in range(0, text.shape[0], bt):
                tb = text32[t0 : t0 + bt]
                torch.mm(vb, tb.T, out=buf[: vb.shape[0] * tb.shape[0]].view(vb.shape[0], tb.shape[0]))
    sync(device)


def run_ours(metric: StreamingRetrievalMetric, device: str) -> dict:
    out = metric.compute()
    sync(device)
    return {k: round(v.item(), 6) for k, v in out.items()}


def run_naive(metric: StreamingRetrievalMetric, device: str) -> dict:
    """Full score matrix + argsort in both directions (what an evaluation loop without chunking does)."""
    video, text = gallery(metric)
    video, text = video.to(device), text.to(device)
    row_text = torch.searchsorted(torch.cat(metric.unique_text_ids).sort().values, torch.cat(metric.row_text_ids))
    order = torch.cat(metric.unique_text_ids).argsort()
    text = text[order]
    with full_fp32_matmul(), torch.no_grad():
        scores = video @ text.T
        ranking = scores.argsort(dim=1, descending=True)
        v2t = (ranking == row_text.to(device)[:, None]).float().argmax(1)
        del ranking
        ranking = scores.T.argsort(dim=1, descending=True)
        positives = torch.zeros_like(scores, dtype=torch.bool)
        positives[torch.arange(video.shape[0], device=device), row_text.to(device)] = True
        hits = positives.T.gather(1, ranking)
        t2v = hits.float().argmax(1)
    sync(device)
    return {"v2t/R@1": (v2t < 1).float().mean().item(), "t2v/R@1": (t2v < 1).float().mean().item()}


def run_torchmetrics(metric: StreamingRetrievalMetric, device: str) -> dict:
    """torchmetrics RetrievalHitRate@1, video->text only (one direction; the metric above does both)."""
    from torchmetrics.retrieval import RetrievalHitRate

    video, text = gallery(metric)
    order = torch.cat(metric.unique_text_ids).argsort()
    text = text[order]
    row_text = torch.searchsorted(torch.cat(metric.unique_text_ids).sort().values, torch.cat(metric.row_text_ids))
    n, m = video.shape[0], text.shape[0]
    if n * m > TORCHMETRICS_MAX_PAIRS:
        raise SystemExit(f"refusing torchmetrics at {n} x {m}: it would need ~{n * m * 80 / 1e9:.0f} GB")
    hit_rate = RetrievalHitRate(top_k=1)
    with torch.no_grad():
        for v0 in range(0, n, BATCH):
            scores = video[v0 : v0 + BATCH] @ text.T
            target = torch.zeros_like(scores, dtype=torch.bool)
            target[torch.arange(scores.shape[0]), row_text[v0 : v0 + BATCH]] = True
            index = torch.arange(v0, v0 + scores.shape[0])[:, None].expand_as(scores)
            hit_rate.update(scores.flatten(), target.flatten(), indexes=index.flatten())
        value = hit_rate.compute()
    return {"v2t/R@1": round(value.item(), 6)}


CONFIGS = {"floor": None, "ours": run_ours, "naive": run_naive, "torchmetrics": run_torchmetrics}


def run_config(name: str, metric: StreamingRetrievalMetric, device: str) -> tuple[float, dict]:
    sync(device)
    start = time.perf_counter()
    if name == "floor":
        video, text = gallery(metric)
        run_floor(video, text, device)
        result: dict = {}
    else:
        result = CONFIGS[name](metric, device)
    return time.perf_counter() - start, result


# ----------------------------------------------------------------------------------------------- modes
def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def worker(size: str, config: str, device: str) -> dict:
    """One configuration alone in this process: time and peak memory."""
    metric, update_s = filled_metric(size, device)
    base_rss = peak_rss_bytes()
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
        base_alloc = torch.cuda.memory_allocated()
    extra = {}
    if config == "torchmetrics":  # the ratio is taken side by side in this process, ours first (torchmetrics
        # leaves gigabytes of freed pages behind that slow whatever runs next)
        extra["ours_seconds_same_process"] = min(run_config("ours", metric, device)[0] for _ in range(2))
    seconds, result = run_config(config, metric, device)
    if config == "naive":
        extra["floor_seconds_same_process"], _ = run_config("floor", metric, device)
    out = {
        **extra,
        "size": size,
        "config": config,
        "device": device,
        "seconds": seconds,
        "update_seconds": update_s,
        "peak_rss_bytes": peak_rss_bytes(),
        "rss_before_compute_bytes": base_rss,
        "result": result,
    }
    if device.startswith("cuda"):
        out["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
        out["allocated_before_compute_bytes"] = base_alloc
    return out


def side_by_side(size: str, configs: list[str], repeats: int, device: str) -> dict:
    metric, update_s = filled_metric(size, device)
    times: dict[str, list[float]] = {c: [] for c in configs}
    results: dict[str, dict] = {}
    for _ in range(repeats):
        for config in configs:
            seconds, results[config] = run_config(config, metric, device)
            times[config].append(seconds)
            print(f"  {size} {config:>12}: {seconds:8.3f} s", flush=True)
    med = {c: statistics.median(t) for c, t in times.items()}
    ratios = {f"{c}/floor": med[c] / med["floor"] for c in configs if c != "floor"}
    return {
        "size": size,
        "device": device,
        "repeats": repeats,
        "update_seconds": update_s,
        "times": times,
        "median_seconds": med,
        "ratios": ratios,
        "results": results,
    }


def in_own_process(size: str, config: str, device: str, timeout: int) -> dict:
    cmd = [sys.executable, __file__, "--worker", config, "--sizes", size, "--device", device]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        return {"size": size, "config": config, "error": proc.stderr[-2000:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one repeat: a smoke test of every path")
    parser.add_argument("--sizes", default=None, help="comma-separated: quick, 20k, 117k")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--no-torchmetrics", action="store_true", help="skip torchmetrics (it needs ~8 GB at 20k)")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()

    sizes = (args.sizes or ("quick" if args.quick else "20k,117k")).split(",")
    if args.worker:
        print(json.dumps(worker(sizes[0], args.worker, args.device)))
        return 0
    repeats = args.repeats or (1 if args.quick else 3)
    report: dict = {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": machine_info(args.device),
        "device": args.device if not args.device.startswith("cuda") else torch.cuda.get_device_name(),
        "side_by_side": [],
        "own_process": [],
    }
    for size in sizes:
        n, m, _ = SIZES[size]
        # the naive full matrix is slow (minutes at 20k on 2 cores): it runs once, alone, beside one floor pass
        configs = ["floor", "ours"]
        print(f"== {size}: {SIZES[size]} side by side, {repeats} repeat(s)", flush=True)
        report["side_by_side"].append(
            side_by_side(size, configs, repeats if size != "117k" else min(repeats, 2), args.device)
        )
        own = ["floor", "ours"] + (["naive"] if n * m <= TORCHMETRICS_MAX_PAIRS else [])
        if not args.no_torchmetrics and n * m <= TORCHMETRICS_MAX_PAIRS:
            own.append("torchmetrics")
        for config in own:
            # --quick stays in this process (seconds, for smoke tests); real runs isolate each configuration
            res = worker(size, config, args.device) if args.quick else in_own_process(size, config, args.device, 1800)
            res["isolated"] = not args.quick
            report["own_process"].append(res)
            peak = res.get("peak_allocated_bytes", res.get("peak_rss_bytes", 0))
            print(
                f"  {size} {config:>12} alone: {res.get('seconds', float('nan')):8.3f} s, peak "
                f"{peak / 2**30:6.2f} GiB {'(allocated)' if 'peak_allocated_bytes' in res else '(RSS)'}",
                flush=True,
            )
    print("== summary")
    for block in report["side_by_side"]:
        ratios = ", ".join(f"{k} {v:.2f}x" for k, v in block["ratios"].items())
        print(f"  {block['size']}: floor {block['median_seconds']['floor']:.3f} s; {ratios}")
    by = {(r["size"], r["config"]): r for r in report["own_process"] if "seconds" in r}
    for size in sizes:
        if (size, "naive") in by:
            naive = by[(size, "naive")]
            ratio = naive["seconds"] / naive["floor_seconds_same_process"]
            report.setdefault("naive_over_floor", {})[size] = ratio
            print(f"  {size}: naive full matrix + argsort / floor = {ratio:.1f}x (same process)")
        if (size, "torchmetrics") in by and (size, "ours") in by:
            tm = by[(size, "torchmetrics")]
            ratio = tm["seconds"] / tm.get("ours_seconds_same_process", by[(size, "ours")]["seconds"])
            report.setdefault("torchmetrics_over_ours", {})[size] = ratio
            print(f"  {size}: torchmetrics RetrievalHitRate (one direction) / ours (both) = {ratio:.1f}x")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
