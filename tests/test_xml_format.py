"""MOTIF's <reasoning>/<answer> format (arXiv:2507.02851; rlbench/reward/xml_format.py): the three format
rewards on hand-written responses, the answer read inside <answer>, their terms and paper=motif's wiring."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import CharTokenizer
from omegaconf import OmegaConf
from test_rollout_multiround import Engine, Grader

from rlbench.config.typed import typed_config
from rlbench.dataset.base import Problem
from rlbench.dataset.prompts import build_messages
from rlbench.reward.graders import training_grader
from rlbench.reward.math import Grade, MathReward, extract_answer
from rlbench.reward.terms import RewardComposer, check_reward_config
from rlbench.rollout import GroupSampler, RolloutSetup
from rlbench.rollout.engines.base import SamplingParams
from rlbench.rollout.strategies.multiround import FINAL_ROUND_NOTE, MultiroundOptions, MultiroundRollout
from rlbench.reward.xml_format import answer_tag_content, soft_format, strict_format, xml_count

ROOT = Path(__file__).resolve().parents[1]
PERFECT = "<reasoning>\nr\n</reasoning>\n<answer>\n4\n</answer>\n"  # the strict layout


@pytest.mark.parametrize(
    "text, xml, soft, strict",
    [
        # four tags, nothing after "</answer>\n": 4 * 1/8; both formats
        (PERFECT, 0.5, 1.0, 1.0),
        # one-line blocks: the soft format; no tag has its line breaks, so no xml credit
        ("<reasoning>r</reasoning> <answer>4</answer>", 0.0, 1.0, 0.0),
        # "<reasoning>\n" missing: 3 * 1/8
        ("r\n</reasoning>\n<answer>\n4\n</answer>\n", 0.375, 0.0, 0.0),
        # 4 characters after "</answer>\n": each answer tag loses 4/1000 -> 0.5 - 0.008; strict needs the end
        (PERFECT + "done", 0.492, 1.0, 0.0),
        # no final newline (47 characters): no "\n</answer>\n", so the tail is the whole text:
        # 1/8 + 1/8 + (1/8 - 47/1000) + (1/8 - (0 - 1)/1000) = 0.454 (the code's count); both formats
        (PERFECT[:-1], 0.454, 1.0, 1.0),
        # a reasoning over several lines: the layout the prompt asks for
        ("<reasoning>\na\nb\n</reasoning>\n<answer>\n4\n\n5\n</answer>\n", 0.5, 1.0, 1.0),
        # the answer block twice: its two tags count 0 (each tag must occur once); strict: a block holds no tag
        (PERFECT + "<answer>\n5\n</answer>\n", 0.25, 1.0, 0.0),
        # an answer tag inside the reasoning: neither format; "\n<answer>\n" twice: 3 * 1/8
        ("<reasoning>\nr\n<answer>\n3\n</reasoning>\n<answer>\n4\n</answer>\n", 0.375, 0.0, 0.0),
        # text before the reasoning: both patterns are matched from the start
        ("Sure.\n" + PERFECT, 0.5, 0.0, 0.0),
    ],
)
def test_format_rewards_of_hand_written_responses(text, xml, soft, strict):
    assert xml_count(text) == pytest.approx(xml, abs=1e-12)
    assert soft_format(text) == soft and strict_format(text) == strict


def test_a_response_laid_out_as_the_motif_prompt_asks_gets_both_format_rewards():
    """The layout shown in MOTIF's system prompt (conf/dataset/prompt/motif.yaml), filled in with several lines,
    ending at "</answer>" (end of sequence) or after a newline: the full soft and strict format rewards."""
    system = OmegaConf.load(ROOT / "conf/dataset/prompt/motif.yaml").system
    layout = system.split("you follow the strict format:\n")[1].split("\n\n")[0]
    assert layout == "<reasoning>\nreasoning process here\n</reasoning>\n<answer>\ndetailed progress here\n</answer>"
    filled = layout.replace("reasoning process here", "3 + 4 = 7.\nThen 7 * 2 = 14.").replace("detailed progress here", "Twice 7 is \\boxed{14}.")
    for response in (layout, layout + "\n", filled, filled + "\n"):
        assert soft_format(response) == 1.0 and strict_format(response) == 1.0
    assert xml_count(filled + "\n") == 0.5


def test_the_answer_is_read_inside_the_answer_tags():
    text = "<reasoning>\nwe get 7\n</reasoning>\n<answer>\nThe total is 12\n</answer>\nthen 99"
    assert answer_tag_content(text) == "The total is 12"
    assert extract_answer(text, "answer_tag") == "12" and extract_answer(text, "auto") == "99"
    # the last <answer> block; an unclosed one runs to the end; no tag: the whole response, stripped
    assert answer_tag_content("<answer>1</answer><answer> 2 </answer>") == "2"
    assert answer_tag_content("<answer>\n\\boxed{3}") == "\\boxed{3}"
    assert answer_tag_content("  \\boxed{3}\n") == "\\boxed{3}"


def test_the_answer_tag_grader_keeps_the_format_only_with_a_tag():
    grader = MathReward(extraction="answer_tag")
    tagged = grader("<reasoning>\n2+2\n</reasoning>\n<answer>\n\\boxed{4}\n</answer>\n", "4")
    assert tagged.correct and tagged.format_ok and tagged.extracted == "4"
    bare = grader("\\boxed{4}", "4")  # read whole: right, but not in the format
    assert bare.correct and not bare.format_ok
    outside = grader("<answer>\n7\n</answer>\n\\boxed{4}", "4")  # the boxed answer outside the tags is not read
    assert not outside.correct and outside.extracted == "7"


def grade(reward: float) -> Grade:
    return Grade(correct=reward > 0, extracted=None, reward=reward, format_ok=True)


def test_the_terms_add_with_motifs_weights_and_are_logged():
    one_line = "<reasoning>r</reasoning> <answer>4</answer>"
    composer = RewardComposer({"grader": 1.0, "xml_count": 1.0, "soft_format": 0.5, "strict_format": 0.5})
    rewards = composer([Problem("1", "q", "4")], [[PERFECT, one_line, "4"]], [grade(1.0), grade(1.0), grade(0.0)])
    # PERFECT: 1 + 0.5 + 0.5 * 1 + 0.5 * 1; one_line: 1 + 0 + 0.5 * 1 + 0; "4": nothing
    assert rewards.tolist() == [2.5, 1.5, 0.0]
    taken = composer.take()
    assert taken["reward_term_xml_count"] == pytest.approx(0.5 / 3)
    assert taken["reward_term_soft_format"] == pytest.approx(2 / 3) and taken["reward_term_strict_format"] == pytest.approx(1 / 3)
    assert "reward_term_xml_count_failed" not in taken  # no judge: nothing can fail


def test_paper_motif_composes_the_prompt_the_terms_and_the_answer_tag_grader(make_cfg):
    cfg = make_cfg("paper=motif")
    assert dict(cfg.reward.terms) == {"grader": 1.0, "xml_count": 1.0, "soft_format": 0.5, "strict_format": 0.5}
    config = typed_config(cfg)
    check_reward_config(config.reward)
    assert training_grader(config).extraction == "answer_tag"
    messages = build_messages(Problem("1", "What is 2+2?", "4"), cfg.dataset.prompt)
    assert messages[0]["role"] == "system" and "<reasoning>" in messages[0]["content"] and "3 rounds" in messages[0]["content"]
    assert messages[1] == {"role": "user", "content": "What is 2+2?"}
    assert cfg.paper.fidelity.status == "faithful"
    assert make_cfg("paper=motif", "experiment=smoke").reward.name == "even_tokens"  # smoke: the toy reward


def test_multiround_adds_the_first_rounds_format_terms_in_the_graders_place():
    one_line = "<reasoning>r</reasoning> <answer>a</answer>"  # hands on its answer part, "a"
    composer = RewardComposer({"grader": 1.0, "soft_format": 0.5})
    sampler = GroupSampler(Engine(first=(one_line, "b")), Grader(), CharTokenizer(), {"user": "Q {problem}"}, lambda r, _: r, compose=composer)
    setup = RolloutSetup(sampler, 2, SamplingParams(1.0, 1.0, 4), None)
    groups, _ = MultiroundRollout(setup, MultiroundOptions(rounds=2, continuations=2)).rollout([Problem("1", "x", "0")])
    assert sampler.engine.prompts[1] == "Q x\n\nProgress in round 1: a" + FINAL_ROUND_NOTE
    # one_line: graded wrong, soft format 1 -> outcome 0.5; its rounds end R, R -> 2 * 1 + 0.5
    # "b": graded right, no format -> outcome 1; its rounds end W, W -> 2 * 0 + (1 - 1 * 1)
    assert groups.outcome.tolist() == [0.5, 1.0] and groups.rewards.tolist() == [2.5, 0.0]
