"""rlbench: benchmark policy-optimization methods for LLMs trained with verifiable rewards."""

__version__ = "0.1.0"
