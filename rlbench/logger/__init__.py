"""Run logging: local result files (always) and optionally Weights & Biases."""

from rlbench.logger.run_logger import RunLogger, SilentLogger

__all__ = ["RunLogger", "SilentLogger"]
