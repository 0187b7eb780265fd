"""Cog-Rethinker re-rollouts (rlbench/rollout/strategies/rethink.py, arXiv:2510.15979)."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import CharTokenizer, smoke_cli_steps
from rlbench.config.typed import rollout_config
from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError
from rlbench.reward.math import Grade
from rlbench.rollout import GroupSampler, RolloutSetup, make_strategy, validate_strategy
from rlbench.rollout.engines.base import Completion, SamplingParams
from rlbench.rollout.strategies.rethink import RethinkOptions, RethinkRollout, stage_problem
from rlbench.training.batch import collate
from rlbench.training.step import behaviour_old_logp


class Engine:
    """Problem "easy" is answered "y" directly; "hard" only under the refine prompt ("wrong" in it);
    "never" is never answered right. Answers are one token with log-prob -0.5."""

    def __init__(self):
        self.prompts = []

    def generate(self, requests, params, generator=None):
        out = []
        for i, r in enumerate(requests):
            text = "".join(chr(t) for t in r.prompt_ids)
            self.prompts.append(text)
            answer = "y" if "easy" in text or ("hard" in text and "wrong" in text) else "n"
            out.append([Completion(i, r.prompt_ids, [ord(answer)], [-0.5], True, text=answer) for _ in range(r.n)])
        return out


class Grader:
    def __call__(self, text, answer, response_ids):
        return Grade(correct=text == "y", extracted=text, reward=float(text == "y"), format_ok=True)


def test_unsolved_problems_go_through_decompose_then_refine_and_a_success_joins_off_policy():
    sampler = GroupSampler(Engine(), Grader(), CharTokenizer(), {"user": "Q: {problem}"}, lambda r, _: r)
    setup = RolloutSetup(sampler, 3, SamplingParams(1.0, 1.0, 4), None)
    options = RethinkOptions(samples=2, shown_attempts=2, decompose_template="Split: {problem}",
                             refine_template="{problem} | {attempts} | wrong?")
    problems = [Problem("1", "easy", "y"), Problem("2", "hard", "y"), Problem("3", "never", "y")]
    groups, metrics = RethinkRollout(setup, options).rollout(problems)
    assert metrics == {"rethink_zero_accuracy_prompts": 2.0, "rethink_decompose_solved": 0.0, "rethink_refine_solved": 1.0}
    prompts = sampler.engine.prompts
    assert prompts[3:5] == ["Q: Split: hard", "Q: Split: never"]  # the stage inside the dataset's template
    assert prompts[5:] == ["Q: hard | - n\n- n | wrong?", "Q: never | - n\n- n | wrong?"]
    easy, hard, never = groups.groups
    assert [c.behaviour for c in hard] == ["policy", "policy", "rethink"] and all(c.behaviour == "policy" for c in never)
    success = hard[-1]
    assert success.prompt_ids == hard[0].prompt_ids == tuple(ord(c) for c in "Q: hard")  # the direct prompt
    assert success.off_policy == [1] and success.behaviour_logprobs == [-0.5]
    assert groups.rewards.tolist() == [1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    # the trainer takes pi_old of the re-attached tokens from their stage log-probs, never from the direct prompt
    batch = collate(groups.groups, pad_token_id=0, current_version=0)
    recomputed = torch.full_like(batch.response_mask, -9.0)
    old = behaviour_old_logp(batch, recomputed)
    assert old[5, 0].item() == -0.5 and old[4, 0].item() == -9.0


def test_stage_problem_substitutes_texts_with_braces():
    p = stage_problem(Problem("1", "f(x) = {x}", "1"), "A {problem} B {attempts}", "- \\boxed{2}")
    assert p.prompt == "A f(x) = {x} B - \\boxed{2}"


def test_settings_are_checked_before_the_model_loads(make_cfg):
    cfg = rollout_config(make_cfg("rollout=rethink").rollout)
    validate_strategy(cfg, "grpo")
    assert isinstance(make_strategy(cfg, RolloutSetup(None, 2, SamplingParams(), None)), RethinkRollout)
    base = {"strategy": "rethink", "n": 2}
    with pytest.raises(ConfigError, match="refine_template must contain"):
        validate_strategy(rollout_config({**base, "rethink": {"refine_template": "{problem}"}}), "grpo")
    with pytest.raises(ConfigError, match="decompose_template must contain"):
        validate_strategy(rollout_config({**base, "rethink": {"decompose_template": "solve"}}), "grpo")
    with pytest.raises(ConfigError, match="must be >= 1"):
        validate_strategy(rollout_config({**base, "rethink": {"samples": 0}}), "grpo")


@pytest.mark.slow
def test_cli_run_reports_its_stages(tmp_path):
    steps = smoke_cli_steps(tmp_path / "run", "rollout=rethink", "rollout.rethink.samples=2")
    assert all("rethink_zero_accuracy_prompts" in s for s in steps)
