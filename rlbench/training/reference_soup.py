"""SALSA's KL reference (Chegini et al. 2024, "SALSA: Soup-based Alignment Learning for Stronger
Adaptation in RLHF", arXiv:2411.01798): the reference model of the KL term is a weight soup, the
elementwise average of several models' parameters, instead of the frozen initial policy.

The paper (section 3) averages two independently fine-tuned SFT models: ``algorithm.reference_soup.checkpoints``
names them (Hugging Face folders of the policy's architecture, e.g. the ``policy/`` folders of two runs);
their parameter average, computed in float64, is the KL reference for the whole run (:func:`checkpoint_soup`).

Without checkpoints the run says so at start-up and uses the stand-in: the soup's ingredients are
snapshots of the policy itself: the initial policy, then the policy after every ``every`` updates, until
the soup holds ``models`` of them; from then on the reference stays fixed. With ``models: 1`` the soup is
the initial policy: the plain frozen reference exactly. The soup is kept as a running average (theta_soup <- theta_soup +
(theta - theta_soup) / (k + 1) for the k+1-th ingredient), so only one extra copy of the weights is held,
and it is saved with checkpoints (:meth:`ReferenceSoup.state_dict`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import torch

from rlbench.config.schema import ReferenceSoupConfig, RunConfig
from rlbench.errors import ConfigError
from rlbench.model.lora import reference_model

log = logging.getLogger(__name__)


def soup_average(models: Iterable[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The uniform weight soup: for each parameter name the elementwise mean over ``models`` (state
    dicts with the same names and shapes; a mismatch is a ValueError naming the parameter)."""
    models = list(models)
    if not models:
        raise ValueError("a weight soup needs at least one model")
    return weighted_average(models, [1.0 / len(models)] * len(models))


def weighted_average(models: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float]) -> dict[str, torch.Tensor]:
    """Sum_i weights[i] * models[i] for each parameter name, computed in float64 and returned in model 0's
    dtypes (a soup: uniform weights; P-SACPO's interpolation: 1 - w and w). The models must have the same
    names and shapes (a mismatch is a ValueError naming the parameter)."""
    if len(models) != len(weights) or not models:
        raise ValueError(f"{len(models)} models and {len(weights)} weights: give one weight per model")
    names = list(models[0])
    for i, other in enumerate(models[1:], start=1):
        if list(other) != names:
            raise ValueError(f"soup ingredient {i} has other parameters than ingredient 0")
        for name in names:
            if other[name].shape != models[0][name].shape:
                raise ValueError(f"soup ingredient {i}: {name} has shape {tuple(other[name].shape)}, "
                                 f"ingredient 0 has {tuple(models[0][name].shape)}")
    return {name: sum(w * m[name].to(torch.float64) for w, m in zip(weights, models)).to(models[0][name].dtype)
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


def checkpoint_parameters(model: torch.nn.Module, path: str | Path, what: str) -> dict[str, torch.Tensor]:
    """The parameters of the Hugging Face checkpoint ``path``, by ``model``'s parameter names; a checkpoint whose
    names or shapes differ from ``model``'s is a ConfigError naming ``what`` (the config key) and ``path``."""
    from transformers import AutoModelForCausalLM

    mine = dict(model.named_parameters())
    theirs = dict(AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).named_parameters())
    if set(theirs) != set(mine) or any(theirs[name].shape != param.shape for name, param in mine.items()):
        raise ConfigError(f"{what}: {path} is not a checkpoint of the policy's architecture (its parameter names or "
                          "shapes differ)")
    return {name: theirs[name].detach() for name in mine}


@torch.no_grad()
def checkpoint_soup(reference: torch.nn.Module, checkpoints: Sequence[str | Path],
                    what: str = "algorithm.reference_soup.checkpoints") -> None:
    """SALSA's reference: load each checkpoint's parameters and set ``reference``'s to their average
    (:func:`soup_average`; of one checkpoint: its weights, RTO's pi_dpo). A checkpoint whose parameter names or
    shapes differ from the policy's is a ConfigError naming it."""
    mine = dict(reference.named_parameters())
    ingredients = [checkpoint_parameters(reference, path, what) for path in checkpoints]
    for name, value in soup_average(ingredients).items():
        mine[name].copy_(value.to(mine[name].dtype))


def frozen_checkpoint(policy: torch.nn.Module, path: str | Path, what: str) -> torch.nn.Module:
    """A frozen model of the policy's architecture holding the weights of checkpoint ``path`` (RTO's pi_dpo): the
    reference model's frozen copy of the policy (rlbench.model.lora.reference_model), its weights replaced."""
    frozen = reference_model(policy)
    checkpoint_soup(frozen, [path], what)
    log.info("%s: frozen model loaded from %s", what, path)
    return frozen


class ReferenceSoup:
    """Keeps the KL reference ``reference`` (a frozen copy of the initial policy) as the soup of the
    initial policy and the policy after every ``every`` updates, ``models`` ingredients in all."""

    def __init__(self, reference: torch.nn.Module, every: int, models: int, ingredients: int = 1):
        self.reference, self.every, self.models = reference, int(every), int(models)
        self.ingredients = int(ingredients)  # 1: the initial policy; len(checkpoints) for SALSA's soup

    @classmethod
    def from_config(cls, options: ReferenceSoupConfig | None, reference: torch.nn.Module | None) -> "ReferenceSoup | None":
        """The run's soup: of ``options.checkpoints`` (SALSA; full from the start, no snapshot is added),
        or else of policy snapshots, said in one line at start-up."""
        if options is None or reference is None:
            return None
        if options.checkpoints:
            checkpoint_soup(reference, options.checkpoints)
            log.info("KL reference: the weight soup of %d checkpoints (%s)", len(options.checkpoints),
                     ", ".join(map(str, options.checkpoints)))
            return cls(reference, every=1, models=len(options.checkpoints), ingredients=len(options.checkpoints))
        log.warning("algorithm.reference_soup: no checkpoints given, so the KL reference is the stand-in soup of the "
                    "initial policy and %d snapshot(s) of the policy every %d updates, not SALSA's soup of fine-tuned "
                    "models (set algorithm.reference_soup.checkpoints=[<a>,<b>])", options.models - 1, options.every)
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
    checkpoints = list(options.checkpoints)
    if len(checkpoints) == 1:
        raise ConfigError(f"algorithm.reference_soup.checkpoints={checkpoints}: a soup averages at least two models "
                          "(SALSA: two fine-tuned checkpoints)")
    for path in checkpoints:
        if not (Path(str(path)) / "config.json").is_file():
            raise ConfigError(f"algorithm.reference_soup.checkpoints: {path} is not a Hugging Face checkpoint folder "
                              "(no config.json there; a run writes one to <run>/policy with trainer.save_model=true)")
    if config.model.lora is not None:
        raise ConfigError("algorithm.reference_soup needs a full copy of the weights as reference; under LoRA the "
                          "reference is the base model with adapters off: drop model/lora")
    if config.trainer.parallelism != "single":
        raise ConfigError("algorithm.reference_soup is not supported under trainer.parallelism=ddp|fsdp yet")
