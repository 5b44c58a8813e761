"""Runnable examples of lightning-memopt (importable so that tests and DDP re-launches can reach them)."""

__all__: list[str] = []
