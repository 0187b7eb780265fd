"""rlbench: benchmark policy-optimization methods for LLMs trained with verifiable rewards."""

from omegaconf import OmegaConf

__version__ = "0.1.0"

# ${rlbench.max:a,b}: the larger value, for settings that must be at least another one (the smoke
# experiment's prompts per step: at least the preset's mini-batches, so a paper preset's schedule fits).
if not OmegaConf.has_resolver("rlbench.max"):
    OmegaConf.register_new_resolver("rlbench.max", lambda *values: max(values))
