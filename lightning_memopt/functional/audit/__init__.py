"""MemoryAudit's cores: the audit session (``session``), leak samples (``leaks``) and the DataLoaders' host
memory (``loaders``).
"""
