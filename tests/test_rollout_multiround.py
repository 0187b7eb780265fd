"""MOTIF multi-round rollouts (rlbench/rollout/strategies/multiround.py, arXiv:2507.02851)."""

from __future__ import annotations

import pytest
import torch

from rlbench.config.typed import rollout_config
from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError
from rlbench.reward.math import Grade, MathReward
from rlbench.reward.xml_format import outside_answer_part
from rlbench.rollout import GroupSampler, RolloutSetup, make_strategy, validate_strategy
from rlbench.rollout.engines.base import Completion, SamplingParams
from rlbench.rollout.strategies.multiround import FINAL_ROUND_NOTE, MultiroundOptions, MultiroundRollout, motif_reward, round_problem


def test_the_reward_is_the_mean_trajectory_score():
    final = torch.tensor([True, False, False, True, True, False])
    outside = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0])  # a final answer right takes 2 whatever is outside
    assert motif_reward(final, torch.zeros(6), 3).tolist() == pytest.approx([2.0 / 3, 4.0 / 3])
    assert motif_reward(final, outside, 3).tolist() == pytest.approx([(2 + 1 + 0) / 3, 4.0 / 3])

from conftest import CharTokenizer, smoke_cli_steps


class Engine:
    """Round 1 (no "Progress" in the prompt) answers ``first``: "a" for the first sample and "b" for the next;
    a later round answers "R" when the progress it is given is "a", else "W"."""

    def __init__(self, first=("a", "b")):
        self.prompts, self.first = [], first

    def generate(self, requests, params, generator=None):
        out = []
        for i, r in enumerate(requests):
            text = "".join(chr(t) for t in r.prompt_ids)
            self.prompts.append(text)
            if "Progress" not in text:
                answers = list(self.first[: r.n])
            else:
                answers = ["R" if "Progress in round 1: a" in text or "Progress in round 2: R" in text else "W"]
            out.append([Completion(i, r.prompt_ids, [ord(ch) for ch in a], [0.0] * len(a), True, text=a) for a in answers])
        return out


class Grader:
    """Reward 1 for the answer "R" or "b"."""

    def __call__(self, text, answer, response_ids):
        return Grade(correct=text in ("R", "b"), extracted=text, reward=float(text in ("R", "b")), format_ok=True)


def test_first_round_responses_are_rewarded_by_their_later_rounds():
    sampler = GroupSampler(Engine(), Grader(), CharTokenizer(), {"user": "Q {problem}"}, lambda r, _: r)
    setup = RolloutSetup(sampler, 2, SamplingParams(1.0, 1.0, 4), None)
    groups, metrics = MultiroundRollout(setup, MultiroundOptions(rounds=3, continuations=2)).rollout([Problem("1", "x", "0")])
    # round 1: "a" (graded wrong) hands on progress that leads to R, R (correct); "b" (graded right) to W, W
    assert [c.text for c in groups.groups[0]] == ["a", "b"]  # only first-round responses are trained
    assert groups.outcome.tolist() == [0.0, 1.0] and groups.rewards.tolist() == [2.0, 0.0]
    assert metrics == {"multiround_final_accuracy": 0.5, "multiround_boxed_outside": 0.0, "multiround_first_accuracy": 0.5}
    later = sampler.engine.prompts[1:]
    assert later[:4] == ["Q x\n\nProgress in round 1: a"] * 2 + ["Q x\n\nProgress in round 1: b"] * 2
    assert later[4] == "Q x\n\nProgress in round 2: R" + FINAL_ROUND_NOTE
    assert sampler.cost.take()["generated_responses"] == 2 + 2 * 2 * 2


class ScriptedEngine:
    """Round 1 answers ``first`` (its n responses); a later round answers the next string of ``later[progress]``,
    the list for the progress it is handed on, in turn."""

    def __init__(self, first, later):
        self.first, self.later, self.prompts = first, {k: iter(v) for k, v in later.items()}, []

    def generate(self, requests, params, generator=None):
        out = []
        for i, r in enumerate(requests):
            text = "".join(chr(t) for t in r.prompt_ids)
            self.prompts.append(text)
            progress = text.split(": ", 1)[1].removesuffix(FINAL_ROUND_NOTE) if "Progress" in text else None
            answers = list(self.first[: r.n]) if progress is None else [next(self.later[progress])]
            out.append([Completion(i, r.prompt_ids, [ord(ch) for ch in a], [0.0] * len(a), True, text=a) for a in answers])
        return out


def motif(body: str, answer: str) -> str:
    return f"<reasoning>\n{body}\n</reasoning>\n<answer>\n{answer}\n</answer>"


def test_trajectories_score_two_for_the_final_answer_one_for_a_boxed_answer_outside_it_else_zero():
    """The released code's score (arXiv:2507.02851, motif.py): 2 when the final round's answer part holds the
    reference, else 1 when the final response holds it boxed outside its answer tags, else 0; a first round
    that already boxes the reference gets nothing for it. The reward is the mean over the continuations."""
    right = motif("4 apples", "So there are \\boxed{4} apples")  # 2
    outside = motif("so \\boxed{4}", "about 5")                   # 1: boxed, outside the answer tags
    unboxed = motif("it is 4, \\boxed{}", "\\boxed{5}")          # 0: the 4 outside is not boxed (a last number)
    wrong = motif("\\boxed{3}", "5")                              # 0
    engine = ScriptedEngine(
        first=(motif("half", "a"), motif("\\boxed{4}", "b"), motif("x", "c")),  # the second boxes the answer in round 1
        later={"a": [right, outside], "b": [unboxed, wrong], "c": [outside, outside]},
    )
    grader = MathReward(extraction="answer_tag")  # reward=xml_format's reading
    sampler = GroupSampler(engine, grader, CharTokenizer(), {"user": "{problem}"}, lambda r, _: r)
    setup = RolloutSetup(sampler, 3, SamplingParams(1.0, 1.0, 4), None)
    groups, metrics = MultiroundRollout(setup, MultiroundOptions(rounds=2, continuations=2)).rollout([Problem("1", "x", "4")])
    assert groups.rewards.tolist() == [(2 + 1) / 2, (0 + 0) / 2, (1 + 1) / 2]
    assert metrics["multiround_final_accuracy"] == pytest.approx(1 / 6) and metrics["multiround_boxed_outside"] == 0.5
    assert engine.prompts[1:] == [f"x\n\nProgress in round 1: {p}{FINAL_ROUND_NOTE}" for p in "aabbcc"]


def test_the_text_outside_the_answer_part():
    assert outside_answer_part(motif("r", "5") + " then \\boxed{4}") == "<reasoning>\nr\n</reasoning>\n then \\boxed{4}"
    assert outside_answer_part("<answer>1</answer> a <answer>2</answer> b") == "<answer>1</answer> a  b"  # the last block
    assert outside_answer_part("\\boxed{4} <answer>\n5") == "\\boxed{4} "  # unclosed: runs to the end
    assert outside_answer_part("\\boxed{4}") == ""  # no tag: the whole response is the answer part


def test_round_problem_appends_the_progress():
    p = round_problem(Problem("7", "2+2", "4"), 1, "it is 4", final=False)
    assert p.prompt == "2+2\n\nProgress in round 1: it is 4" and p.answer == "4" and p.uid == "7"
    assert round_problem(Problem("7", "2+2", "4"), 2, "4", final=True).prompt.endswith("round 2: 4" + FINAL_ROUND_NOTE)


def test_settings_are_checked_before_the_model_loads(make_cfg):
    cfg = rollout_config(make_cfg("rollout=multiround").rollout)
    validate_strategy(cfg, "grpo")
    assert isinstance(make_strategy(cfg, RolloutSetup(None, 2, SamplingParams(), None)), MultiroundRollout)
    with pytest.raises(ConfigError, match="rounds must be >= 2"):
        validate_strategy(rollout_config({"strategy": "multiround", "n": 2, "multiround": {"rounds": 1}}), "grpo")
    with pytest.raises(ConfigError, match="continuations must be >= 1"):
        validate_strategy(rollout_config({"strategy": "multiround", "n": 2, "multiround": {"continuations": 0}}), "grpo")


@pytest.mark.slow
def test_cli_run_generates_the_later_rounds(tmp_path):
    steps = smoke_cli_steps(
        tmp_path / "run", "rollout=multiround", "rollout.multiround.rounds=2", "rollout.multiround.continuations=2"
    )
    for step in steps:  # 2 prompts x 2 first-round responses, each continued twice for one more round
        assert step["generated_responses"] == 4 + 8 and step["trained_tokens"] <= 4 * 8
        assert "multiround_final_accuracy" in step
