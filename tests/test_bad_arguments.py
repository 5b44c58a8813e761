"""Every public constructor and function refuses a bad argument at once, naming it and the value received.

One table: ``(callable, kwargs, expected exception, fragments the message must contain)``. The fragments are the
argument in backticks and the repr of the bad value (for tensors, the repr of the offending dtype or count).
"""

from __future__ import annotations

import time

import pytest
import torch

from lightning_memopt import (
    CacheCleaner,
    GarbageCollector,
    GradientCheckpointing,
    MemoryAudit,
    MemoryMonitor,
    MemoryPrecision,
    MemoryPreset,
    OOMReporter,
    StreamingRetrievalMetric,
    read_memory,
    to_device_and_dtype,
)
from lightning_memopt.analysis import analyze_memory_logs, load_memory_log, plot_memory_timeline
from lightning_memopt.functional import reset_peak_memory
from lightning_memopt.functional.presets import plan_accumulation, tier_for_memory
from lightning_memopt.functional.retrieval import retrieval_ranks, streaming_retrieval

NAN, INF = float("nan"), float("inf")


def says(name: str, value: object) -> tuple[str, str]:
    """The fragments every message must hold: the argument in backticks and the repr of the value."""
    return f"`{name}`", repr(value)


def update(**kwargs: object) -> None:
    """One ``StreamingRetrievalMetric.update`` of two rows, with ``kwargs`` replacing the good arguments."""
    args: dict[str, object] = {
        "video_features": torch.zeros(2, 3),
        "text_features": torch.zeros(2, 3),
        "text_ids": [0, 1],
    }
    args.update(kwargs)
    StreamingRetrievalMetric().update(**args)


def ranks(**kwargs: object) -> None:
    """``retrieval_ranks`` of two rows, with ``kwargs`` replacing the good arguments."""
    args: dict[str, object] = {"video_features": torch.eye(2), "text_features": torch.eye(2), "text_ids": [0, 1]}
    args.update(kwargs)
    retrieval_ranks(**args)


def retrieval(**kwargs: object) -> None:
    """``streaming_retrieval`` of two rows, with ``kwargs`` replacing the good arguments."""
    streaming_retrieval(torch.eye(2), torch.eye(2), [0, 1], **kwargs)


def merge(**kwargs: object) -> None:
    """``MemoryPreset().merge_trainer_config(...)``."""
    MemoryPreset().merge_trainer_config(**kwargs)


def row(target, kwargs, fragments, error=ValueError, case=None):
    return pytest.param(target, kwargs, error, fragments, id=case)


ROWS = [
    # ------------------------------------------------------------------ MemoryPreset
    row(MemoryPreset, {"name": ["balanced"]}, says("name", ["balanced"]), case="preset-name-yaml-list"),
    row(MemoryPreset, {"name": None}, says("name", None), case="preset-name-none"),
    row(MemoryPreset, {"name": "fast"}, says("name", "fast"), case="preset-name-unknown"),
    row(MemoryPreset, {"effective_batch_size": True}, says("effective_batch_size", True), case="preset-ebs-bool"),
    row(MemoryPreset, {"effective_batch_size": 64.0}, says("effective_batch_size", 64.0), case="preset-ebs-float"),
    row(MemoryPreset, {"effective_batch_size": 0}, says("effective_batch_size", 0), case="preset-ebs-zero"),
    row(MemoryPreset, {"effective_batch_size": 2**63}, says("effective_batch_size", 2**63), case="preset-ebs-int64"),
    row(
        MemoryPreset,
        {"effective_batch_size": 8, "micro_batch_size": True},
        says("micro_batch_size", True),
        case="preset-micro-bool",
    ),
    row(MemoryPreset, {"devices": True}, says("devices", True), case="preset-devices-bool"),
    row(MemoryPreset, {"devices": "auto"}, says("devices", "auto"), case="preset-devices-auto"),
    row(MemoryPreset, {"num_nodes": 0}, says("num_nodes", 0), case="preset-nodes-zero"),
    row(MemoryPreset, {"precision": True}, says("precision", True), case="preset-precision-bool"),
    row(
        MemoryPreset,
        {"float32_matmul_precision": "tf32"},
        says("float32_matmul_precision", "tf32"),
        case="preset-matmul-unknown",
    ),
    row(
        MemoryPreset,
        {"gradient_checkpointing": "yes"},
        says("gradient_checkpointing", "yes"),
        case="preset-checkpointing-str",
    ),
    row(MemoryPreset, {"checkpoint_modules": 5}, says("checkpoint_modules", 5), case="preset-modules-int"),
    row(MemoryPreset, {"checkpoint_modules": [""]}, says("checkpoint_modules", ""), case="preset-modules-empty-name"),
    row(MemoryPreset, {"checkpoint_modules": []}, says("checkpoint_modules", []), case="preset-modules-empty"),
    row(MemoryPreset, {"gradient_clip_val": NAN}, says("gradient_clip_val", NAN), case="preset-clip-nan"),
    row(MemoryPreset, {"gradient_clip_val": INF}, says("gradient_clip_val", INF), case="preset-clip-inf"),
    row(MemoryPreset, {"gradient_clip_val": -1.0}, says("gradient_clip_val", -1.0), case="preset-clip-negative"),
    row(MemoryPreset, {"gradient_clip_val": True}, says("gradient_clip_val", True), case="preset-clip-bool"),
    row(MemoryPreset, {"gradient_clip_val": "1.0"}, says("gradient_clip_val", "1.0"), case="preset-clip-str"),
    row(MemoryPreset, {"allocator_conf": 5}, says("allocator_conf", 5), case="preset-allocator-int"),
    row(MemoryPreset, {"memory_fraction": NAN}, says("memory_fraction", NAN), case="preset-fraction-nan"),
    row(MemoryPreset, {"memory_fraction": True}, says("memory_fraction", True), case="preset-fraction-bool"),
    row(
        MemoryPreset,
        {"cache_clean_on_phase_end": "no"},
        says("cache_clean_on_phase_end", "no"),
        case="preset-cache-str",
    ),
    row(MemoryPreset, {"gc_every_n_train_steps": True}, says("gc_every_n_train_steps", True), case="preset-gc-bool"),
    row(MemoryPreset, {"monitor": 1}, says("monitor", 1), case="preset-monitor-int"),
    row(MemoryPreset, {"allow_emulated_bf16": "no"}, says("allow_emulated_bf16", "no"), case="preset-emulated-str"),
    row(MemoryPreset, {"tier": 8}, says("tier", 8), case="preset-tier-int"),
    row(MemoryPreset, {"auto_micro_batch": "yes"}, says("auto_micro_batch", "yes"), case="preset-auto-micro-str"),
    row(
        MemoryPreset,
        {"auto_micro_batch": True, "micro_batch_size": 8},
        says("micro_batch_size", 8),
        case="preset-auto-micro-start-without-effective",
    ),
    row(MemoryPreset.from_name, {"name": ["max-speed"]}, says("name", ["max-speed"]), case="from-name-list"),
    row(MemoryPreset.for_device, {"total_memory_gib": NAN}, says("total_memory_gib", NAN), case="for-device-nan"),
    row(MemoryPreset.for_device, {"total_memory_gib": INF}, says("total_memory_gib", INF), case="for-device-inf"),
    row(MemoryPreset.for_device, {"total_memory_gib": -8}, says("total_memory_gib", -8), case="for-device-negative"),
    row(MemoryPreset.for_device, {"total_memory_gib": True}, says("total_memory_gib", True), case="for-device-bool"),
    row(MemoryPreset.for_device, {"total_memory_gib": "24"}, says("total_memory_gib", "24"), case="for-device-str"),
    row(merge, {"trainer_config": "max_steps: 10"}, says("trainer_config", "max_steps: 10"), case="merge-config-str"),
    # ------------------------------------------------------------------ preset arithmetic
    row(
        plan_accumulation, {"effective_batch_size": 2**64}, says("effective_batch_size", 2**64), case="plan-ebs-too-big"
    ),
    row(
        plan_accumulation,
        {"effective_batch_size": 8, "target_accumulation": True},
        says("target_accumulation", True),
        case="plan-target-bool",
    ),
    row(tier_for_memory, {"total_memory_gib": NAN}, says("total_memory_gib", NAN), case="tier-nan"),
    # ------------------------------------------------------------------ read_memory / to_device_and_dtype
    row(read_memory, {"device": 3.5}, says("device", 3.5), case="read-memory-float"),
    row(read_memory, {"device": True}, says("device", True), case="read-memory-bool"),
    row(read_memory, {"device": -1}, says("device", -1), case="read-memory-negative"),
    row(read_memory, {"device": "gpu0"}, says("device", "gpu0"), case="read-memory-bad-str"),
    row(read_memory, {"device": [0]}, says("device", [0]), case="read-memory-list"),
    row(reset_peak_memory, {"device": 3.5}, says("device", 3.5), case="reset-peak-float"),
    row(to_device_and_dtype, {"model": "model"}, says("model", "model"), case="convert-model-str"),
    row(
        to_device_and_dtype,
        {"model": torch.nn.Linear(2, 2), "device": 3.5},
        says("device", 3.5),
        case="convert-device-float",
    ),
    row(
        to_device_and_dtype,
        {"model": torch.nn.Linear(2, 2), "device": True},
        says("device", True),
        case="convert-device-bool",
    ),
    row(
        to_device_and_dtype,
        {"model": torch.nn.Linear(2, 2), "dtype": "bfloat16"},
        says("dtype", "bfloat16"),
        case="convert-dtype-str",
    ),
    # ------------------------------------------------------------------ StreamingRetrievalMetric
    row(StreamingRetrievalMetric, {"top_k": None}, says("top_k", None), case="metric-topk-none"),
    row(StreamingRetrievalMetric, {"top_k": True}, says("top_k", True), case="metric-topk-bool"),
    row(StreamingRetrievalMetric, {"top_k": (1, True)}, says("top_k", (1, True)), case="metric-topk-bool-entry"),
    row(StreamingRetrievalMetric, {"top_k": ()}, says("top_k", ()), case="metric-topk-empty"),
    row(StreamingRetrievalMetric, {"top_k": (1, 5, 1)}, says("top_k", (1, 5, 1)), case="metric-topk-duplicate"),
    row(StreamingRetrievalMetric, {"top_k": "15"}, says("top_k", "15"), case="metric-topk-str"),
    row(StreamingRetrievalMetric, {"top_k": (1, 5.0)}, says("top_k", (1, 5.0)), case="metric-topk-float-entry"),
    row(StreamingRetrievalMetric, {"top_k": 0}, says("top_k", 0), case="metric-topk-zero"),
    row(StreamingRetrievalMetric, {"protocol": None}, says("protocol", None), case="metric-protocol-none"),
    row(StreamingRetrievalMetric, {"v2t_gallery": "group"}, says("v2t_gallery", "group"), case="metric-gallery"),
    row(StreamingRetrievalMetric, {"ties": True}, says("ties", True), case="metric-ties-bool"),
    row(StreamingRetrievalMetric, {"median": "upper"}, says("median", "upper"), case="metric-median"),
    row(
        StreamingRetrievalMetric,
        {"video_block_size": True},
        says("video_block_size", True),
        case="metric-video-block-bool",
    ),
    row(StreamingRetrievalMetric, {"text_block_size": 0}, says("text_block_size", 0), case="metric-text-block-zero"),
    row(
        StreamingRetrievalMetric,
        {"memory_budget_bytes": 1.5e9},
        says("memory_budget_bytes", 1.5e9),
        case="metric-budget-float",
    ),
    row(
        StreamingRetrievalMetric,
        {"memory_budget_bytes": True},
        says("memory_budget_bytes", True),
        case="metric-budget-bool",
    ),
    row(StreamingRetrievalMetric, {"accumulate_on": "cuda"}, says("accumulate_on", "cuda"), case="metric-accumulate"),
    row(StreamingRetrievalMetric, {"sync_on_compute": "no"}, says("sync_on_compute", "no"), case="metric-sync-str"),
    row(
        update,
        {"video_features": torch.zeros(2, 3, dtype=torch.int64)},
        ("`video_features`", "torch.int64"),
        case="update-int64-features",
    ),
    row(
        update,
        {"text_features": torch.zeros(2, 3, dtype=torch.bool)},
        ("`text_features`", "torch.bool"),
        case="update-bool-features",
    ),
    row(update, {"video_features": [[0.0, 1.0], [1.0, 0.0]]}, ("`video_features`", "list"), case="update-list"),
    row(update, {"video_features": torch.zeros(2)}, ("`video_features`", "(2,)"), case="update-1d-features"),
    row(update, {"text_ids": [0, 2**63]}, says("text_ids", 2**63), case="update-ids-beyond-int64"),
    row(update, {"text_ids": [0, -(2**63) - 1]}, says("text_ids", -(2**63) - 1), case="update-ids-below-int64"),
    row(update, {"text_ids": [0, 1.5]}, says("text_ids", 1.5), case="update-ids-float"),
    row(update, {"text_ids": [0, True]}, says("text_ids", True), case="update-ids-bool"),
    row(
        update, {"text_ids": torch.tensor([0.0, 1.0])}, ("`text_ids`", "torch.float32"), case="update-ids-float-tensor"
    ),
    row(update, {"text_ids": [0]}, ("`text_ids`", "got 1"), case="update-ids-length"),
    row(update, {"text_ids": "ab"}, says("text_ids", "ab"), case="update-ids-str"),
    row(update, {"sample_ids": [0, 1, 2]}, ("`sample_ids`", "got 3"), case="update-sample-ids-length"),
    row(update, {"video_ids": [0, None]}, says("video_ids", None), case="update-video-ids-none"),
    # ------------------------------------------------------------------ functional retrieval
    row(ranks, {"memory_budget_bytes": True}, says("memory_budget_bytes", True), case="ranks-budget-bool"),
    row(ranks, {"video_block_size": 2.0}, says("video_block_size", 2.0), case="ranks-video-block-float"),
    row(ranks, {"device": 3.5}, says("device", 3.5), case="ranks-device-float"),
    row(ranks, {"v2t_gallery": None}, says("v2t_gallery", None), case="ranks-gallery-none"),
    row(retrieval, {"top_k": None}, says("top_k", None), case="retrieval-topk-none"),
    row(retrieval, {"top_k": (0,)}, says("top_k", 0), case="retrieval-topk-zero"),
    row(retrieval, {"median": "upper"}, says("median", "upper"), case="retrieval-median"),
    # ------------------------------------------------------------------ MemoryPrecision
    row(MemoryPrecision, {"precision": "fp16"}, says("precision", "fp16"), case="precision-precision"),
    row(
        MemoryPrecision,
        {"float32_matmul_precision": "tf32"},
        says("float32_matmul_precision", "tf32"),
        case="precision-matmul",
    ),
    row(
        MemoryPrecision,
        {"allow_emulated_bf16": "yes"},
        says("allow_emulated_bf16", "yes"),
        case="precision-emulated-str",
    ),
    row(MemoryPrecision, {"exact_accumulation": 1}, says("exact_accumulation", 1), case="precision-exact-int"),
    row(MemoryPrecision, {"scaler": "cuda"}, says("scaler", "cuda"), case="precision-scaler-str"),
    row(MemoryPrecision, {"verbose": 1}, says("verbose", 1), case="precision-verbose-int"),
    # ------------------------------------------------------------------ callbacks
    row(MemoryMonitor, {"log_to_loggers": "no"}, says("log_to_loggers", "no"), case="monitor-loggers-str"),
    row(MemoryMonitor, {"dirpath": 123}, says("dirpath", 123), case="monitor-dirpath-int"),
    row(MemoryMonitor, {"log_every_n_steps": True}, says("log_every_n_steps", True), case="monitor-every-bool"),
    row(MemoryMonitor, {"warn_threshold": NAN}, says("warn_threshold", NAN), case="monitor-threshold-nan"),
    row(
        MemoryMonitor,
        {"cross_rank_every_n_train_steps": 0},
        says("cross_rank_every_n_train_steps", 0),
        case="monitor-cross-rank-zero",
    ),
    row(CacheCleaner, {"on_phase_end": "no"}, says("on_phase_end", "no"), case="cache-phase-end-str"),
    row(CacheCleaner, {"every_n_train_steps": True}, says("every_n_train_steps", True), case="cache-train-bool"),
    row(CacheCleaner, {"every_n_val_batches": 1.5}, says("every_n_val_batches", 1.5), case="cache-val-float"),
    row(GarbageCollector, {"generation": True}, says("generation", True), case="gc-generation-bool"),
    row(GarbageCollector, {"generation": 1.0}, says("generation", 1.0), case="gc-generation-float"),
    row(GarbageCollector, {"every_n_train_steps": True}, says("every_n_train_steps", True), case="gc-every-bool"),
    row(GarbageCollector, {"disable_automatic": "yes"}, says("disable_automatic", "yes"), case="gc-disable-str"),
    row(GarbageCollector, {"freeze_after_setup": 1}, says("freeze_after_setup", 1), case="gc-freeze-int"),
    row(OOMReporter, {"max_listed": True}, says("max_listed", True), case="oom-max-listed-bool"),
    row(OOMReporter, {"record_history": "no"}, says("record_history", "no"), case="oom-history-str"),
    row(OOMReporter, {"max_entries": 1e5}, says("max_entries", 1e5), case="oom-entries-float"),
    row(OOMReporter, {"dirpath": 123}, says("dirpath", 123), case="oom-dirpath-int"),
    row(MemoryAudit, {"dirpath": 123}, says("dirpath", 123), case="audit-dirpath-int"),
    row(MemoryAudit, {"audit_fit_start": "no"}, says("audit_fit_start", "no"), case="audit-fit-start-str"),
    row(MemoryAudit, {"detect_leaks": "no"}, says("detect_leaks", "no"), case="audit-detect-str"),
    row(MemoryAudit, {"check_grad_tracking": "no"}, says("check_grad_tracking", "no"), case="audit-grad-str"),
    row(MemoryAudit, {"collect_garbage": "no"}, says("collect_garbage", "no"), case="audit-collect-str"),
    row(
        MemoryAudit, {"leak_every_n_train_steps": True}, says("leak_every_n_train_steps", True), case="audit-every-bool"
    ),
    row(MemoryAudit, {"leak_window": 10.0}, says("leak_window", 10.0), case="audit-window-float"),
    row(
        MemoryAudit,
        {"leak_min_bytes_per_step": True},
        says("leak_min_bytes_per_step", True),
        case="audit-min-bytes-bool",
    ),
    row(MemoryAudit, {"max_listed": True}, says("max_listed", True), case="audit-listed-bool"),
    row(MemoryAudit, {"duplicate_fraction": NAN}, says("duplicate_fraction", NAN), case="audit-duplicate-nan"),
    row(MemoryAudit, {"leak_max_overhead": INF}, says("leak_max_overhead", INF), case="audit-overhead-inf"),
    row(
        GradientCheckpointing,
        {"checkpoint_modules": 5},
        says("checkpoint_modules", 5),
        case="checkpointing-modules-int",
    ),
    row(
        GradientCheckpointing,
        {"checkpoint_modules": [""]},
        says("checkpoint_modules", ""),
        case="checkpointing-modules-empty-name",
    ),
    row(
        GradientCheckpointing,
        {"checkpoint_modules": []},
        says("checkpoint_modules", []),
        case="checkpointing-modules-empty",
    ),
    row(
        GradientCheckpointing,
        {"use_model_switch": "no"},
        says("use_model_switch", "no"),
        case="checkpointing-switch-str",
    ),
    # ------------------------------------------------------------------ analysis
    row(load_memory_log, {"path": 123}, says("path", 123), case="load-log-int"),
    row(
        analyze_memory_logs,
        {"paths": "memory_rank0.jsonl"},
        says("paths", "memory_rank0.jsonl"),
        case="analyze-paths-str",
    ),
    row(analyze_memory_logs, {"paths": []}, says("paths", []), case="analyze-paths-empty"),
    row(
        plot_memory_timeline,
        {"records_by_file": {}, "path": "timeline.png"},
        says("records_by_file", {}),
        case="plot-no-records",
    ),
]


@pytest.mark.parametrize(("target", "kwargs", "error", "fragments"), ROWS)
def test_bad_argument_is_refused_with_a_clear_message(target, kwargs, error, fragments):
    start = time.perf_counter()
    with pytest.raises(error) as info:
        target(**kwargs)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    assert time.perf_counter() - start < 1.0, "refusing a bad argument must not take a search"
