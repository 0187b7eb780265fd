"""The judge methods' CPU checks (rlbench/reward/terms.py; docs/judges.md): Pairwise-RL's swap-averaged win
probability and its antisymmetry, BRPO's bootstrapped reference and the signs of its advantages, FAPO's
sign flip and that only correct responses reach the judge; each preset runs from the command line."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import smoke_cli_steps  # noqa: E402

from rlbench.algorithm.advantages.group_relative import grpo_advantage  # noqa: E402
from rlbench.dataset.base import Problem  # noqa: E402
from rlbench.reward.judges import ScriptedJudge  # noqa: E402
from rlbench.reward.math import Grade  # noqa: E402
from rlbench.reward.terms import (  # noqa: E402
    RewardComposer,
    TermInputs,
    brpo_reference,
    swap_averaged,
)


def grade(correct: bool, reward: float) -> Grade:
    return Grade(correct=correct, extracted=None, reward=reward, format_ok=True)


def advantages(rewards: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    return grpo_advantage(rewards, group_index, torch.ones(len(rewards), 1))[:, 0]


# A judge with a known preference matrix that has a position bias: P(row first ≻ column second).
RESPONSES = ["alpha", "beta", "gamma", "delta"]
MATRIX = torch.tensor([
    [0.5, 0.9, 0.6, 0.2],
    [0.3, 0.5, 0.7, 0.4],
    [0.5, 0.1, 0.5, 0.8],
    [0.7, 0.6, 0.3, 0.5],
])


def matrix_judge() -> ScriptedJudge:
    return ScriptedJudge(pairwise=lambda q, a, b: MATRIX[RESPONSES.index(a), RESPONSES.index(b)].item())


def test_pairwise_rl_reward_is_the_swap_averaged_win_probability_against_the_anchor():
    composer = RewardComposer({"pairwise_rl": 1.0}, matrix_judge())
    rewards = composer([Problem("p", "q", "1")], [RESPONSES], [grade(False, 0.0)] * 4)
    anchor = 0  # the group's first response
    expected = [0.5] + [0.5 * (MATRIX[i, anchor] + 1 - MATRIX[anchor, i]).item() for i in range(1, 4)]
    assert rewards.tolist() == pytest.approx(expected)
    assert expected[1] == pytest.approx(0.5 * (0.3 + 1 - 0.9))  # beta loses to alpha in both orders: 0.2


def test_pairwise_rl_antisymmetry_under_a_position_biased_judge():
    inputs = TermInputs(["q"] * 4, ["1"] * 4, RESPONSES, [grade(False, 0.0)] * 4, torch.zeros(4, dtype=torch.long), 0, 0)
    pairs = list(itertools.permutations(range(4), 2))
    r = dict(zip(pairs, swap_averaged(matrix_judge(), inputs, pairs)))
    for i, j in pairs:
        assert r[(i, j)] + r[(j, i)] == pytest.approx(1.0)


def test_brpo_reference_is_seeded_and_changes_across_steps():
    draws = [brpo_reference(seed=0, step=s, group=0, size=8) for s in range(12)]
    assert draws == [brpo_reference(seed=0, step=s, group=0, size=8) for s in range(12)]
    assert len(set(draws)) > 1 and all(0 <= k < 8 for k in draws)
    assert draws != [brpo_reference(seed=1, step=s, group=0, size=8) for s in range(12)]


def test_brpo_advantages_have_the_signs_of_the_comparison_with_the_bootstrapped_reference():
    texts = ["a" * n for n in (5, 2, 9, 4, 7, 3)]
    composer = RewardComposer({"brpo": 1.0}, ScriptedJudge("shorter"), seed=3)
    seen = set()
    for step in range(6):
        rewards = composer([Problem("p", "q", "1")], [texts], [grade(False, 0.0)] * 6)
        k = brpo_reference(3, step, 0, 6)
        seen.add(k)
        adv = advantages(rewards, torch.zeros(6, dtype=torch.long))
        for i, text in enumerate(texts):
            if i == k:
                assert rewards[i] == 0
            elif len(text) < len(texts[k]):  # shorter than the reference: preferred
                assert rewards[i] == 1 and adv[i] > 0
            else:
                assert rewards[i] == -1 and adv[i] < 0
    assert len(seen) > 1  # the reference moved across the steps


def test_brpo_draws_continue_after_a_restored_state():
    texts = ["a" * n for n in (5, 2, 9, 4, 7, 3)]
    run = RewardComposer({"brpo": 1.0}, ScriptedJudge("shorter"), seed=5)
    for _ in range(3):
        run([Problem("p", "q", "1")], [texts], [grade(False, 0.0)] * 6)
    resumed = RewardComposer({"brpo": 1.0}, ScriptedJudge("shorter"), seed=5)
    resumed.load_state_dict(run.state_dict())
    for _ in range(4):  # the same references as the uninterrupted run
        args = ([Problem("p", "q", "1")], [texts], [grade(False, 0.0)] * 6)
        assert torch.equal(run(*args), resumed(*args))


def fapo_rewards(grades: list[Grade], flawed: set[str], texts: list[str]):
    asked = []

    def flags(question, response, reference):
        asked.append(response)
        return float(response in flawed)

    composer = RewardComposer({"grader": 1.0, "fapo": 1.0}, ScriptedJudge(pointwise=flags))
    return composer([Problem("p", "q", "1")], [texts], grades), asked


@pytest.mark.parametrize(
    "correct, flawed_index, sign",
    [
        ([True, True, False, False], 1, +1),  # rewards [1, 0 flawed, -1, -1]: the flawed positive helps early
        ([True, True, True, True], 3, -1),  # rewards [1, 1, 1, 0 flawed]: penalised later
    ],
)
def test_fapo_sign_flip_and_only_positives_reach_the_judge(correct, flawed_index, sign):
    texts = [f"response {i}" for i in range(4)]
    grades = [grade(c, 1.0 if c else -1.0) for c in correct]
    rewards, asked = fapo_rewards(grades, {texts[flawed_index]}, texts)
    assert rewards[flawed_index] == 0
    assert asked == [t for t, c in zip(texts, correct) if c]  # only the correct responses are judged
    adv = advantages(rewards, torch.zeros(4, dtype=torch.long))
    assert torch.sign(adv[flawed_index]).item() == sign


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["fapo", "brpo"])
def test_judge_presets_run_from_the_command_line(tmp_path, preset):
    steps = smoke_cli_steps(tmp_path / preset, f"reward={preset}", "eval.before_training=false")
    assert len(steps) == 2
    for step in steps:
        assert f"reward_term_{preset}" in step and step[f"reward_term_{preset}_failed"] == 0
        assert "judge_calls" in step and "judge_s" in step


def eval_characters(run: Path) -> tuple[float, float]:
    """Mean characters of the evaluation's responses before and after training."""
    import json

    before = [len(s["completion"]) for s in json.loads((run / "eval" / "before.json").read_text())["samples"]]
    after = [len(json.loads(line)["completion"]) for line in (run / "eval" / "samples.jsonl").read_text().splitlines()]
    return sum(before) / len(before), sum(after) / len(after)


@pytest.mark.slow
def test_brpo_with_a_scripted_judge_moves_the_toy_policys_length_its_way(tmp_path):
    """The toy (tiny model, 16 steps, conf/experiment/toy_learning.yaml) under BRPO with the scripted judge:
    preferring shorter responses shortens them, preferring longer ones lengthens them (the responses never
    end within the 8 tokens, so their length in characters is what the policy can move)."""
    import os
    import subprocess

    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}
    lengths = {}
    for rule in ("shorter", "longer"):
        out = tmp_path / rule
        proc = subprocess.run(
            [sys.executable, "-m", "rlbench.cli", "experiment=toy_learning", "reward=brpo", f"reward.judge.rule={rule}",
             "eval.before_training=true", "eval.n=8", "eval.limit=8", "eval.k=[1]", f"hydra.run.dir={out}"],
            cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=600, env=env,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        lengths[rule] = eval_characters(out)
    assert lengths["shorter"][1] < lengths["shorter"][0], lengths
    assert lengths["longer"][1] > lengths["longer"][0], lengths
