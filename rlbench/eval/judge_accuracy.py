"""SPARK's judge accuracy on held-out rollouts (``eval.judge_accuracy``): Liu et al. 2025, "SPARK: Synergistic
Policy And Reward Co-Evolving Framework", arXiv:2509.22624, section 3, train the policy as its own pointwise
judge; this measures that judge on the evaluation's own samples, before and after training.

Each sample of the evaluation (a held-out problem, the policy's response, the verifier's grade of it) becomes
the pointwise judge task training builds (:func:`rlbench.reward.judge_tasks.pointwise_tasks`: its template, and
its label, ``yes`` when the verifier graded the response correct, else ``no``). The same policy answers it once,
in the benchmark's prompt template, with the evaluation's sampling settings and a stream of its own per task
(:func:`rlbench.eval.streams.problem_seed`, so before and after training draw the same numbers), and the answer
is graded as training grades it (:func:`rlbench.reward.grade_completions`: the last ``\\boxed{}``'s label, else
the first label word). With y_i the verifier's verdict on response i and v_i the judge's (yes / no / none when
no label can be read):

    judge_accuracy            = #{i: v_i = y_i} / N                 (an unreadable verdict counts as wrong)
    judge_accuracy_on_correct = #{i: y_i = yes, v_i = yes} / #{i: y_i = yes}
    judge_accuracy_on_incorrect = #{i: y_i = no, v_i = no} / #{i: y_i = no}
    judge_balanced_accuracy   = (judge_accuracy_on_correct + judge_accuracy_on_incorrect) / 2

The classes are unbalanced (a weak policy's responses are mostly wrong, and "no" to everything then scores its
error rate), hence the balanced figure; a class without responses makes its accuracy, and the balanced one, NaN.

The pairwise task ("which of the two is correct? 1 / 2") is posed in each problem whose samples are mixed, for
its first correct and first incorrect sample, in both orderings (so a judge that always names the same position
scores 0.5): ``judge_pairwise_accuracy`` is the share answered right, an unreadable verdict counting as wrong.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from rlbench.dataset.base import Problem
from rlbench.eval.streams import problem_seed
from rlbench.eval.metrics import MACRO_AVERAGE
from rlbench.prompting import encode_prompts
from rlbench.reward import grade_completions
from rlbench.reward.judge_tasks import POINTWISE_LABELS, pairwise_tasks, pointwise_tasks
from rlbench.rollout.engines.base import GenerationRequest, RolloutEngine, SamplingParams

RATES = ("judge_accuracy", "judge_balanced_accuracy", "judge_accuracy_on_correct", "judge_accuracy_on_incorrect",
         "judge_pairwise_accuracy")
COUNTS = ("judge_judged", "judge_unparsed", "judge_pairwise_judged", "judge_pairwise_unparsed")
JUDGE_COLUMNS = RATES + COUNTS  # the columns a result row gets with eval.judge_accuracy=true


def judge_figures(labels: Sequence[bool], verdicts: Sequence[bool | None]) -> dict[str, float]:
    """The module's figures from the verifier's verdicts ``labels`` (True: correct) and the judge's ``verdicts``
    (True: yes, False: no, None: unreadable, counted in ``judge_unparsed`` and never right)."""
    if len(labels) != len(verdicts):
        raise ValueError(f"{len(labels)} labels but {len(verdicts)} verdicts")
    right = [v is not None and v == y for y, v in zip(labels, verdicts)]

    def share(rows: list[bool]) -> float:
        return sum(rows) / len(rows) if rows else math.nan

    on_correct = share([r for r, y in zip(right, labels) if y])
    on_incorrect = share([r for r, y in zip(right, labels) if not y])
    return {"judge_accuracy": share(right), "judge_balanced_accuracy": (on_correct + on_incorrect) / 2,
            "judge_accuracy_on_correct": on_correct, "judge_accuracy_on_incorrect": on_incorrect,
            "judge_judged": len(labels), "judge_unparsed": sum(v is None for v in verdicts)}


def pose(engine: RolloutEngine, tokenizer: Any, specs: Mapping[str, Any], tasks: Sequence[tuple[str, Problem]],
         params: SamplingParams, seed: int, chunk: int = 64) -> list[dict[str, Any]]:
    """Each ``(benchmark, task)`` answered once by the policy in the benchmark's prompt template (``specs``), on
    its own stream, and graded as training grades it: per task its ``label``, the judge's ``verdict`` (a label,
    or None when none can be read), whether it is ``correct``, and the judge's ``response``."""
    records: list[dict[str, Any]] = []
    for lo in range(0, len(tasks), chunk):
        part = tasks[lo : lo + chunk]
        requests = [GenerationRequest(prompt_ids=encode_prompts(tokenizer, [task], specs[bench])[0], n=1,
                                      seed=problem_seed(seed, f"{bench}/judge", task.uid)) for bench, task in part]
        answers = [group[0] for group in engine.generate(requests, params)]
        grades = grade_completions(None, [task for _, task in part], answers)
        records += [{"label": task.answer, "verdict": grade.extracted, "correct": bool(grade.correct), "response": answer.text}
                    for (_, task), answer, grade in zip(part, answers, grades)]
    return records


def add_judge_accuracy(result: Any, engine: RolloutEngine, tokenizer: Any, benchmarks: Sequence[Any],
                       params: SamplingParams, seed: int) -> Any:
    """``result`` (an rlbench.eval.evaluate.EvalResult, its ``benchmarks``) with the policy as SPARK's judge of
    its samples. Pointwise: every sample, its record under the sample's ``judge``. Pairwise: in each problem
    whose samples are mixed, its first correct and its first incorrect sample in both orderings
    (:func:`rlbench.reward.judge_tasks.pairwise_tasks`), the two records under the correct sample's
    ``judge["pairwise"]``. Every row gets the :data:`JUDGE_COLUMNS`: a benchmark's figures on its rows (the
    same for every k), and on the ``macro_avg`` rows each rate averaged over the benchmarks with equal weight
    (those where it is defined) and the counts summed."""
    problems = {(b.name, p.uid): p for b in benchmarks for p in b.problems}
    specs = {b.name: b.spec["prompt"] for b in benchmarks}
    grouped: dict[tuple[str, str], list[dict[str, Any]]] = {}  # the samples of each problem, in order
    for s in result.samples:
        grouped.setdefault((s["benchmark"], s["prompt_id"]), []).append(s)
    pointwise: list[tuple[str, Problem]] = []
    pairwise: list[tuple[str, Problem]] = []
    pair_owner: list[dict[str, Any]] = []  # the correct sample of each pairwise task
    for (bench, uid), own in grouped.items():
        texts, correct = [s["completion"] for s in own], [bool(s["correct"]) for s in own]
        pointwise += [(bench, task) for task in pointwise_tasks(problems[bench, uid], texts, correct, range(len(own)))]
        if any(correct) and not all(correct):
            right, wrong = correct.index(True), correct.index(False)
            pairwise += [(bench, task) for task in pairwise_tasks(problems[bench, uid], texts, right, wrong)]
            pair_owner += [own[right]] * 2
    for sample, record in zip([s for own in grouped.values() for s in own], pose(engine, tokenizer, specs, pointwise, params, seed)):
        sample["judge"] = record
    pair_records = pose(engine, tokenizer, specs, pairwise, params, seed)
    for sample, record in zip(pair_owner, pair_records):
        sample["judge"].setdefault("pairwise", []).append(record)
    figures: dict[str, dict[str, float]] = {}
    for b in benchmarks:
        own = [s["judge"] for s in result.samples if s["benchmark"] == b.name]
        pairs = [r for (bench, _), r in zip(pairwise, pair_records) if bench == b.name]
        figures[b.name] = {
            **judge_figures([r["label"] == POINTWISE_LABELS[0] for r in own],
                            [None if r["verdict"] is None else r["verdict"] == POINTWISE_LABELS[0] for r in own]),
            "judge_pairwise_accuracy": sum(r["correct"] for r in pairs) / len(pairs) if pairs else math.nan,
            "judge_pairwise_judged": len(pairs), "judge_pairwise_unparsed": sum(r["verdict"] is None for r in pairs)}
    for row in result.rows:
        if row["benchmark"] in figures:
            row.update(figures[row["benchmark"]])
        elif row["benchmark"] == MACRO_AVERAGE:
            row.update(macro_judge_figures(list(figures.values())))
    return result


def macro_judge_figures(per_benchmark: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Each rate's equal-weight mean over the benchmarks where it is defined (NaN where none is); counts summed."""
    out: dict[str, float] = {}
    for rate in RATES:
        values = [f[rate] for f in per_benchmark if not math.isnan(f[rate])]
        out[rate] = float(np.mean(values)) if values else math.nan
    for count in COUNTS:
        out[count] = int(sum(f[count] for f in per_benchmark))
    return out


def judge_by_benchmark(result: Any) -> dict[str, dict[str, float]]:
    """The judge figures of an evaluation per benchmark (the ``macro_avg`` included), read from its rows, a
    NaN rate as None (JSON has no NaN); empty when it ran without eval.judge_accuracy."""
    return {row["benchmark"]: {c: None if row[c] != row[c] else row[c] for c in JUDGE_COLUMNS}
            for row in result.rows if "judge_accuracy" in row}


def judge_table(result: Any, baseline: Any = None) -> str:
    """The printed table: per benchmark the pointwise items judged, the unreadable verdicts, accuracy, balanced
    accuracy and the accuracy on each class, then the pairwise items and their accuracy, with the balanced and the
    pairwise accuracy before training when there was an evaluation then."""
    before = judge_by_benchmark(baseline) if baseline is not None else {}

    def rate(x: float | None) -> str:
        return "-" if x is None else f"{x:.4f}"  # None: no responses of that class

    header = (f"{'SPARK judge':<24} {'judged':>6} {'unparsed':>8} {'accuracy':>8} {'balanced':>8} "
              f"{'on_right':>8} {'on_wrong':>8} {'bal.before':>10} {'pairs':>5} {'pair_acc':>8} {'pair.before':>11}")
    lines = [header, "-" * len(header)]
    for bench, f in judge_by_benchmark(result).items():
        b = before.get(bench)
        lines.append(f"{bench:<24} {f['judge_judged']:>6} {f['judge_unparsed']:>8} {rate(f['judge_accuracy']):>8} "
                     f"{rate(f['judge_balanced_accuracy']):>8} {rate(f['judge_accuracy_on_correct']):>8} "
                     f"{rate(f['judge_accuracy_on_incorrect']):>8} {'-' if b is None else rate(b['judge_balanced_accuracy']):>10} "
                     f"{f['judge_pairwise_judged']:>5} {rate(f['judge_pairwise_accuracy']):>8} "
                     f"{'-' if b is None else rate(b['judge_pairwise_accuracy']):>11}")
    return "\n".join(lines)
