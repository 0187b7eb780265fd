"""rlbench's Hydra sweeper (``hydra/sweeper=rlbench``, the default of conf/config.yaml)."""
