"""Sampling strategies: how a step's prompts become groups of the policy's own responses (i.i.d., dynamic
sampling, trees, branches, drafts, masks, temperatures, ...). One module per strategy, named as it is
registered (``rollout=<name>``, conf/rollout/<name>.yaml); every module here is imported, so a new strategy
is its module and its YAML."""

from rlbench.algorithm.registry import import_family_modules

import_family_modules(__name__, __path__)
