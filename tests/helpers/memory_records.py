"""The keys every memory record has, in the order ``memory_record`` writes them (the log format pins them)."""

RECORD_KEYS = [
    "time",
    "rank",
    "phase",
    "event",
    "epoch",
    "global_step",
    "batch_idx",
    "device",
    "allocated_bytes",
    "reserved_bytes",
    "active_bytes",
    "peak_allocated_bytes",
    "peak_reserved_bytes",
    "device_total_bytes",
    "device_free_bytes",
    "host_rss_bytes",
    "num_alloc_retries",
    "num_ooms",
]
