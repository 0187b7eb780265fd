"""SALSA's KL reference (Chegini et al. 2024, "SALSA: Soup-based Alignment Learning for Stronger
Adaptation in RLHF", arXiv:2411.01798): the reference model of the KL term is a weight soup, the
elementwise average of several models' parameters, instead of the frozen initial policy.

The paper averages two independently fine-tuned SFT models. A run here has one starting model, so the
soup's ingredients are snapshots of the policy itself (``algorithm.reference_soup``): the initial policy,
then the policy after every ``every`` updates, until the soup holds ``models`` of them (the paper's two by
default); from then on the reference stays fixed. With ``models: 1`` the soup is the initial policy: the
plain frozen reference exactly. The soup is kept as a running average (theta_soup <- theta_soup +
(theta - theta_soup) / (k + 1) for the k+1-th ingredient), so only one extra copy of the weights is held,
and it is saved with checkpoints (:meth:`ReferenceSoup.state_dict`).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import torch

from rlbench.config.schema import ReferenceSoupConfig, RunConfig
from rlbench.errors import ConfigError


def soup_average(models: Iterable[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The uniform weight soup: for each parameter name the elementwise mean over ``models`` (state
    dicts with the same names and shapes; a mismatch is a ValueError naming the parameter)."""
    models = list(models)
    if not models:
        raise ValueError("a weight soup needs at least one model")
    names = list(models[0])
    for i, other in enumerate(models[1:], start=1):
        if list(other) != names:
            raise ValueError(f"soup ingredient {i} has other parameters than ingredient 0")
        for name in names:
            if other[name].shape != models[0][name].shape:
                raise ValueError(f"soup ingredient {i}: {name} has shape {tuple(other[name].shape)}, "
                                 f"ingredient 0 has {tuple(models[0][name].shape)}")
    return {name: torch.stack([m[name].to(torch.float64) for m in models]).mean(0).to(models[0][name].dtype)
            for name in names}


@torch.no_grad()
def add_to_soup(soup: torch.nn.Module, model: torch.nn.Module, ingredients: int) -> None:
    """Fold ``model`` into ``soup``, which averages ``ingredients`` models so far, in place:
    theta_soup <- theta_soup + (theta_model - theta_soup) / (ingredients + 1)."""
    mine = dict(soup.named_parameters())
    theirs = {name.removeprefix("module."): p for name, p in model.named_parameters()}  # a DDP wrapper's names
    if set(mine) != set(theirs):
        raise ValueError("the policy and the reference soup have different parameters")
    for name, param in mine.items():
        param.add_((theirs[name].detach().to(param.dtype) - param) / (ingredients + 1))


class ReferenceSoup:
    """Keeps the KL reference ``reference`` (a frozen copy of the initial policy) as the soup of the
    initial policy and the policy after every ``every`` updates, ``models`` ingredients in all."""

    def __init__(self, reference: torch.nn.Module, every: int, models: int):
        self.reference, self.every, self.models = reference, int(every), int(models)
        self.ingredients = 1  # the initial policy

    @classmethod
    def from_config(cls, options: ReferenceSoupConfig | None, reference: torch.nn.Module | None) -> "ReferenceSoup | None":
        if options is None or reference is None:
            return None
        return cls(reference, options.every, options.models)

    def after_update(self, policy: torch.nn.Module, updates: int) -> dict[str, float]:
        """After the policy's ``updates``-th update: add it to the soup when ``updates`` is a multiple of
        ``every`` and the soup is not full. Returns the metric ``soup_models``."""
        if self.ingredients < self.models and updates % self.every == 0:
            add_to_soup(self.reference, policy, self.ingredients)
            self.ingredients += 1
        return {"soup_models": float(self.ingredients)}

    def state_dict(self) -> dict[str, Any]:
        return {"ingredients": self.ingredients,
                "weights": {k: v.detach().clone() for k, v in self.reference.named_parameters()}}

    @torch.no_grad()
    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.ingredients = int(state["ingredients"])
        for name, param in self.reference.named_parameters():
            param.copy_(state["weights"][name])


def validate_reference_soup(config: RunConfig, kl_coef: float) -> None:
    """``algorithm.reference_soup`` before anything loads: the soup is the KL reference, so the KL must be
    on; LoRA's reference is the base weights with adapters off (no copy to average into) and sharded
    runs hold the reference in pieces: both are refused."""
    options = config.algorithm.reference_soup
    if options is None:
        return
    if kl_coef <= 0:
        raise ConfigError("algorithm.reference_soup makes the KL reference a weight soup (SALSA), but the KL term "
                          "is off: set algorithm.kl.coef > 0, or algorithm.reference_soup=null")
    if options.models < 1 or options.every < 1:
        raise ConfigError("algorithm.reference_soup.models and .every must be >= 1")
    if config.model.lora is not None:
        raise ConfigError("algorithm.reference_soup needs a full copy of the weights as reference; under LoRA the "
                          "reference is the base model with adapters off: drop model/lora")
    if config.trainer.parallelism != "single":
        raise ConfigError("algorithm.reference_soup is not supported under trainer.parallelism=ddp|fsdp yet")
