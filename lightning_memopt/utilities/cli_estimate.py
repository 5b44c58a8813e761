"""Moved to :mod:`lightning_memopt.cli_estimate`; this re-export keeps ``lightning_memopt.cli`` working until it
imports the new place."""

from lightning_memopt.cli_estimate import CLASS_SECTIONS, EstimateInputError, parse_batch_shape, run_estimate

__all__ = ["CLASS_SECTIONS", "EstimateInputError", "parse_batch_shape", "run_estimate"]
