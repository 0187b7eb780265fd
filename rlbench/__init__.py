"""rlbench: benchmark policy-optimization methods for LLMs trained with verifiable rewards."""

from omegaconf import OmegaConf

__version__ = "0.1.0"

# Config resolvers (conf/ uses them):
# ${rlbench.max:a,b}: the larger value, for settings that must be at least another one (the smoke
# experiment's prompts per step: at least the preset's mini-batches, so a paper preset's schedule fits);
# ${rlbench.by_mode:MODE,TRAIN,EVAL}: TRAIN, or EVAL for mode=eval (the run name of an evaluation-only
# run names the model and the suite, not an algorithm and a training set it never used).
if not OmegaConf.has_resolver("rlbench.max"):
    OmegaConf.register_new_resolver("rlbench.max", lambda *values: max(values))
if not OmegaConf.has_resolver("rlbench.by_mode"):
    OmegaConf.register_new_resolver("rlbench.by_mode", lambda mode, train, evaluation: evaluation if mode == "eval" else train)
