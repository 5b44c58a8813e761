"""Memory readings: one device-agnostic reading and the allocator calls (``memory``), the process's resident
set (``host_memory``) and MemoryMonitor's per-phase peaks and thresholds (``monitoring``).
"""
