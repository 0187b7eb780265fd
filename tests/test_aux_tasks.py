"""Auxiliary tasks mixed into the batch (trainer.aux_tasks) and SPARK's judge tasks (arXiv:2509.22624;
docs/judges.md): labels derived exactly from the verifier, pairwise items only from mixed groups, the share
per step, reflection rewarded only when the revision verifies, the buffer's sampling (uniform or CodeRL+'s recent,
balanced or not) in closed form on scripted inserts, and bad settings refused. A resumed run equals an
uninterrupted one: tests/test_resume.py, STATEFUL_PRESETS['aux_tasks']."""

import numpy as np
import pytest
import torch
from conftest import compose_config

from rlbench.config.schema import AuxTasksConfig, RewardConfig, TrainerConfig
from rlbench.config.typed import rollout_config
from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError
from rlbench.reward import MathReward, grade_completions
from rlbench.reward.judge_tasks import (
    AUX_TASK_KEY,
    PAIRWISE_LABELS,
    POINTWISE_LABELS,
    build_judge_tasks,
    read_label,
)
from rlbench.rollout import GradedGroups
from rlbench.rollout.engines.base import Completion
from rlbench.training.aux_tasks import AuxTaskBuffer, check_aux_tasks, draw_tasks
from rlbench.training.curricula import Curriculum
from rlbench.validation import validate_config

ALL_KINDS = ["pointwise", "pairwise", "reflection"]
GRADER = MathReward()
# The reference answer is 12; which of these verify is known in closed form: 12, 24/2 and 12.0 do, 13 and none do not.
QUESTION = Problem(uid="q/0", prompt="What is 3 * 4?", answer="12", meta={"tolerance": 1e-9})
RESPONSES = {"3 * 4 = \\boxed{12}": True, "\\boxed{13}": False, "It is \\boxed{\\frac{24}{2}}": True,
             "no idea": False, "\\boxed{12.0}": True}


def completion(text: str) -> Completion:
    return Completion(request_index=0, prompt_ids=[1], text=text, response_ids=[1, 2], logprobs=[0.0, 0.0], finished=True)


def graded_group(problem: Problem, texts: list[str]) -> list:
    return grade_completions(GRADER, [problem] * len(texts), [completion(t) for t in texts])


def test_the_fixture_grades_as_stated():
    assert [g.correct for g in graded_group(QUESTION, list(RESPONSES))] == list(RESPONSES.values())


def test_pointwise_labels_are_the_verifiers_verdicts():
    texts = list(RESPONSES)
    tasks = build_judge_tasks(QUESTION, texts, graded_group(QUESTION, texts), ["pointwise"], len(texts),
                              np.random.default_rng(0))
    assert len(tasks) == len(texts)
    for task in tasks:
        shown = next(t for t in texts if f"Proposed solution:\n{t}\n" in task.prompt)
        assert task.answer == (POINTWISE_LABELS[0] if RESPONSES[shown] else POINTWISE_LABELS[1])
        assert task.meta[AUX_TASK_KEY] == "pointwise" and QUESTION.prompt in task.prompt


@pytest.mark.parametrize("texts", [["\\boxed{12}", "\\boxed{12.0}"], ["\\boxed{13}", "no idea"]])
def test_no_pairwise_item_from_a_group_that_is_all_correct_or_all_wrong(texts):
    tasks = build_judge_tasks(QUESTION, texts, graded_group(QUESTION, texts), ALL_KINDS, 3, np.random.default_rng(0))
    assert not [t for t in tasks if t.meta[AUX_TASK_KEY] == "pairwise"]
    reflections = [t for t in tasks if t.meta[AUX_TASK_KEY] == "reflection"]
    assert len(reflections) == (0 if "12" in texts[0] else 2)  # one per incorrect response, up to per_group


def test_pairwise_items_from_a_mixed_group_in_both_orders_point_at_the_correct_response():
    texts = ["\\boxed{13}", "3 * 4 = \\boxed{12}"]
    tasks = build_judge_tasks(QUESTION, texts, graded_group(QUESTION, texts), ["pairwise"], 1, np.random.default_rng(0))
    assert len(tasks) == 2
    firsts = []
    for task in tasks:
        first = task.prompt.split("Response 1:\n")[1].split("\n\nResponse 2:")[0]
        second = task.prompt.split("Response 2:\n")[1].split("\n\nExactly")[0]
        firsts.append(first)
        correct_one = first if task.answer == PAIRWISE_LABELS[0] else second
        assert RESPONSES[correct_one] and {first, second} == set(texts)
    assert sorted(firsts) == sorted(texts)  # both orderings


def test_judge_tasks_are_graded_by_their_label_and_reflection_by_the_verifier():
    texts = ["\\boxed{13}", "3 * 4 = \\boxed{12}"]
    tasks = build_judge_tasks(QUESTION, texts, graded_group(QUESTION, texts), ALL_KINDS, 1, np.random.default_rng(0))
    pointwise = next(t for t in tasks if t.meta[AUX_TASK_KEY] == "pointwise")
    reflection = next(t for t in tasks if t.meta[AUX_TASK_KEY] == "reflection")
    assert "\\boxed{13}" in reflection.prompt and reflection.answer == "12"  # only the incorrect answer is revised
    assert reflection.meta["tolerance"] == 1e-9  # graded as its source is
    wrong_label = POINTWISE_LABELS[1] if pointwise.answer == POINTWISE_LABELS[0] else POINTWISE_LABELS[0]
    answers = [f"\\boxed{{{pointwise.answer}}}", f"It is {wrong_label}.", "I cannot tell",
               "So the answer is \\boxed{12}", "\\boxed{13}", "\\boxed{24/2}"]
    problems = [pointwise] * 3 + [reflection] * 3
    grades = grade_completions(GRADER, problems, [completion(a) for a in answers])
    assert [g.reward for g in grades] == [1.0, 0.0, 0.0, 1.0, 0.0, 1.0]
    assert [g.format_ok for g in grades[:3]] == [True, True, False]  # no label: a failure, never a silent 1


def test_a_label_is_read_from_the_boxed_answer_first():
    assert read_label("yes, no wait: \\boxed{no}", POINTWISE_LABELS) == 1
    assert read_label("Response 2 is right", PAIRWISE_LABELS) == 1
    assert read_label("neither", PAIRWISE_LABELS) is None


def dataset(count: int) -> list[Problem]:
    return [Problem(uid=f"d/{i}", prompt=f"What is {i} + {i}?", answer=str(2 * i)) for i in range(count)]


def graded_steps(problems: list[Problem], texts_per_group: list[list[str]]) -> GradedGroups:
    groups = [[completion(t) for t in texts] for texts in texts_per_group]
    flat = [p for p, g in zip(problems, groups) for _ in g]
    grades = grade_completions(GRADER, flat, [c for g in groups for c in g])
    b = len(flat)
    return GradedGroups(list(problems), groups, grades, torch.zeros(b), torch.zeros(b), torch.ones(b, dtype=torch.bool),
                        list(range(len(groups))))


# round(share * B); 0.1 of 4 rounds to 0 but draws 1 (share > 0), 0.9 of 4 keeps one dataset prompt
@pytest.mark.parametrize("share, batch, expected", [(0.25, 8, 2), (0.3, 10, 3), (0.1, 4, 1), (0.9, 4, 3), (0.0, 4, 0)])
def test_the_share_holds_per_step_and_a_short_buffer_is_counted(share, batch, expected):
    trainer = TrainerConfig(prompts_per_step=batch, aux_tasks=AuxTasksConfig(share=share, kinds=["pointwise"], per_group=2))
    curriculum = Curriculum(trainer, seed=0, problems=dataset(40))
    first = curriculum.prompts(1, ctx=None)
    assert len(first) == batch and not [p for p in first if AUX_TASK_KEY in p.meta]  # the buffer starts empty
    assert curriculum.metrics()["aux_shortfall"] == expected
    # each dataset group answered right then wrong: two pointwise tasks per group
    curriculum.observe(1, graded_steps(first, [[f"\\boxed{{{p.answer}}}", "\\boxed{-1}"] for p in first]))
    for step in (2, 3):
        prompts = curriculum.prompts(step, ctx=None)
        aux = [p for p in prompts if AUX_TASK_KEY in p.meta]
        assert len(prompts) == batch and len(aux) == expected
        assert curriculum.metrics()["aux_shortfall"] == 0
        curriculum.observe(step, graded_steps(prompts, [["\\boxed{no}"] for _ in prompts]))
        # every task asked "yes or no" was answered no: right exactly for the incorrect responses' tasks
        said_no_rightly = [float(p.answer == "no") for p in aux]
        assert curriculum.metrics().get("aux_accuracy_pointwise") == (np.mean(said_no_rightly) if aux else None)
    assert curriculum.metrics()["aux_shortfall_total"] == expected  # step 1's alone


def test_a_buffer_shorter_than_the_share_gives_what_it_has():
    trainer = TrainerConfig(prompts_per_step=8, aux_tasks=AuxTasksConfig(share=0.5, kinds=["reflection"]))
    curriculum = Curriculum(trainer, seed=0, problems=dataset(40))
    first = curriculum.prompts(1, ctx=None)
    wrong_once = [["\\boxed{-1}"]] + [[f"\\boxed{{{p.answer}}}"] for p in first[1:]]  # one incorrect response: one task
    curriculum.observe(1, graded_steps(first, wrong_once))
    second = curriculum.prompts(2, ctx=None)
    assert len(second) == 8 and sum(AUX_TASK_KEY in p.meta for p in second) == 1
    assert curriculum.metrics()["aux_shortfall"] == 3 and curriculum.metrics()["aux_shortfall_total"] == 4 + 3


@pytest.mark.parametrize("setting, message", [
    ({"share": -0.1}, "share"), ({"share": 1.0}, "share"), ({"kinds": ["pointwise", "critique"]}, "kinds"),
    ({"kinds": []}, "kinds"), ({"kinds": ["execution"]}, "execution.*reward=code"),
    ({"kinds": ["pointwise", "pairwise"], "balance": True}, "balance"),
])
def test_bad_settings_are_refused(setting, message):
    with pytest.raises(ConfigError, match=message):
        check_aux_tasks(TrainerConfig(aux_tasks=AuxTasksConfig(**setting)), rollout_config({"strategy": "iid"}),
                        RewardConfig(name="math"))


def test_a_bad_share_is_refused_by_validation_before_the_model_loads(tmp_path):
    cfg = compose_config(["experiment=smoke", "+trainer.aux_tasks.share=1.5"], tmp_path)
    with pytest.raises(ConfigError, match="trainer.aux_tasks.share"):
        validate_config(cfg)


def test_paper_spark_composes_with_its_aux_tasks(tmp_path):
    cfg = compose_config(["paper=spark", "experiment=smoke"], tmp_path)
    validate_config(cfg)
    assert cfg.trainer.aux_tasks.share == 0.25 and list(cfg.trainer.aux_tasks.kinds) == ALL_KINDS


# ---- the buffer's draw: positions oldest first; T = a task built from a verified-correct response
CORRECT = [True, True, False, True, False, False, False, True]  # C = {0, 1, 3, 7}, W = {2, 4, 5, 6}


MOSTLY_RIGHT = [True, True, False, True, True]  # C = {0, 1, 3, 4}, W = {2}


@pytest.mark.parametrize("newest, wanted, sampling, balance, pool, right_count", [
    (8, 4, "uniform", False, range(8), None),
    (3, 2, "recent", False, [5, 6, 7], None),    # the newest build (3 tasks) holds enough: drawn from it
    (1, 3, "recent", False, [5, 6, 7], None),    # it holds 1 < 3: the newest 3, all of them
    (3, 10, "recent", False, range(8), None),    # more wanted than held: the whole buffer
    (8, 4, "uniform", True, range(8), 2),        # half each: c = min(max(4 // 2, 4 - 4), 4) = 2
    (8, 7, "uniform", True, range(8), 3),        # c = min(max(7 // 2, 7 - 4), 4) = 3, 4 incorrect
    (4, 3, "recent", True, [4, 5, 6, 7], 1),     # pool {4..7}: C = {7}, W = {4, 5, 6}; c = min(max(1, 0), 1) = 1
    (4, 4, "recent", True, [4, 5, 6, 7], 1),     # c = min(max(2, 4 - 3), 1) = 1: the incorrect side fills the gap
    (5, 4, "uniform", True, range(5), 3),        # MOSTLY_RIGHT: c = min(max(2, 4 - 1), 4) = 3: the correct side fills
])
def test_the_draw_in_closed_form(newest, wanted, sampling, balance, pool, right_count):
    correct = MOSTLY_RIGHT if newest == 5 else CORRECT
    for seed in range(20):
        picks = draw_tasks(correct, newest, wanted, sampling, balance, np.random.default_rng(seed))
        assert len(picks) == len(set(picks)) == min(wanted, len(correct)) and set(picks) <= set(pool)
        assert picks == sorted(picks)
        if right_count is not None:
            assert sum(correct[i] for i in picks) == right_count
    if len(pool) == min(wanted, len(correct)):
        assert picks == list(pool)


def pointwise_build(uid: str, verdicts: list[bool]) -> GradedGroups:
    """One group whose responses are right (\\boxed{12}) or wrong (\\boxed{13}) as ``verdicts`` say."""
    return graded_steps([Problem(uid=uid, prompt="What is 3 * 4?", answer="12")],
                        [["\\boxed{12}" if v else "\\boxed{13}" for v in verdicts]])


def test_the_recent_balanced_buffer_on_scripted_inserts():
    """capacity 5, recent, balanced; pointwise tasks (one per response, all of a group: per_group 4)."""
    buffer = AuxTaskBuffer(AuxTasksConfig(kinds=["pointwise"], per_group=4, capacity=5, sampling="recent", balance=True), seed=0)
    buffer.add(pointwise_build("a", [True, False, False]))
    assert [t.uid[-3:] for t in buffer.tasks] == ["a/0", "a/1", "a/2"] and buffer.newest == 3
    for _ in range(10):  # 2 of the newest 3: the correct a/0 and one incorrect; drawn tasks stay
        drawn = [t.uid[-3:] for t in buffer.take(2)]
        assert drawn[0] == "a/0" and drawn[1] in ("a/1", "a/2") and len(buffer.tasks) == 3
    buffer.add(pointwise_build("b", [False, True, True, False]))  # 7 built, capacity 5: a/0 and a/1 leave
    assert [t.uid[-3:] for t in buffer.tasks] == ["a/2", "b/0", "b/1", "b/2", "b/3"] and buffer.newest == 4
    for _ in range(10):  # from b's 4 tasks: one of b/1, b/2 (correct) and one of b/0, b/3
        drawn = [t.uid[-3:] for t in buffer.take(2)]
        assert len(set(drawn) & {"b/1", "b/2"}) == 1 and len(set(drawn) & {"b/0", "b/3"}) == 1
    assert [t.uid[-3:] for t in buffer.take(5)] == ["a/2", "b/0", "b/1", "b/2", "b/3"]  # 4 < 5: the newest 5
    buffer.add(pointwise_build("c", []))  # a step that builds nothing keeps the newest build
    assert buffer.newest == 4 and buffer.metrics()["aux_shortfall_total"] == 0
    restored = AuxTaskBuffer(buffer.options, seed=1)
    restored.load_state_dict(buffer.state_dict())
    assert restored.newest == 4 and [t.uid for t in restored.take(2)] == [t.uid for t in buffer.take(2)]


def test_the_uniform_buffer_hands_each_task_out_once():
    buffer = AuxTaskBuffer(AuxTasksConfig(kinds=["pointwise"], per_group=4), seed=0)
    buffer.add(pointwise_build("a", [True, False, False, True]))
    drawn = buffer.take(3) + buffer.take(3)
    assert sorted(t.uid for t in drawn) == [f"aux/pointwise/a/{i}" for i in range(4)] and not buffer.tasks
    assert buffer.metrics()["aux_shortfall_total"] == 2
