"""Hints for prompts the policy does not solve: a group whose every response is wrong is re-rolled with
a hint taken from the problem's guidance trace (``guidance=<source>``, rlbench/guidance/traces.py) added
to the prompt. Two strategies, which differ in what the hinted responses are trained as:

``rollout=hint_reroll`` (Guide; Nath et al. 2025, "Adaptive Guidance Accelerates Reinforcement Learning
of Reasoning Models", arXiv:2506.13923): the all-wrong group is re-sampled (``rollout.n`` responses)
with the hint; if one of them is right, the hinted group replaces the original. The hinted responses
are trained for the prompt *without* the hint: each is off-policy in every token with behaviour
log-prob log pi_old(y | x, h) (the engine's scores under the hinted prompt), so the ratio is
pi_theta(y | x) / pi_old(y | x, h) (the loss ``policy_shaping`` shapes it, no clip).

``rollout=scaf_hints`` (Scaf-GRPO; Zhang et al. 2025, "Scaf-GRPO: Scaffolded Group Relative Policy
Optimization for Enhancing LLM Reasoning", arXiv:2510.19807): after a guidance-free exemption (the
first ``exemption_fraction`` of the steps), the hint of an all-wrong group grows tier by tier
(``tiers``: the share of the solution revealed) until a hinted response is right; that response
replaces one failed response of the group. It is trained as the policy's own sample of the *hinted*
prompt (the hint is prompt context, never trained), so it is on-policy.

The hint is the first ``ceil(share * words)`` words of the trace's text (the reference solution); the
hinted prompt is the problem statement followed by ``"\\n\\nHint: <hint>"`` in the dataset's template.
Without a trace for the prompt, or without any all-wrong group, both strategies are ``rollout=iid``.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Callable, Sequence

import torch

from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError
from rlbench.rollout.base import Completion, GenerationRequest
from rlbench.rollout.groups import GradedGroups
from rlbench.rollout.strategy import OptionStrategy, RolloutSetup, options_block, register_strategy

HINT_SEPARATOR = "\n\nHint: "


def hint_text(solution: str, share: float) -> str:
    """The first ceil(share * words) words of ``solution`` (share in (0, 1])."""
    words = solution.split()
    return " ".join(words[: math.ceil(share * len(words))])


def hinted_problem(problem: Problem, hint: str) -> Problem:
    """The problem whose statement ends with the hint (the dataset's template then wraps it)."""
    return replace(problem, prompt=problem.prompt + HINT_SEPARATOR + hint)


def unsolved_groups(graded: GradedGroups) -> list[int]:
    """Positions of the groups none of whose responses the grader marks correct."""
    correct = graded.correct
    index = graded.group_index
    return [g for g in range(len(graded.groups)) if not bool(correct[index == g].any())]


def first_trace_text(setup: RolloutSetup, problem: Problem) -> str:
    library = setup.guidance
    traces = library.for_problem(problem) if library is not None else []
    return traces[0].text if traces else ""


def replace_groups(base: GradedGroups, replacement: GradedGroups, positions: Sequence[int]) -> GradedGroups:
    """``base`` with its groups at ``positions`` replaced by the groups of ``replacement`` (in order),
    numbered 0..G-1."""
    where = {g: len(base.groups) + i for i, g in enumerate(positions)}
    merged = GradedGroups.concat([base, replacement])
    return merged.select([where.get(g, g) for g in range(len(base.groups))]).with_group_ids(0)


def retrained_without_hint(completion: Completion, prompt_ids: tuple[int, ...]) -> Completion:
    """A response sampled under the hinted prompt, trained for ``prompt_ids`` (the prompt without the
    hint): off-policy in every token, behaviour log-prob = its score under the hinted prompt."""
    r = len(completion.response_ids)
    return replace(
        completion, prompt_ids=prompt_ids, behaviour="hint", off_policy=[1] * r,
        behaviour_logprobs=list(completion.logprobs),
    )


@register_strategy("hint_reroll")
class HintReroll(OptionStrategy):
    """Guide: re-roll all-wrong groups with a hint; the hinted responses train the unhinted prompt."""

    def __init__(self, setup: RolloutSetup, hint_share: float):
        self.setup, self.hint_share = setup, hint_share

    @classmethod
    def options(cls, rollout_cfg: Any) -> dict:
        share = float(options_block(rollout_cfg, "hint_reroll", {"hint_share"}).get("hint_share", 0.5))
        if not 0.0 < share <= 1.0:
            raise ConfigError(f"rollout.hint_reroll.hint_share must lie in (0, 1], got {share}")
        return {"hint_share": share}

    def rollout(
        self, problems: list[Problem], draw_prompts: Callable[[int], list[Problem]] | None = None
    ) -> tuple[GradedGroups, dict[str, float]]:
        setup, sampler = self.setup, self.setup.sampler
        prompt_ids = sampler.encode(problems)
        graded = sampler(problems, setup.n, setup.params, setup.generator, prompt_ids)
        metrics = {"rollout_outcome_mean": float(graded.outcome.mean().item())}  # the policy without hints
        unsolved = [g for g in unsolved_groups(graded) if first_trace_text(setup, problems[g])]
        metrics["groups_unsolved_with_trace"] = float(len(unsolved))
        kept: list[int] = []
        if unsolved:
            hinted = [hinted_problem(problems[g], hint_text(first_trace_text(setup, problems[g]), self.hint_share)) for g in unsolved]
            requests = [GenerationRequest(prompt_ids=ids, n=setup.n) for ids in sampler.encode(hinted)]
            groups = sampler.generate(requests, setup.params, setup.generator)
            groups = [[retrained_without_hint(c, prompt_ids[g]) for c in group] for g, group in zip(unsolved, groups)]
            rerolled = sampler.grade([problems[g] for g in unsolved], groups, setup.params.max_new_tokens)
            solved = [i for i in range(len(unsolved)) if i not in unsolved_groups(rerolled)]
            kept = [unsolved[i] for i in solved]
            if kept:
                graded = replace_groups(graded, rerolled.select(solved), kept)
        metrics["groups_hinted"] = float(len(kept))
        return graded, metrics


@register_strategy("scaf_hints")
class ScafHints(OptionStrategy):
    """Scaf-GRPO: tiered hints after an exemption period; one failed response replaced by a hinted
    success, trained on-policy for the hinted prompt."""

    def __init__(self, setup: RolloutSetup, tiers: list[float], exempt_steps: int):
        self.setup, self.tiers, self.exempt_steps = setup, tiers, exempt_steps
        self.steps = 0

    @classmethod
    def options(cls, rollout_cfg: Any) -> dict:
        node = options_block(rollout_cfg, "scaf_hints", {"tiers", "exemption_fraction", "total_steps"})
        tiers = [float(t) for t in node.get("tiers", [0.25, 0.5, 1.0])]
        if not tiers or any(not 0.0 < t <= 1.0 for t in tiers) or tiers != sorted(tiers):
            raise ConfigError(f"rollout.scaf_hints.tiers must be increasing shares of the solution in (0, 1], got {tiers}")
        fraction = float(node.get("exemption_fraction", 0.15))
        if not 0.0 <= fraction < 1.0:
            raise ConfigError(f"rollout.scaf_hints.exemption_fraction must lie in [0, 1), got {fraction}")
        return {"tiers": tiers, "exempt_steps": int(fraction * int(node.get("total_steps", 0) or 0))}

    def state_dict(self) -> dict:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.steps = int(state["steps"])

    def rollout(
        self, problems: list[Problem], draw_prompts: Callable[[int], list[Problem]] | None = None
    ) -> tuple[GradedGroups, dict[str, float]]:
        setup, sampler = self.setup, self.setup.sampler
        self.steps += 1
        graded = setup.sample(problems)
        metrics = {"rollout_outcome_mean": float(graded.outcome.mean().item()), "groups_scaffolded": 0.0}
        if self.steps <= self.exempt_steps:
            return graded, metrics
        pending = [g for g in unsolved_groups(graded) if first_trace_text(setup, problems[g])]
        rescued: dict[int, Completion] = {}
        for share in self.tiers:
            if not pending:
                break
            hinted = [hinted_problem(problems[g], hint_text(first_trace_text(setup, problems[g]), share)) for g in pending]
            requests = [GenerationRequest(prompt_ids=ids, n=setup.n) for ids in sampler.encode(hinted)]
            groups = sampler.generate(requests, setup.params, setup.generator)
            tried = sampler.grade([problems[g] for g in pending], groups, setup.params.max_new_tokens)
            index = tried.group_index
            still = []
            for i, g in enumerate(pending):
                rows = (index == i).nonzero(as_tuple=True)[0].tolist()
                right = [row for row in rows if tried.grades[row].correct]
                if right:
                    c = groups[i][rows.index(right[0])]
                    rescued[g] = replace(c, behaviour="hint", off_policy=[0] * len(c.response_ids))
                else:
                    still.append(g)
            pending = still
        if rescued:
            groups = [list(group) for group in graded.groups]
            for g, c in rescued.items():
                groups[g][0] = c  # every response of the group failed: replace the first
            graded = sampler.grade(problems, groups, setup.params.max_new_tokens)
        metrics["groups_scaffolded"] = float(len(rescued))
        return graded, metrics



def with_demonstration(problem: Problem, demo: Problem, solution: str) -> Problem:
    """The problem preceded by a solved demonstration (another problem and its solution)."""
    return replace(problem, prompt=f"Example problem: {demo.prompt}\nExample solution: {solution}\n\nProblem: {problem.prompt}")


def expert_bonus(step: int, beta: float, horizon: int) -> float:
    """ICPO's annealed bonus of a correct expert response: beta * max(0, 1 - step / horizon)."""
    return beta * max(0.0, 1.0 - step / horizon)


@register_strategy("icl_expert")
class InContextExpert(OptionStrategy):
    """ICPO's implicit expert forcing (Huang et al. 2025, "Think Outside the Policy: In-Context Steered
    Policy Optimization", arXiv:2510.26519): per prompt, ``rollout.n - 1`` responses of the policy and
    one "expert" response sampled with a solved demonstration in the prompt (another problem of the
    step with a guidance trace, drawn from the rollout stream) and trained for the bare prompt. The
    expert response is off-policy in every token with behaviour log-prob 0 (mu = 1: ICPO's loss shapes
    pi_theta itself, as LUFFY's; loss ``policy_shaping``). Expert rejection: a wrong expert response is
    dropped and one more response of the policy takes its place, so the group statistics exclude it.
    A correct expert response's reward gets the bonus ``beta * max(0, 1 - t / horizon)`` (t: the
    step, from 0). A prompt with no demonstration available gets ``rollout.n`` policy responses."""

    def __init__(self, setup: RolloutSetup, beta: float, horizon: int):
        self.setup, self.beta, self.horizon = setup, beta, horizon
        self.steps = 0

    @classmethod
    def options(cls, rollout_cfg: Any) -> dict:
        node = options_block(rollout_cfg, "icl_expert", {"beta", "horizon"})
        beta, horizon = float(node.get("beta", 1.0)), int(node.get("horizon", 400))
        if beta < 0 or horizon < 1:
            raise ConfigError(f"rollout.icl_expert needs beta >= 0 and horizon >= 1, got {beta}, {horizon}")
        if int(rollout_cfg.n) < 2:
            raise ConfigError("rollout=icl_expert needs rollout.n >= 2: one expert response beside the policy's")
        return {"beta": beta, "horizon": horizon}

    def state_dict(self) -> dict:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.steps = int(state["steps"])

    def demonstration(self, position: int, problems: list[Problem]) -> Problem | None:
        """Another problem of the step with a trace, drawn uniformly from the rollout stream."""
        others = [i for i, p in enumerate(problems) if i != position and first_trace_text(self.setup, p)]
        if not others:
            return None
        return problems[others[int(torch.randint(len(others), (), generator=self.setup.generator).item())]]

    def rollout(
        self, problems: list[Problem], draw_prompts: Callable[[int], list[Problem]] | None = None
    ) -> tuple[GradedGroups, dict[str, float]]:
        setup, sampler = self.setup, self.setup.sampler
        prompt_ids = sampler.encode(problems)
        demos = [self.demonstration(i, problems) for i in range(len(problems))]
        with_expert = [i for i, demo in enumerate(demos) if demo is not None]
        requests = [GenerationRequest(ids, n=setup.n - (demo is not None)) for ids, demo in zip(prompt_ids, demos)]
        groups = [list(group) for group in sampler.generate(requests, setup.params, setup.generator)]
        if with_expert:
            forced = [with_demonstration(problems[i], demos[i], first_trace_text(setup, demos[i])) for i in with_expert]
            expert_requests = [GenerationRequest(ids, n=1) for ids in sampler.encode(forced)]
            experts = sampler.generate(expert_requests, setup.params, setup.generator)
            expert_grades = sampler.grade([problems[i] for i in with_expert], experts, setup.params.max_new_tokens)
            rejected = []
            for i, (group, grade) in zip(with_expert, zip(experts, expert_grades.grades)):
                c = group[0]
                if grade.correct:
                    r = len(c.response_ids)
                    groups[i].append(replace(c, prompt_ids=prompt_ids[i], behaviour="expert", off_policy=[1] * r,
                                             behaviour_logprobs=[0.0] * r))
                else:
                    rejected.append(i)
            if rejected:  # expert rejection: one more response of the policy instead
                extra = sampler.generate([GenerationRequest(prompt_ids[i], n=1) for i in rejected], setup.params, setup.generator)
                for i, group in zip(rejected, extra):
                    groups[i].extend(group)
        graded = sampler.grade(problems, groups, setup.params.max_new_tokens)
        expert = torch.tensor([c.behaviour == "expert" for group in groups for c in group])
        bonus = expert_bonus(self.steps, self.beta, self.horizon)
        graded.rewards = graded.rewards + bonus * expert.to(graded.rewards.dtype)
        self.steps += 1
        metrics = {
            "expert_responses": float(expert.sum().item()),
            "experts_rejected": float(len(with_expert) - int(expert.sum().item())),
            "expert_bonus": bonus,
            "rollout_outcome_mean": float(graded.outcome[~expert].mean().item()),  # the policy's own responses
        }
        return graded, metrics
