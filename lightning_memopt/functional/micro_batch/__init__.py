"""AutoMicroBatch's cores: a batch split (``slicing``), run and retried (``retry``, ``retry_state``),
its outputs put back together (``outputs``), and the ranks kept in step (``ddp_sync``, ``ddp_overlap``,
``fsdp_sync``).
"""
