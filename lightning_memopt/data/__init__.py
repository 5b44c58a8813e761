"""lightning_memopt.data: batches shaped by memory."""

from lightning_memopt.data.token_budget import TokenBudgetBatchSampler

__all__ = ["TokenBudgetBatchSampler"]
