"""The judge's model call through the engine interface (rlbench/rollout/engines/base.py): the policy as
judge asks the run's engine (HF on the CPU, vLLM on a GPU), a frozen copy or another model its own HF
engine on the run's device; and the run's reward composition with its judge (``reward.terms``,
``reward.judge``; docs/judges.md)."""

from __future__ import annotations

import copy
import math
from typing import Any, Sequence

import torch

from rlbench.config.schema import JudgeConfig, RunConfig
from rlbench.model import load_policy
from rlbench.reward.judges import (
    PAIRWISE_TEMPLATE,
    Judge,
    ModelJudge,
    ScriptedJudge,
)
from rlbench.reward.terms import RewardComposer
from rlbench.rollout.engines import frozen_model_engine
from rlbench.rollout.engines.base import (
    GenerationRequest,
    RolloutEngine,
    SamplingParams,
)


class EngineJudgeBackend:
    """rlbench.reward.judges.JudgeBackend on an engine: prompts are encoded as plain text (the template
    is the whole prompt); answers are greedy; a label's probability is the product of its tokens'
    probabilities after the prompt (at temperature 1), the label preceded by a space unless the
    prompt ends in white space."""

    def __init__(self, engine: RolloutEngine, tokenizer: Any) -> None:
        self.engine, self.tokenizer = engine, tokenizer

    def _encode(self, text: str) -> tuple[int, ...]:
        return tuple(self.tokenizer.encode(text, add_special_tokens=False))

    def complete(self, prompts: Sequence[str], max_new_tokens: int) -> list[tuple[str, int]]:
        encoded = [self._encode(p) for p in prompts]
        requests = [GenerationRequest(prompt_ids=ids, n=1) for ids in encoded]
        groups = self.engine.generate(requests, SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens))
        return [(group[0].text, len(ids) + len(group[0].response_ids)) for ids, group in zip(encoded, groups)]

    def label_probabilities(self, prompts: Sequence[str], labels: Sequence[str]) -> list[tuple[list[float], int]]:
        encoded = [self._encode(p) for p in prompts]
        items, spans = [], []
        for prompt, ids in zip(prompts, encoded):
            spaced = [label if prompt[-1:].isspace() else " " + label for label in labels]
            spans.append(len(items))
            items += [(ids, self._encode(label)) for label in spaced]
        scores = self.engine.score_prefixes(items, SamplingParams(temperature=1.0))
        out = []
        for start, ids in zip(spans, encoded):
            probabilities = [math.exp(sum(scores[start + j])) for j in range(len(labels))]
            out.append((probabilities, len(ids) + sum(len(items[start + j][1]) for j in range(len(labels)))))
        return out


def make_judge(config: RunConfig, engine: RolloutEngine, model: torch.nn.Module, tokenizer: Any, device: Any) -> Judge | None:
    """The run's judge (``reward.judge``): a scripted rule, or a model judge on the policy's engine
    (kind=policy), on a frozen copy of the initial policy (frozen), or on another model (model)."""
    judge: JudgeConfig | None = config.reward.judge
    if judge is None:
        return None
    if judge.kind == "scripted":
        return ScriptedJudge(judge.rule)
    # A judge model of its own gets an engine of its own (frozen_model_engine: HF; vLLM scores prefixes on the
    # HF model all the same).
    if judge.kind == "policy":
        judge_engine = engine
    elif judge.kind == "frozen":
        frozen = copy.deepcopy(model).eval().requires_grad_(False)
        judge_engine = frozen_model_engine(config.rollout, frozen, tokenizer, device)
    else:
        other, tokenizer = load_policy(judge.model, device=device, dtype=torch.float32, seed=config.seed,
                                       cache_dir=config.cache_dir)
        judge_engine = frozen_model_engine(config.rollout, other.eval().requires_grad_(False), tokenizer, device)
    return ModelJudge(
        EngineJudgeBackend(judge_engine, tokenizer),
        name=f"{judge.kind}:{judge.model.name if judge.kind == 'model' else config.model.name}",
        verdict=judge.verdict,
        pairwise_template=judge.pairwise_template or PAIRWISE_TEMPLATE,
        pointwise_template=judge.pointwise_template or None,  # null: the verdict's own (ModelJudge)
        pairwise_labels=judge.pairwise_labels,
        pointwise_labels=judge.pointwise_labels,
        max_new_tokens=judge.max_new_tokens,
        batch_size=judge.batch_size,
        cache=judge.cache and judge.kind != "policy",
        time_budget_s=judge.time_budget_s,
        token_budget=judge.token_budget,
    )


def make_reward_composer(config: RunConfig, engine: RolloutEngine, model: torch.nn.Module, tokenizer: Any, device: Any) -> RewardComposer:
    """``reward.terms`` with the run's judge."""
    judge = config.reward.judge
    return RewardComposer(
        config.reward.terms,
        make_judge(config, engine, model, tokenizer, device),
        failure_reward=None if judge is None else judge.failure_reward,
        seed=config.seed,
        sees_reference=judge is not None and judge.sees_reference,
    )
