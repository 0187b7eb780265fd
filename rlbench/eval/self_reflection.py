"""SPARK's test-time self-reflection (``eval.self_reflection``): Liu et al. 2025, "SPARK: Synergistic Policy And
Reward Co-Evolving Framework", arXiv:2509.22624 (figure 2b: at test time the one model reasons, judges its answer
and reflects; the authors' evaluation of SPARK-VL-7B, Evaluation/evaluation_tts.py of their release, runs this
loop with at most 2 revisions).

Sample y_0 of a problem x is posed to the same policy as training's pointwise judge task
(:func:`rlbench.reward.judge_tasks.pointwise_tasks`, answered and read as :func:`rlbench.eval.judge_accuracy.pose`
does). A verdict of ``yes`` keeps y_0; any other (``no``, or none readable) asks the policy training's reflection
task on it (:func:`rlbench.reward.judge_tasks.reflection_tasks`: x, the attempt, and the verdict that its final
answer is incorrect), and the revision y_1 takes its place. y_1 is judged in turn, for at most R rounds
(``eval.reflection_rounds``); the last answer y_final is the sample, graded and counted in pass@k. Over the N
samples of a benchmark, with c(y) the verifier's grade:

    reflection_revised        = #{i: y_final,i != y_0,i} / N         (revised at least once)
    reflection_revisions      = the revisions asked for, all rounds
    reflection_wrong_to_right = #{i: c(y_0,i) = 0, c(y_final,i) = 1}
    reflection_right_to_wrong = #{i: c(y_0,i) = 1, c(y_final,i) = 0}

Every call draws from its own stream (:func:`rlbench.eval.streams.problem_seed` of the benchmark, the round and
the sample), so the evaluations before and after training draw the same numbers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from rlbench.dataset.base import Problem
from rlbench.eval.judge_accuracy import pose
from rlbench.eval.streams import problem_seed
from rlbench.prompting import encode_prompts
from rlbench.reward import grade_completions
from rlbench.reward.judge_tasks import POINTWISE_LABELS, pointwise_tasks, reflection_tasks
from rlbench.reward.math import Grade
from rlbench.rollout.engines.base import Completion, GenerationRequest, RolloutEngine, SamplingParams

REFLECTION_COLUMNS = ("reflection_revised", "reflection_revisions", "reflection_wrong_to_right", "reflection_right_to_wrong")


def self_reflect(engine: RolloutEngine, tokenizer: Any, bench: Any, problems: Sequence[Problem],
                 groups: list[list[Completion]], params: SamplingParams, seed: int, rounds: int
                 ) -> tuple[list[list[Completion]], list[Grade], list[dict[str, Any]]]:
    """The judge-then-revise loop on each sample of ``groups`` (``groups[j]``: the samples of ``problems[j]``,
    a :class:`rlbench.eval.evaluate.Benchmark`'s, in its prompt template), at most ``rounds`` rounds. Returns
    the final samples, their grades by the benchmark's grader (flat, in order) and a record per sample: the
    first answer's grade, each round's verdict (a label, or None), the revisions and the first answer's text."""
    groups = [list(g) for g in groups]
    owner = [(j, k) for j, g in enumerate(groups) for k in range(len(g))]
    grades = grade_completions(bench.grader, [problems[j] for j, _ in owner], [groups[j][k] for j, k in owner])
    records = [{"initial_correct": bool(g.correct), "initial": groups[j][k].text, "verdicts": [], "revisions": 0}
               for (j, k), g in zip(owner, grades)]
    flat = {jk: i for i, jk in enumerate(owner)}
    spec = bench.spec["prompt"]
    open_ = list(owner)  # the samples still judged: all at first, then those just revised
    for r in range(rounds):
        picks: dict[int, list[int]] = {}
        for j, k in open_:
            picks.setdefault(j, []).append(k)
        judged = f"{bench.name}/reflection{r}"
        tasks = [(judged, task) for j, ks in picks.items()
                 for task in pointwise_tasks(problems[j], [c.text for c in groups[j]],
                                             [grades[flat[j, k]].correct for k in range(len(groups[j]))], ks)]
        verdicts = pose(engine, tokenizer, {judged: spec}, tasks, params, seed)
        wrong: dict[int, list[int]] = {}
        for (j, k), record in zip([(j, k) for j, ks in picks.items() for k in ks], verdicts):
            records[flat[j, k]]["verdicts"].append(record["verdict"])
            if record["verdict"] != POINTWISE_LABELS[0]:  # anything but "yes" is revised, as the authors' loop does
                wrong.setdefault(j, []).append(k)
        if not wrong:
            break
        revise = [(j, task) for j, ks in wrong.items() for task in reflection_tasks(problems[j], [c.text for c in groups[j]], ks)]
        prompt_ids = encode_prompts(tokenizer, [task for _, task in revise], spec)
        requests = [GenerationRequest(prompt_ids=ids, n=1, seed=problem_seed(seed, f"{bench.name}/revision{r}", task.uid))
                    for ids, (_, task) in zip(prompt_ids, revise)]
        revisions = [group[0] for group in engine.generate(requests, params)]
        open_ = [(j, k) for j, ks in wrong.items() for k in ks]
        for (j, k), revision in zip(open_, revisions):
            groups[j][k] = revision
            records[flat[j, k]]["revisions"] += 1
        regraded = grade_completions(bench.grader, [problems[j] for j, _ in open_], revisions)  # against x, not the task
        for (j, k), grade in zip(open_, regraded):
            grades[flat[j, k]] = grade
    return groups, grades, records


def reflection_figures(samples: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """The module's figures over ``samples`` (each with its ``reflection`` record and final ``correct``)."""
    own = [s for s in samples if "reflection" in s]
    return {
        "reflection_revised": sum(s["reflection"]["revisions"] > 0 for s in own) / len(own) if own else math.nan,
        "reflection_revisions": sum(s["reflection"]["revisions"] for s in own),
        "reflection_wrong_to_right": sum(not s["reflection"]["initial_correct"] and bool(s["correct"]) for s in own),
        "reflection_right_to_wrong": sum(s["reflection"]["initial_correct"] and not s["correct"] for s in own),
    }
