"""Direct Advantage PO's critic, trained apart before the actor (``algorithm.step_critic``; Liu et al. 2024,
arXiv:2412.18279, section 3): the run's side of rlbench/algorithm/step_critic.py.

With ``rollout=offline`` the actor trains on a fixed data set (a file of responses, or the traces ``rlbench
mode=generate`` wrote). Before its first step, :meth:`StepCritic.prepare`

1. takes every response of that data set (``Offline.dataset``) and cuts it into steps as ``rollout=vine`` does
   (the step options of ``algorithm.step_critic``: ``boundary``, ``step_tokens``, ``max_steps``);
2. estimates the value of every step state s_k (prompt + the response's first tokens) as the mean reward of
   ``k`` continuations sampled by pi_ref (vine's ``monte_carlo_step_values``, through an HF engine of its own
   over the frozen reference and a random stream of its own, graded by the run's reward with its own composer
   and cost counter, so the policy's stream and the step's metrics are untouched);
3. fits the critic, a copy of pi_ref with a value head, to those values by regression (``fit_step_critic``:
   ``epochs`` passes, AdamW at ``lr``, ``batch_size`` responses a mini-batch) and saves it with its identity to
   ``algorithm.step_critic.path`` (default ``<run folder>/step_critic.pt``; rlbench/training/fitted_model.py). A run
   whose identity (the reference's weights, the data set, the settings, the seed, the sampling and the reward)
   matches reads it instead: a resumed run continues with the critic it started with, never a refitted one.

Then every step, :meth:`StepCritic.annotate` gives each trained response the step inputs ``step_index`` and
``step_values`` = V_phi of its states (the critic, not the Monte-Carlo estimates): the ``vine`` advantage turns
them into A_k = V_phi(s_{k+1}) - V_phi(s_k) (the last step: R - V_phi(s_{L-1})), which the
``direct_advantage_po`` loss regresses beta log(pi_theta / pi_ref)(step) onto. The critic is frozen while the
actor trains (actor and critic are trained apart: the paper's answer to actor-critic co-training instability).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from rlbench.algorithm.step_critic import fit_step_critic, state_positions
from rlbench.algorithm.value_model import ValuedSequence, ValueModel, predict_values
from rlbench.config.schema import RunConfig, StepCriticConfig
from rlbench.rollout import GradedGroups, GroupSampler
from rlbench.rollout.engines import frozen_model_engine
from rlbench.rollout.engines.base import SamplingParams
from rlbench.rollout.groups import GenerationCost
from rlbench.rollout.strategies.vine import VineOptions, monte_carlo_step_values, step_starts, token_steps
from rlbench.training.fitted_model import FittedModel, check_fitted_model, fitted_model_identity, model_path
from rlbench.utils import STREAM_STEP_CRITIC, STREAM_STEP_CRITIC_FIT, make_generator

log = logging.getLogger(__name__)

STEP_OPTIONS = ("k", "boundary", "step_tokens", "max_steps")  # the fields of algorithm.step_critic that are vine's
WHAT = "Direct Advantage PO's step critic"


def critic_step_options(settings: StepCriticConfig) -> VineOptions:
    """The steps and the Monte-Carlo count of the critic's data, as vine's options (checked)."""
    return VineOptions(**{name: getattr(settings, name) for name in STEP_OPTIONS}).checked("algorithm.step_critic")


def check_step_critic(config: RunConfig) -> None:
    """ConfigError, before the model loads, on a critic whose data set or reference is not there."""
    if config.algorithm.step_critic is not None:
        critic_step_options(config.algorithm.step_critic)
        check_fitted_model(config, "step_critic", WHAT)


@dataclass(kw_only=True)
class StepCritic(FittedModel):
    """The critic of ``algorithm.step_critic`` (module docstring); its ``sampler`` samples on pi_ref's engine."""

    settings: StepCriticConfig
    options: VineOptions
    params: SamplingParams
    WHAT: ClassVar[str] = WHAT

    @classmethod
    def from_config(cls, config: RunConfig, reference: torch.nn.Module, sampler: GroupSampler, params: SamplingParams,
                    shaping: Any, device: Any) -> StepCritic:
        """``reference``: the run's frozen pi_ref (the critic starts as its copy; its engine samples the
        continuations); ``sampler``: the run's (grader, prompt template, reward terms and shaping reused)."""
        settings = config.algorithm.step_critic
        engine = frozen_model_engine(config.rollout, reference, sampler.tokenizer, device)
        own = dataclasses.replace(sampler, engine=engine, cost=GenerationCost(), compose=sampler.compose.sibling())
        return cls(settings=settings, options=critic_step_options(settings), sampler=own, params=params,
                   model=ValueModel(copy.deepcopy(reference).requires_grad_(True)),
                   identity=fitted_model_identity(config, reference, settings, params, shaping),
                   path=model_path(config, settings.path, "step_critic.pt"), seed=int(config.seed))

    def fit(self, data: GradedGroups) -> dict[str, float]:
        """Monte-Carlo values of every step state of ``data`` (pi_ref's continuations), then the critic's regression
        onto them. Returns the numbers saved with the critic."""
        start = time.perf_counter()
        prompt_ids = [list(group[0].prompt_ids) for group in data.groups]
        mc = monte_carlo_step_values(self.sampler, data, prompt_ids, self.options, self.params,
                                     make_generator(self.seed, STREAM_STEP_CRITIC))
        sequences = []
        for completion in (c for group in data.groups for c in group):
            starts, values = self.step_starts_of(completion.response_ids), completion.extras.pop("step_values")
            completion.extras.pop("step_index")
            sequences.append(ValuedSequence(tuple(completion.prompt_ids) + tuple(completion.response_ids),
                                            state_positions(len(completion.prompt_ids), starts),
                                            tuple(values[s] for s in starts)))
        errors = fit_step_critic(self.model, sequences, self.pad_id, self.settings.epochs, self.settings.lr,
                                 self.settings.batch_size, make_generator(self.seed, STREAM_STEP_CRITIC_FIT))
        metrics = {"states": mc["vine_states"], "continuations": mc["vine_continuations"], "responses": float(len(sequences)),
                   "error_before": errors[0], "error_after": errors[-1], "seconds": time.perf_counter() - start}
        log.info("%s: %d responses, %d states x %d pi_ref continuations; squared error %.4f -> %.4f after %d epochs "
                 "(%.1f s)", WHAT, len(sequences), int(mc["vine_states"]), self.options.k, errors[0], errors[-1],
                 self.settings.epochs, metrics["seconds"])
        return metrics

    def step_starts_of(self, response_ids: list[int]) -> list[int]:
        return step_starts(response_ids, self.options, self.sampler.tokenizer)

    def annotate(self, graded: GradedGroups) -> dict[str, float]:
        """Gives every response ``step_index`` and ``step_values`` = V_phi of its step states (module docstring).
        Returns the step's metric ``step_critic_value_mean`` (the mean V_phi of the responses' first states)."""
        completions = [c for group in graded.groups for c in group]
        starts = [self.step_starts_of(c.response_ids) for c in completions]
        sequences = [ValuedSequence(tuple(c.prompt_ids) + tuple(c.response_ids), state_positions(len(c.prompt_ids), s))
                     for c, s in zip(completions, starts)]
        values = predict_values(self.model, sequences, self.pad_id, self.settings.batch_size)
        for completion, response_starts, response_values in zip(completions, starts, values):
            index, step_values = token_steps(list(zip(response_starts, response_values)), len(completion.response_ids))
            completion.extras.update(step_index=index, step_values=step_values)
        return {"step_critic_value_mean": sum(v[0] for v in values) / max(len(values), 1)}
