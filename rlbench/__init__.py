"""rlbench: benchmark policy-optimization methods for LLMs trained with verifiable rewards."""

from omegaconf import OmegaConf

__version__ = "0.1.0"

# Config resolvers (conf/ uses them):
# ${rlbench.max:a,b}: the larger value, for settings that must be at least another one (the smoke
# experiment's prompts per step: at least the preset's mini-batches, so a paper preset's schedule fits);
# ${rlbench.run_name:}: the default run name, derived from the whole config (rlbench/config/identity.py).
if not OmegaConf.has_resolver("rlbench.max"):
    OmegaConf.register_new_resolver("rlbench.max", lambda *values: max(values))
if not OmegaConf.has_resolver("rlbench.run_name"):
    def _run_name(*, _root_):
        from rlbench.config.identity import run_identity

        return run_identity(_root_).name

    OmegaConf.register_new_resolver("rlbench.run_name", _run_name)
# ${rlbench.halfway:${trainer.steps}}: the first step of the second half of training, at least 2 (the
# first step a stage can start at; prompt_sampler=drive switches to its second stage there).
if not OmegaConf.has_resolver("rlbench.halfway"):
    OmegaConf.register_new_resolver("rlbench.halfway", lambda steps: max(2, int(steps) // 2 + 1))
