"""Reward functions: score a completion against a reference answer."""

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


__all__ = ["grade_completions", "Grade", "MathReward", "answers_equivalent", "canonical_answer", "extract_answer"]
