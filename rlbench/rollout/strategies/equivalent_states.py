"""EIS-GRPO, equivalent initial states pooled in one group (``rollout=equivalent_states``; Xu et al.
2025, "J4R: Learning to Judge with Equivalent Initial State Group Relative Policy Optimization",
arXiv:2505.13346): a problem is posed in several equivalent forms (states), each sampled n / S times,
and all n responses form one group, so the group-relative advantage rewards answers that do not
depend on the form (the paper's states are the two orders of a pairwise judgement; position bias is
what it removes).

rlbench's datasets have no pairwise judgements, so the states here are generic: the dataset's own
prompt preceded by each of ``prefixes`` (the first is usually "", the prompt as it is), an instruction
that leaves the problem and its answer unchanged. The answer is the same in every state (no label
mapping is needed, unlike the judge's swapped order). A problem that carries forms of its own
(``meta["equivalent_forms"]``: the paper's judge task, ``trainer.aux_tasks.kinds=[eis_pairwise]``,
rlbench/reward/judge_tasks.py) is posed in those instead: one state per form, each response graded
against its own form's answer (the label mapped through the swap); their number must be the number of
prefixes.

Every response is the policy's sample under the prompt it was generated with; it keeps that prompt
(``Completion.prompt_ids``), so the loss scores it under that prompt, and only the advantage is
pooled. A group of responses to different prompts cannot share one prompt pass in the forward, so
such batches run each row's own prompt (rlbench.training.forward.groups_share_prompts).

Metric ``equivalent_states_reward_gap``: the mean over prompts of the spread (max − min) of the
states' mean rewards, the sensitivity to the form that the method trains away. No state between steps.

Configuration (conf/rollout/equivalent_states.yaml):

    strategy: equivalent_states
    equivalent_states:
      prefixes: ["", "Read the problem carefully before answering.\\n\\n"]   # rollout.n must be a multiple of their number
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from rlbench.config.schema import RolloutConfig
from rlbench.dataset.base import Problem
from rlbench.dataset.prompts import DEFAULT_USER_TEMPLATE, _prompt_section
from rlbench.errors import ConfigError
from rlbench.prompting import encode_prompts
from rlbench.reward import grade_completions
from rlbench.reward.judge_tasks import equivalent_forms
from rlbench.rollout.engines.base import GenerationRequest
from rlbench.rollout.groups import GradedGroups
from rlbench.rollout.strategy import (
    RolloutSetup,
    RolloutStrategy,
    register_strategy,
    strategy_options,
)


@dataclass(frozen=True)
class EquivalentStatesOptions:
    """The ``rollout.equivalent_states`` block: the S prefixes that make S equivalent forms of a problem
    (no default: conf/rollout/equivalent_states.yaml gives them)."""

    prefixes: tuple[str, ...] = ()


def state_prefixes(rollout: RolloutConfig) -> list[str]:
    """The ``rollout.equivalent_states.prefixes``, checked: at least two, distinct, without braces."""
    prefixes = list(strategy_options(rollout, "equivalent_states", EquivalentStatesOptions).prefixes)
    if len(prefixes) < 2 or len(set(prefixes)) < len(prefixes):
        raise ConfigError(f"rollout.equivalent_states.prefixes must list at least two distinct prefixes, got {prefixes}")
    if any("{" in p or "}" in p for p in prefixes):
        raise ConfigError("rollout.equivalent_states.prefixes must not contain braces (they precede the prompt template)")
    return prefixes


def state_prompt_spec(prompt_spec: Any, prefix: str) -> dict:
    """The dataset's prompt with ``prefix`` before its user message."""
    section = _prompt_section(prompt_spec)
    return {"system": section.get("system"), "user": prefix + str(section.get("user") or DEFAULT_USER_TEMPLATE)}


@register_strategy("equivalent_states")
class EquivalentStatesRollout(RolloutStrategy):
    """EIS-GRPO (arXiv:2505.13346): each problem in S equivalent forms, n / S samples each, pooled in
    one group."""

    def __init__(self, setup: RolloutSetup, prefixes: list[str]):
        self.setup, self.prefixes = setup, prefixes

    @classmethod
    def config_options(cls, rollout: RolloutConfig) -> dict[str, Any]:
        return {"prefixes": state_prefixes(rollout)}

    @classmethod
    def validate(cls, rollout: RolloutConfig, advantage: str) -> None:
        states, n = len(state_prefixes(rollout)), int(rollout.n)
        if n % states:
            raise ConfigError(
                f"rollout.n={n} is not a multiple of the {states} equivalent states (rollout.equivalent_states.prefixes): "
                f"each state gets rollout.n / {states} samples; set rollout.n to a multiple of {states}"
            )

    def rollout(
        self, problems: list[Problem], draw_prompts: Callable[[int], list[Problem]] | None = None
    ) -> tuple[GradedGroups, dict[str, float]]:
        setup, sampler = self.setup, self.setup.sampler
        states = len(self.prefixes)
        per_state = setup.n // states
        forms = [problem_forms(problem, states) for problem in problems]
        requests = [GenerationRequest(ids, n=per_state) for s in range(states) for ids in self.encoded(problems, forms, s)]
        outputs = sampler.generate(requests, setup.params, setup.generator)
        count = len(problems)
        groups = [[c for s in range(states) for c in outputs[s * count + i]] for i in range(count)]
        for i, group in enumerate(groups):
            for c in group:
                c.request_index = i
        # each response is graded as an answer to the form it was sampled under (a swapped pair's own label)
        answered = [(f[s] if f else problem) for problem, f in zip(problems, forms) for s in range(states) for _ in range(per_state)]
        grades = grade_completions(sampler.grader, answered, [c for group in groups for c in group])
        graded = sampler.shaped(problems, groups, grades, setup.params.max_new_tokens)
        # rewards per (prompt, state): responses are ordered state after state within each group
        state_means = graded.rewards.view(count, states, per_state).mean(-1)
        gap = (state_means.max(-1).values - state_means.min(-1).values).mean()
        return graded, {"equivalent_states_reward_gap": float(gap)}

    def encoded(self, problems: list[Problem], forms: list[list[Problem] | None], state: int) -> list[tuple[int, ...]]:
        """The prompts of state ``state``: a problem with forms of its own in its form ``state`` under the
        dataset's prompt, any other problem after prefix ``state``."""
        spec, tokenizer = self.setup.sampler.prompt_spec, self.setup.sampler.tokenizer
        prefixed = encode_prompts(tokenizer, problems, state_prompt_spec(spec, self.prefixes[state]))
        own = [f[state] for f in forms if f]
        own_ids = iter(encode_prompts(tokenizer, own, state_prompt_spec(spec, "")) if own else [])
        return [next(own_ids) if f else ids for f, ids in zip(forms, prefixed)]


def problem_forms(problem: Problem, states: int) -> list[Problem] | None:
    """The problem's own equivalent forms (an EIS-GRPO judge task's two orderings), checked against the run's
    number of states; None for a problem without (its states are the prefixes)."""
    forms = equivalent_forms(problem)
    if forms is not None and len(forms) != states:
        raise ValueError(f"problem {problem.uid} has {len(forms)} equivalent forms of its own, and the run poses every "
                         f"problem in {states} states (rollout.equivalent_states.prefixes): the two must agree")
    return forms
