"""Reward functions: score a completion against a reference answer."""

from rlbench.reward.judge_tasks import grade_judge_task, is_judge_task
from rlbench.reward.math import (
    Grade,
    MathReward,
    answers_equivalent,
    canonical_answer,
    extract_answer,
)


def grade_completions(grader, problems, completions) -> list[Grade]:
    """One Grade per completion; ``problems[i]`` is the problem ``completions[i]`` answers.

    Graders with a batch path (``grade_many``, e.g. the sandboxed code grader, which runs programs
    in parallel) get the whole batch; the others are called once per completion with the
    reference answer and the response token ids. The math grader also learns whether the response
    was cut at the token limit, the problem's own tolerance (``Problem.meta["tolerance"]``) and its
    statement (a request for an ordered list, ``rlbench.reward.math.asks_for_order``).
    """
    if len(problems) != len(completions):
        raise ValueError(f"{len(completions)} completions but {len(problems)} problems")
    judged = [i for i, p in enumerate(problems) if is_judge_task(p)]
    if judged:  # SPARK's judge tasks (auxiliary tasks) are graded by their label, the rest by the grader
        return grade_mixed(grader, problems, completions, set(judged))
    return grade_by_grader(grader, problems, completions)


def grade_mixed(grader, problems, completions, judged: set[int]) -> list[Grade]:
    """Judge tasks (indices ``judged``) graded by their label at the grader's correct / incorrect rewards
    (rlbench.reward.judge_tasks), the other completions by the grader, in their order."""
    rewards = {"correct_reward": getattr(grader, "correct_reward", 1.0), "incorrect_reward": getattr(grader, "incorrect_reward", 0.0)}
    rest = [i for i in range(len(problems)) if i not in judged]
    graded = dict(zip(rest, grade_by_grader(grader, [problems[i] for i in rest], [completions[i] for i in rest]) if rest else []))
    for i in judged:
        graded[i] = grade_judge_task(completions[i].text, problems[i], **rewards)
    return [graded[i] for i in range(len(problems))]


def grade_by_grader(grader, problems, completions) -> list[Grade]:
    if hasattr(grader, "grade_many"):
        return grader.grade_many([c.text for c in completions], list(problems))
    if isinstance(grader, MathReward):
        return [
            grader(
                c.text,
                p.answer,
                c.response_ids,
                finished=c.finished,
                tolerance=p.meta.get("tolerance"),
                problem=getattr(p, "prompt", None),
            )
            for p, c in zip(problems, completions)
        ]
    return [grader(c.text, p.answer, c.response_ids) for p, c in zip(problems, completions)]


__all__ = ["Grade", "MathReward", "answers_equivalent", "canonical_answer", "extract_answer", "grade_completions"]
