"""FAPO's GenRM (arXiv:2510.22543; rlbench/reward/genrm.py, rlbench/dataset/flaw_steps.py, the judge's
verdict=step_index; docs/judges.md): the partial-credit reward on hand-computed cases, the answer reader, the
generated dataset's labels recomputed step by step, and the judge reading a scripted GenRM's step index."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parent))

from rlbench.config.schema import DatasetConfig, JudgeConfig, RewardConfig  # noqa: E402
from rlbench.dataset import load_problems  # noqa: E402
from rlbench.dataset.base import Problem  # noqa: E402
from rlbench.dataset.flaw_steps import generate_flaw_steps  # noqa: E402
from rlbench.errors import ConfigError  # noqa: E402
from rlbench.reward.genrm import GenRMReward, genrm_reward, parse_step_index, split_steps  # noqa: E402
from rlbench.reward.graders import make_grader  # noqa: E402
from rlbench.reward.judges import ModelJudge, PointItem  # noqa: E402
from rlbench.reward.math import Grade  # noqa: E402
from rlbench.reward.terms import RewardComposer, check_reward_config  # noqa: E402
from rlbench.validation import check_reward_matches_dataset  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

# ------------------------------------------------------------------------------------ the reward


@pytest.mark.parametrize(
    "predicted, label, n_steps, expected",
    [
        (-1, -1, 4, 1.0),    # sound, says "no error": +1
        (2, -1, 4, -1.0),    # sound, flags a step: -1
        (3, 2, 4, 0.75),     # flawed at 2 of 4, flags 3: 1 - |3 - 2| / 4
        (2, 2, 4, 1.0),      # flawed, the exact step: 1 - 0
        (5, 1, 5, 0.2),      # flawed at 1 of 5, flags 5: 1 - 4/5
        (-1, 2, 4, -1.0),    # flawed, says "no error": -1
        (None, 2, 4, -1.0),  # unreadable: -1
        (None, -1, 4, -1.0),
    ],
)
def test_partial_credit_reward_by_step_distance(predicted, label, n_steps, expected):
    assert genrm_reward(predicted, label, n_steps) == pytest.approx(expected)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("\\boxed{3}", 3),
        ("Step 2 multiplies wrongly, so the answer is \\boxed{2}.", 2),  # the boxed one, not the last integer
        ("Every step checks out: \\boxed{-1}", -1),
        ("the earliest wrong step is 4", 4),  # no box: the last integer
        ("no error, -1", -1),
        ("\\boxed{9}", None),  # past the 4 steps
        ("\\boxed{0}", None),  # steps are numbered from 1
        ("\\boxed{two}", None),
        ("I cannot tell", None),
        ("3.5", None),
    ],
)
def test_the_answer_reader(text, expected):
    assert parse_step_index(text, 4) == expected


def test_the_grader_reads_the_label_and_the_step_count_from_the_problem():
    problem = Problem("flaw_steps/train/1", "...", "2", {"n_steps": 4})
    grades = GenRMReward().grade_many(["\\boxed{3}", "\\boxed{2}", "\\boxed{-1}", "garbage"], [problem] * 4)
    assert [g.reward for g in grades] == pytest.approx([0.75, 1.0, -1.0, -1.0])
    assert [g.correct for g in grades] == [False, True, False, False]
    assert [g.format_ok for g in grades] == [True, True, True, False]
    # reward=fapo_genrm grades the flaw_steps set by the GenRM reward and any other benchmark as math (the smoke eval)
    spec = DatasetConfig(name="flaw_steps", loader="flaw_steps")
    assert isinstance(make_grader(RewardConfig(name="fapo_genrm"), spec), GenRMReward)
    assert not isinstance(make_grader(RewardConfig(name="fapo_genrm"), DatasetConfig(name="arith", loader="arith")), GenRMReward)


# ------------------------------------------------------------------------------------ the dataset

STEP = re.compile(r"^Step (\d+): (-?\d+) ([-+*]) (-?\d+) = (-?\d+)$")
OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
WORDS = {"add": "+", "subtract": "-", "multiply by": "*"}


def recomputed_label(problem: Problem) -> int:
    """The earliest step whose own arithmetic is wrong (-1: none), each step checked as written; also checks that
    the steps follow the question's operations and that each starts from the previous step's result."""
    start, *operations = re.search(r"Start with (-?\d+), (.*)\. What is the result\?", problem.prompt).groups()
    asked = [(WORDS[m.group(1)], int(m.group(2))) for m in re.finditer(r"(add|subtract|multiply by) (\d+)", operations[0])]
    steps = [STEP.match(line).groups() for line in problem.prompt.splitlines() if line.startswith("Step ")]
    assert len(steps) == len(asked) == problem.meta["n_steps"]
    value, wrong = int(start), -1
    for i, (number, a, op, b, c) in enumerate(steps, start=1):
        assert int(number) == i and int(a) == value and (op, int(b)) == asked[i - 1]
        if OPS[op](int(a), int(b)) != int(c) and wrong == -1:
            wrong = i
        value = int(c)
    return wrong


@pytest.mark.parametrize("split", ["train", "test"])
def test_every_label_is_the_earliest_wrong_step_recomputed(split):
    problems = generate_flaw_steps(200, seed=3, split=split)
    labels = [recomputed_label(p) for p in problems]
    assert labels == [int(p.answer) for p in problems]
    assert all(label == -1 for label in labels[::2])  # sound: every step right
    assert all(1 <= label <= p.meta["n_steps"] for label, p in zip(labels[1::2], problems[1::2]))  # one planted error
    assert {p.meta["n_steps"] for p in problems} == {3, 4, 5}
    assert {int(p.answer) for p in problems[1::2]} == {1, 2, 3, 4, 5}  # the error lands on every position


def question(problem: Problem) -> str:
    return problem.prompt.split("\n")[0]


def test_the_lists_are_seeded_repeatable_and_train_test_disjoint():
    assert generate_flaw_steps(50, 7, "train") == generate_flaw_steps(50, 7, "train")
    assert generate_flaw_steps(50, 7, "train") != generate_flaw_steps(50, 8, "train")
    test = {question(p) for p in generate_flaw_steps(100, 0, "test")}
    for seed in (0, 1, 2):
        assert not test & {question(p) for p in generate_flaw_steps(500, seed, "train")}


def test_the_dataset_option_loads_through_the_loader():
    spec = OmegaConf.load(ROOT / "conf" / "dataset" / "flaw_steps.yaml")
    spec.flaw_steps.train_size = 6
    problems = load_problems(spec, "train", seed=5)
    assert [p.uid for p in problems] == [f"flaw_steps/train/{i}" for i in range(6)]
    assert [p.answer for p in problems] == [p.answer for p in generate_flaw_steps(6, 5, "train")]


# ------------------------------------------------------------------------------------ the judge


class ScriptedGenRM:
    """A GenRM given as a function of the prompt (its greedy answer); records the prompts."""

    def __init__(self, answer):
        self.answer, self.prompts = answer, []

    def complete(self, prompts, max_new_tokens):
        self.prompts += prompts
        return [(self.answer(p), 12) for p in prompts]


def answer_by_arithmetic(prompt: str) -> str:
    """A perfect GenRM on 'a op b = c' steps (garbage for a response whose steps are not arithmetic)."""
    steps = [STEP.match(line) for line in prompt.splitlines() if line.startswith("Step ")]
    if not steps or None in steps:
        return "hmm"
    for match in steps:
        number, a, op, b, c = match.groups()
        if OPS[op](int(a), int(b)) != int(c):
            return f"\\boxed{{{number}}}"
    return "\\boxed{-1}"


def test_the_step_index_verdict_flags_a_named_step_and_counts_an_unreadable_one():
    backend = ScriptedGenRM(answer_by_arithmetic)
    judge = ModelJudge(backend, verdict="step_index")
    problems = [Problem("p", "Start with 2, add 3, then multiply by 2.", "10")]
    texts = [["2 + 3 = 5\n5 * 2 = 10", "2 + 3 = 6\n6 * 2 = 12", "I just know it is 10"]]
    composer = RewardComposer({"grader": 1.0, "fapo": 1.0}, judge, failure_reward=-0.5)
    rewards = composer(problems, texts, [Grade(correct=True, extracted="10", reward=1.0, format_ok=True)] * 3)
    # sound (-1): 1 + 0; step 1 named: 1 - 1; garbage: 1 + the configured failure reward, counted
    assert rewards.tolist() == pytest.approx([1.0, 0.0, 0.5])
    metrics = composer.take()
    assert metrics["reward_term_fapo_failed"] == 1 and metrics["judge_failures_unparseable"] == 1
    assert "Step 1: 2 + 3 = 6\nStep 2: 6 * 2 = 12" in backend.prompts[1]  # the response split into numbered steps


def test_the_step_index_verdict_rejects_an_index_past_the_steps():
    judge = ModelJudge(ScriptedGenRM(lambda p: "\\boxed{3}"), verdict="step_index")
    verdicts = judge.flag([PointItem("q", "a = 1\nb = 2\nc = 3"), PointItem("q", "a = 1. b = 2.")])
    assert verdicts == [1.0, None]  # three lines: step 3 exists; two sentences: it does not
    assert judge.stats.take()["judge_failures_unparseable"] == 1


def test_split_steps_by_lines_then_sentences_without_old_numbers():
    assert split_steps("Step 1: 2 + 3 = 5\n\nStep 2: 5 * 2 = 10\n") == ["2 + 3 = 5", "5 * 2 = 10"]
    assert split_steps("First 2 + 3 = 5. Then 5 * 2 = 10! So 10.") == ["First 2 + 3 = 5.", "Then 5 * 2 = 10!", "So 10."]
    assert split_steps("") == []


def test_refusals_before_the_run():
    with pytest.raises(ConfigError, match="dataset=flaw_steps"):
        check_reward_matches_dataset("fapo_genrm", DatasetConfig(name="arith", loader="arith"))
    judge = JudgeConfig(kind="policy", verdict="step_index")
    with pytest.raises(ConfigError, match="pointwise"):
        check_reward_config(RewardConfig(name="math", terms={"brpo": 1.0}, judge=judge))
    check_reward_config(RewardConfig(name="math", terms={"grader": 1.0, "fapo": 1.0}, judge=judge))
