"""Run logging: local result files (always) and optionally Weights & Biases."""

from rlbench.logger.run_logger import RunLogger

__all__ = ["RunLogger"]
