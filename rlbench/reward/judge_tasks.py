"""SPARK's judge tasks (Liu et al. 2025, "SPARK: Synergistic Policy And Reward Co-Evolving Framework",
arXiv:2509.22624, section 3): a finished step's verified rollouts recycled into verifiable tasks for the same
model, and their grading rule.

* ``pointwise``: "is this answer correct? yes / no"; the label is the verifier's verdict on the response.
* ``pairwise``: two responses to one question, exactly one of them correct (built only from a *mixed* group:
  one correct and one incorrect response), "which is correct? 1 / 2"; both orderings are built.
* ``reflection``: an incorrect response shown with the question and the verdict that its final answer is
  incorrect, "revise it"; graded by the run's own grader against the problem's reference answer, so it is rewarded
  only if the revised answer verifies. In training the verdict is the verifier's; at test time
  (``eval.self_reflection``, rlbench/eval/self_reflection.py) the same prompt follows the model's own "no" as the
  pointwise judge, as in the authors' release, which shows no judge critique either.
* ``eis_pairwise``: EIS-GRPO's judge task (Xu et al. 2025, "J4R: Learning to Judge with Equivalent Initial State
  Group Relative Policy Optimization", arXiv:2505.13346, section 3): the pairwise question as ONE task whose two
  orderings are its equivalent initial states (``meta["equivalent_forms"]``, each a prompt and its label: the
  label maps through the swap, "1" in one order is "2" in the other). ``rollout=equivalent_states`` samples
  ``n / 2`` responses under each ordering into one group, so a judge that answers by position scores 1 in one
  half and 0 in the other, and the group-relative advantage trains that bias away.

A task is a :class:`~rlbench.dataset.base.Problem` whose ``meta["aux_task"]`` names its kind; a judge task's
``answer`` is its expected label and ``meta["labels"]`` the two labels; a task built from one response (pointwise,
reflection, execution) keeps that response's verdict in ``meta["source_correct"]`` (the buffer's balance). :func:`grade_judge_task` reads the
label of a response (the content of its last ``\\boxed{}`` when it has one, else the first label word,
:func:`rlbench.reward.judges.parse_label`). The run's grader grades a reflection task as any problem.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from rlbench.dataset.base import Problem
from rlbench.reward.execution_tasks import (
    EXECUTION_KIND,
    SOURCE_CORRECT_KEY,
    build_execution_tasks,
    grade_execution_task,
)
from rlbench.reward.judges import parse_label
from rlbench.reward.math import Grade, extract_answer

AUX_TASK_KEY = "aux_task"  # Problem.meta key naming an auxiliary task's kind
AUX_TASK_KINDS = ("pointwise", "pairwise", "reflection", "eis_pairwise", EXECUTION_KIND)
# graded by their own rule (a label; execution: CodeRL+'s partial credit); reflection by the run's grader
JUDGE_TASK_KINDS = ("pointwise", "pairwise", "eis_pairwise", EXECUTION_KIND)
EQUIVALENT_FORMS_KEY = "equivalent_forms"  # Problem.meta key: the task's equivalent states, [{"prompt", "answer"}, ...]
POINTWISE_LABELS = ("yes", "no")  # the response is correct / incorrect
PAIRWISE_LABELS = ("1", "2")  # the first / the second response is the correct one

POINTWISE_TASK = ("Question:\n{question}\n\nProposed solution:\n{response}\n\n"
                  "Is the proposed solution's final answer correct? Answer yes or no.")
PAIRWISE_TASK = ("Question:\n{question}\n\nResponse 1:\n{first}\n\nResponse 2:\n{second}\n\n"
                 "Exactly one of the two responses has the correct final answer. Which one? Answer 1 or 2.")
REFLECTION_TASK = ("Question:\n{question}\n\nA previous attempt:\n{response}\n\n"
                   "The previous attempt's final answer is incorrect. Find the mistake and solve the question again.")


def is_aux_task(problem: Problem) -> bool:
    return AUX_TASK_KEY in problem.meta


def is_judge_task(problem: Problem) -> bool:
    """A task graded by its label (pointwise, pairwise), not by the run's grader (anything without a ``meta``,
    such as a reference-only record, is not)."""
    return (getattr(problem, "meta", None) or {}).get(AUX_TASK_KEY) in JUDGE_TASK_KINDS


def read_label(text: str, labels: Sequence[str]) -> int | None:
    """The index of the label a response gives: its last ``\\boxed{}``'s content when it has one, else the
    first label word in the text; None when neither names exactly one label."""
    boxed = extract_answer(text, "boxed")
    return parse_label(boxed if boxed is not None else text, labels)


def grade_judge_task(text: str, problem: Problem, correct_reward: float = 1.0, incorrect_reward: float = 0.0) -> Grade:
    """A pointwise or pairwise task's grade: correct when the response's label is the expected one (an execution
    task: CodeRL+'s partial credit, rlbench.reward.execution_tasks)."""
    if problem.meta.get(AUX_TASK_KEY) == EXECUTION_KIND:
        return grade_execution_task(text, problem)
    labels = problem.meta["labels"]
    index = read_label(text, labels)
    extracted = None if index is None else labels[index]
    correct = extracted == problem.answer
    return Grade(correct=correct, extracted=extracted, reward=correct_reward if correct else incorrect_reward,
                 format_ok=index is not None)


def _task(source: Problem, kind: str, key: str, prompt: str, answer: str, **meta: Any) -> Problem:
    # the source's meta rides along: a reflection task is graded as its source is (a tolerance, a code problem's tests)
    return Problem(uid=f"aux/{kind}/{source.uid}/{key}", prompt=prompt, answer=answer,
                   meta={**source.meta, AUX_TASK_KEY: kind, "source_uid": source.uid, **meta})


def pointwise_tasks(problem: Problem, texts: Sequence[str], correct: Sequence[bool], picks: Sequence[int]) -> list[Problem]:
    """"Is response i correct?" for each i in ``picks``; the label is the verifier's verdict ``correct[i]``."""
    return [_task(problem, "pointwise", f"{i}", POINTWISE_TASK.format(question=problem.prompt, response=texts[i]),
                  POINTWISE_LABELS[0] if correct[i] else POINTWISE_LABELS[1], labels=list(POINTWISE_LABELS),
                  **{SOURCE_CORRECT_KEY: bool(correct[i])})
            for i in picks]


def pairwise_tasks(problem: Problem, texts: Sequence[str], right: int, wrong: int) -> list[Problem]:
    """Response ``right`` (correct) against ``wrong`` (incorrect), in both orderings."""
    def ordered(first: int, second: int) -> Problem:
        label = PAIRWISE_LABELS[0] if first == right else PAIRWISE_LABELS[1]
        return _task(problem, "pairwise", f"{first}-{second}",
                     PAIRWISE_TASK.format(question=problem.prompt, first=texts[first], second=texts[second]),
                     label, labels=list(PAIRWISE_LABELS))
    return [ordered(right, wrong), ordered(wrong, right)]


def eis_pairwise_task(problem: Problem, texts: Sequence[str], right: int, wrong: int) -> Problem:
    """Response ``right`` (correct) against ``wrong`` (incorrect) as one task with both orderings as its
    equivalent forms, each with its own label; the task itself reads as the first ordering."""
    first, second = pairwise_tasks(problem, texts, right, wrong)
    forms = [{"prompt": t.prompt, "answer": t.answer} for t in (first, second)]
    return _task(problem, "eis_pairwise", f"{right}-{wrong}", first.prompt, first.answer,
                 labels=list(PAIRWISE_LABELS), **{EQUIVALENT_FORMS_KEY: forms})


def equivalent_forms(problem: Problem) -> list[Problem] | None:
    """The problem in each of its own equivalent forms (``meta["equivalent_forms"]``: its prompt and answer
    replaced, the rest kept), or None when it has none."""
    forms = (getattr(problem, "meta", None) or {}).get(EQUIVALENT_FORMS_KEY)
    if not forms:
        return None
    return [dataclasses.replace(problem, prompt=f["prompt"], answer=f["answer"]) for f in forms]


def reflection_tasks(problem: Problem, texts: Sequence[str], picks: Sequence[int]) -> list[Problem]:
    """"Revise this incorrect attempt" for each incorrect response in ``picks``; the answer is the problem's."""
    return [_task(problem, "reflection", f"{i}", REFLECTION_TASK.format(question=problem.prompt, response=texts[i]),
                  problem.answer, **{SOURCE_CORRECT_KEY: False}) for i in picks]


def build_judge_tasks(problem: Problem, texts: Sequence[str], grades: Sequence[Grade], kinds: Sequence[str],
                      per_group: int, rng: np.random.Generator, sandbox_limits: Any = None) -> list[Problem]:
    """SPARK's tasks from one graded group (``texts[i]`` graded ``grades[i]`` by the verifier): for each kind
    in ``kinds``, up to ``per_group`` items, the responses drawn by ``rng`` (pairwise: ``per_group`` pairs of a
    correct and an incorrect response, each in both orderings; none from a group that is all correct or all
    incorrect; eis_pairwise: the same pairs, each one task with both orderings as its forms; reflection: incorrect
    responses only; execution: programs of a code problem, correct or not, traced in the sandbox with
    ``sandbox_limits``, rlbench.reward.execution_tasks). An auxiliary task's own group gives none."""
    if is_aux_task(problem):
        return []
    correct = [bool(g.correct) for g in grades]
    right = [i for i, c in enumerate(correct) if c]
    wrong = [i for i, c in enumerate(correct) if not c]

    def pick(pool: list[int]) -> list[int]:
        return sorted(rng.choice(pool, size=min(per_group, len(pool)), replace=False).tolist()) if pool else []

    tasks: list[Problem] = []
    for kind in kinds:
        if kind == "pointwise":
            tasks += pointwise_tasks(problem, texts, correct, pick(list(range(len(texts)))))
        elif kind == "pairwise" and right and wrong:
            for _ in range(per_group):
                tasks += pairwise_tasks(problem, texts, int(rng.choice(right)), int(rng.choice(wrong)))
        elif kind == "eis_pairwise" and right and wrong:
            tasks += [eis_pairwise_task(problem, texts, int(rng.choice(right)), int(rng.choice(wrong))) for _ in range(per_group)]
        elif kind == "reflection":
            tasks += reflection_tasks(problem, texts, pick(wrong))
        elif kind == EXECUTION_KIND and problem.meta.get("tests") and sandbox_limits is not None:
            tasks += build_execution_tasks(problem, texts, pick(list(range(len(texts)))), sandbox_limits, correct=correct,
                                           **{AUX_TASK_KEY: EXECUTION_KIND})
    return tasks
