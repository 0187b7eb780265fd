"""EIS-GRPO's judge task (arXiv:2505.13346, section 3; rlbench/reward/judge_tasks.py, kind ``eis_pairwise``):
a pairwise question is one task whose two orderings are its equivalent initial states; rollout=equivalent_states
samples both into one group, and each response is graded against its own ordering's label (the label maps
through the swap)."""

import dataclasses

import numpy as np
import pytest
import torch
from conftest import CharTokenizer, compose_config, smoke_cli_steps

from rlbench.algorithm.advantages import grpo_advantage
from rlbench.config.schema import AuxTasksConfig
from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError
from rlbench.reward import MathReward, grade_completions
from rlbench.reward.judge_tasks import (
    AUX_TASK_KEY,
    EQUIVALENT_FORMS_KEY,
    build_judge_tasks,
    eis_pairwise_task,
    equivalent_forms,
)
from rlbench.rollout import GroupSampler, RolloutSetup
from rlbench.rollout.engines.base import Completion, SamplingParams
from rlbench.rollout.strategies.equivalent_states import EquivalentStatesRollout
from rlbench.training.aux_tasks import AuxTaskBuffer
from rlbench.training.batch import collate
from rlbench.validation import validate_config

GRADER = MathReward()
QUESTION = Problem(uid="q/0", prompt="What is 3 * 4?", answer="12")
TEXTS = ["so \\boxed{13}", "3 * 4 = \\boxed{12}"]  # response 1 is the correct one
RIGHT, WRONG = 1, 0


def task() -> Problem:
    return eis_pairwise_task(QUESTION, TEXTS, RIGHT, WRONG)


def test_the_two_orderings_are_the_forms_and_the_label_follows_the_correct_response():
    first, second = equivalent_forms(task())
    assert first.prompt.index(TEXTS[RIGHT]) < first.prompt.index(TEXTS[WRONG]) and first.answer == "1"
    assert second.prompt.index(TEXTS[WRONG]) < second.prompt.index(TEXTS[RIGHT]) and second.answer == "2"
    assert task().prompt == first.prompt and task().answer == first.answer and task().meta[AUX_TASK_KEY] == "eis_pairwise"
    assert equivalent_forms(QUESTION) is None


def test_one_task_per_pair_and_only_from_mixed_groups():
    grades = grade_completions(GRADER, [QUESTION] * 2, [completion(t) for t in TEXTS])
    tasks = build_judge_tasks(QUESTION, TEXTS, grades, ["eis_pairwise"], 2, np.random.default_rng(0))
    assert len(tasks) == 2 and all(len(t.meta[EQUIVALENT_FORMS_KEY]) == 2 for t in tasks)
    both_right = grade_completions(GRADER, [QUESTION] * 2, [completion(TEXTS[RIGHT])] * 2)
    assert build_judge_tasks(QUESTION, [TEXTS[RIGHT]] * 2, both_right, ["eis_pairwise"], 2, np.random.default_rng(0)) == []


def completion(text):
    return Completion(request_index=0, prompt_ids=[1], text=text, response_ids=[1], logprobs=[0.0], finished=True)


class Judge:
    """A scripted judge: ``by_position`` always answers 1; otherwise it names the response that holds ``12``."""

    def __init__(self, by_position: bool):
        self.by_position = by_position

    def generate(self, requests, params, generator=None):
        def answer(prompt_ids):
            prompt = "".join(map(chr, prompt_ids))
            if "Response 1" not in prompt:
                return "\\boxed{12}"  # a dataset problem
            label = "1" if self.by_position or prompt.index("{12}") < prompt.index("{13}") else "2"
            return f"\\boxed{{{label}}}"
        def sample(i, prompt_ids):
            text = answer(prompt_ids)
            return Completion(i, prompt_ids, [ord(c) for c in text], [0.0] * len(text), True, text=text)
        return [[sample(i, r.prompt_ids) for _ in range(r.n)] for i, r in enumerate(requests)]


def rollout(by_position: bool, problems, n=4):
    sampler = GroupSampler(Judge(by_position), GRADER, CharTokenizer(), {"system": None, "user": "{problem}"}, lambda r, _: r)
    return EquivalentStatesRollout(RolloutSetup(sampler, n, SamplingParams(1.0, 1.0, 8), None), ["", "Note. "]).rollout(problems)


def test_both_orderings_share_one_group_and_a_position_bias_is_what_the_advantage_trains_away():
    biased, metrics = rollout(True, [task()])
    assert biased.group_ids == [0] and len(biased.groups[0]) == 4
    assert collate(biased.groups, pad_token_id=0).group_index.tolist() == [0, 0, 0, 0]
    # always "1": right under the first ordering (label 1), wrong under the swapped one (label 2)
    assert biased.rewards.tolist() == [1.0, 1.0, 0.0, 0.0] and metrics["equivalent_states_reward_gap"] == 1.0
    advantages = grpo_advantage(biased.rewards, torch.zeros(4, dtype=torch.long), torch.ones(4, 1))[:, 0]
    assert (advantages[:2] > 0).all() and (advantages[2:] < 0).all()
    # a judge that reads the responses is right under both orderings: nothing to correct
    reading, metrics = rollout(False, [task()])
    assert reading.rewards.tolist() == [1.0] * 4 and metrics["equivalent_states_reward_gap"] == 0.0


def test_a_dataset_problem_in_the_same_batch_keeps_its_prefix_states():
    graded, _ = rollout(True, [QUESTION, task()])
    question_prompts = {"".join(map(chr, c.prompt_ids)) for c in graded.groups[0]}
    assert question_prompts == {QUESTION.prompt, "Note. " + QUESTION.prompt}
    task_prompts = ["".join(map(chr, c.prompt_ids)) for c in graded.groups[1]]
    assert task_prompts == [f.prompt for f in equivalent_forms(task()) for _ in range(2)]
    assert graded.rewards.tolist() == [1.0] * 4 + [1.0, 1.0, 0.0, 0.0]


def test_forms_that_disagree_with_the_run_states_are_refused():
    three = dataclasses.replace(task(), meta={**task().meta, EQUIVALENT_FORMS_KEY: task().meta[EQUIVALENT_FORMS_KEY] * 2})
    with pytest.raises(ValueError, match="4 equivalent forms of its own.*2 states"):
        rollout(True, [three])


def test_the_forms_survive_the_buffer_checkpoint():
    buffer = AuxTaskBuffer(AuxTasksConfig(kinds=["eis_pairwise"]), seed=0)
    buffer.tasks.append(task())
    restored = AuxTaskBuffer(AuxTasksConfig(kinds=["eis_pairwise"]), seed=0)
    restored.load_state_dict(buffer.state_dict())
    assert equivalent_forms(restored.tasks[0]) == equivalent_forms(task())


def test_the_kind_needs_two_equivalent_states(tmp_path):
    kinds = "+trainer.aux_tasks.kinds=[eis_pairwise]"
    with pytest.raises(ConfigError, match="eis_pairwise.*rollout=equivalent_states with two prefixes"):
        validate_config(compose_config(["experiment=smoke", kinds], tmp_path / "iid"))
    validate_config(compose_config(["experiment=smoke", kinds, "rollout=equivalent_states", "rollout.n=4"], tmp_path / "eis"))


@pytest.mark.slow
def test_cli_run_mixes_eis_judge_tasks(tmp_path):
    steps = smoke_cli_steps(tmp_path / "run", "rollout=equivalent_states", "rollout.n=4", "trainer.steps=3",
                            "+trainer.aux_tasks.share=0.5", "+trainer.aux_tasks.kinds=[eis_pairwise]")
    assert sum(s.get("aux_built", 0) for s in steps) > 0 and "equivalent_states_reward_gap" in steps[-1]
