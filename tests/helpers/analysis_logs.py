"""Memory log records and files as MemoryMonitor and MemoryAudit write them, for the analysis tests."""

from __future__ import annotations

import json


def rec(t, phase, event, step, alloc=None, peak=None, rank=0, **extra):
    return {
        "time": t,
        "rank": rank,
        "phase": phase,
        "event": event,
        "epoch": 0,
        "global_step": step,
        "batch_idx": None,
        "device": "cuda:0",
        "allocated_bytes": alloc,
        "reserved_bytes": None if alloc is None else alloc * 2,
        "peak_allocated_bytes": peak,
        "device_total_bytes": 10_000,
        "host_rss_bytes": 50,
        **extra,
    }


def write(path, records, tail=""):
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)
    return path


TRAIN_STEPS = range(10, 410, 10)  # 40 readings over 390 steps: enough to judge growth


def write_good_log(tmp_path):
    """A rank-0 log: 40 train steps growing 3 bytes a step, a short validation, one threshold warning."""
    records = [rec(0.0, "train", "phase_start", 0, 100, 100)]
    records += [rec(float(s), "train", "step", s, 100 + 3 * s, 100 + 3 * s + 50) for s in TRAIN_STEPS]
    records += [
        rec(4.5, "validate", "phase_start", 40, 200, 200),
        rec(4.6, "validate", "step", 40, 2000, 2500),
        rec(4.7, "validate", "phase_end", 40, 200, 2500, phase_peak_allocated_bytes=2500),
        rec(5.0, "train", "warning", 50, 9500, field="allocated_bytes"),
        rec(411.0, "train", "phase_end", 400, 400, 700, phase_peak_allocated_bytes=9600),
    ]
    return write(tmp_path / "memory_rank0.jsonl", records)


def jsonl_text(records):
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records)


def step_records(n, rank=0, t0=0.0, every=1, **extra):
    return [rec(t0 + s, "train", "step", every * s, 1000 + 10 * s, rank=rank, **extra) for s in range(1, n + 1)]


MiB = 1024**2


DUPLICATES_MESSAGE = (
    "MemoryAudit [rank 0] (first step): 30 tensors on cpu (869.08 KiB = 889936 bytes, dtypes float32) are not owned"
    " by the model or optimizer but have the shapes of its parameters: 1.00x the parameters' elements. Held at"
    " ema_model. Likely cause: a copy of the model (deepcopy, EMA). Largest: (256, 256) float32 256.00 KiB."
)


LEAK_MESSAGE = (
    "MemoryAudit [rank 0]: Live tensor memory on cpu grows by 1.00 MiB per optimizer step (1048576 bytes/step, 99.00"
    " MiB over steps 200-300), first seen at step 210. No attribute of the LightningModule holds tensors with autograd"
    " history. Usual causes: tensors with autograd history kept in a list or attribute."
)


def audit_records(run_id="r1", t0=0.0):
    """A CPU run as MemoryMonitor and MemoryAudit write it: host RSS only, an audit, a duplicate and a leak finding."""

    def cpu(t, event, step, **extra):
        return dict(
            rec(t0 + t, "train", event, step),
            device="cpu",
            allocated_bytes=None,
            reserved_bytes=None,
            device_total_bytes=None,
            host_rss_bytes=500 * MiB + step * 1024,
            run_id=run_id,
            **extra,
        )

    records = [cpu(0.0, "phase_start", 0), cpu(0.5, "audit", 0, audit="fit_start", footprint={"parameters": {}})]
    records += [cpu(float(s), "step", s) for s in range(10, 410, 10)]
    records += [
        cpu(
            1.5,
            "warning",
            1,
            check="duplicates",
            message=DUPLICATES_MESSAGE,
            duplicate_bytes=889936,
            num_duplicate_tensors=30,
        ),
        cpu(
            300.5,
            "warning",
            300,
            check="leak",
            message=LEAK_MESSAGE,
            bytes_per_step=1048576.0,
            first_step=210,
            samples=[[200, 1], [300, 2]],
            grad_fn_holders=[],
        ),
        cpu(401.0, "phase_end", 400),
    ]
    return sorted(records, key=lambda r: r["time"])
