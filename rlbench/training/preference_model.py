"""DRPO's learned preference model, fitted before the actor (``algorithm.preference_model``; Xu et al. 2025,
arXiv:2506.01183, section 4): the run's side of rlbench/algorithm/preference_model.py.

With ``rollout=offline`` the actor trains on a fixed data set of labelled responses (pairs, rankings, graded
responses or traces). Before its first step, :meth:`PreferenceModel.prepare` takes every group of that set, forms
its ordered pairs with different labels, fits a Bradley-Terry reward model r_phi (a copy of pi_ref with a value
head) on them (``epochs`` passes, AdamW at ``lr``, ``batch_size`` pairs a mini-batch) and saves it with its
identity to ``algorithm.preference_model.path`` (default ``<run folder>/preference_model.pt``;
rlbench/training/fitted_model.py: a run of the same identity reads it back, a resumed one included). The model is
then frozen: every step it scores the batch's responses (``TrainBatch.preference_scores``), and the
``dr_preference`` loss takes g(y_a, y_b) = sigma(r_phi(y_a) - r_phi(y_b)) as its preference model instead of the
Bradley-Terry model on the labels.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from rlbench.algorithm.preference_model import (
    fit_preference_model,
    labelled_pairs,
    pair_accuracy,
    scored_sequence,
)
from rlbench.algorithm.value_model import ValueModel, predict_values
from rlbench.config.schema import PreferenceModelConfig, RunConfig
from rlbench.rollout import GradedGroups, GroupSampler
from rlbench.rollout.engines.base import SamplingParams
from rlbench.rollout.groups import GenerationCost
from rlbench.training.fitted_model import FittedModel, check_fitted_model, fitted_model_identity, model_path
from rlbench.utils import STREAM_PREFERENCE_MODEL_FIT, make_generator

log = logging.getLogger(__name__)

WHAT = "DRPO's preference model"


def check_preference_model(config: RunConfig) -> None:
    """ConfigError, before the model loads, on a preference model without its data set or reference."""
    if config.algorithm.preference_model is not None:
        check_fitted_model(config, "preference_model", WHAT)


@dataclass(kw_only=True)
class PreferenceModel(FittedModel):
    """The preference model of ``algorithm.preference_model`` (module docstring)."""

    settings: PreferenceModelConfig
    WHAT: ClassVar[str] = WHAT

    @classmethod
    def from_config(cls, config: RunConfig, reference: torch.nn.Module, sampler: GroupSampler, params: SamplingParams,
                    shaping: Any) -> PreferenceModel:
        settings = config.algorithm.preference_model
        own = dataclasses.replace(sampler, cost=GenerationCost(), compose=sampler.compose.sibling())
        return cls(settings=settings, sampler=own, model=ValueModel(copy.deepcopy(reference).requires_grad_(True)),
                   identity=fitted_model_identity(config, reference, settings, params, shaping),
                   path=model_path(config, settings.path, "preference_model.pt"), seed=int(config.seed))

    def fit(self, data: GradedGroups) -> dict[str, float]:
        """The Bradley-Terry fit on every labelled pair of ``data``. Returns the numbers saved with the model."""
        start = time.perf_counter()
        sequences = [scored_sequence(c.prompt_ids, c.response_ids) for group in data.groups for c in group]
        pairs = labelled_pairs(sequences, data.rewards.tolist(), data.group_index.tolist())
        losses = fit_preference_model(self.model, pairs, self.pad_id, self.settings.epochs, self.settings.lr,
                                      self.settings.batch_size, make_generator(self.seed, STREAM_PREFERENCE_MODEL_FIT))
        winners = predict_values(self.model, [p.winner for p in pairs], self.pad_id, self.settings.batch_size)
        losers = predict_values(self.model, [p.loser for p in pairs], self.pad_id, self.settings.batch_size)
        accuracy = pair_accuracy([w[0] for w in winners], [loser[0] for loser in losers])
        metrics = {"pairs": float(len(pairs)), "loss_before": losses[0], "loss_after": losses[-1], "pair_accuracy": accuracy,
                   "seconds": time.perf_counter() - start}
        log.info("%s: %d labelled pairs; Bradley-Terry loss %.4f -> %.4f after %d epochs, pair accuracy %.3f (%.1f s)",
                 WHAT, len(pairs), losses[0], losses[-1], self.settings.epochs, accuracy, metrics["seconds"])
        return metrics

    def scores(self, graded: GradedGroups) -> torch.Tensor:
        """[B] r_phi of every response of the step."""
        sequences = [scored_sequence(c.prompt_ids, c.response_ids) for group in graded.groups for c in group]
        return torch.tensor([v[0] for v in predict_values(self.model, sequences, self.pad_id, self.settings.batch_size)])
