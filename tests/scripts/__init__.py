"""Worker scripts the tests run in fresh interpreters (2-process DDP and the like)."""
