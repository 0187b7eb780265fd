"""Evaluation: n samples per problem on every benchmark of a suite, graded, then pass@k tables."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from rlbench.dataset.base import Problem
from rlbench.eval.metrics import ProblemResult, summarize
from rlbench.prompting import encode_prompts
from rlbench.reward import canonical_answer, grade_completions
from rlbench.rollout.base import GenerationRequest, RolloutEngine, SamplingParams
from rlbench.utils import Progress

log = logging.getLogger(__name__)


@dataclass
class Benchmark:
    name: str
    spec: Mapping[str, Any]
    problems: list[Problem]
    grader: Any  # MathReward or another grader with the same call signature


@dataclass
class EvalResult:
    rows: list[dict]            # one per (benchmark, k)
    samples: list[dict]         # one per completion
    seconds: float
    problems: list[dict] = field(default_factory=list)  # one per problem: benchmark, uid, n, correct
    grader_errors: dict[str, int] = field(default_factory=dict)  # per benchmark: completions the grader failed on

    def with_phase(self, phase: str) -> "EvalResult":
        """Tag every table row and problem row with the evaluation phase (before / after / eval)."""
        for row in self.rows + self.problems:
            row["phase"] = phase
        return self

    def pass_at(self, k: int = 1) -> dict[str, float]:
        return {r["benchmark"]: r["pass_at_k"] for r in self.rows if r["k"] == k}


def evaluate(
    engine: RolloutEngine,
    tokenizer: Any,
    benchmarks: Sequence[Benchmark],
    *,
    n: int,
    ks: Sequence[int],
    params: SamplingParams,
    seed: int,
    chunk_prompts: int = 16,
) -> EvalResult:
    """Sample ``n`` completions per problem, grade them and summarise pass@k / maj@k / accuracy.

    The sampler is re-seeded from ``seed`` for every call, so the evaluation before and after
    training draws from the same random stream (a paired comparison).
    """
    start = time.perf_counter()
    generator = torch.Generator().manual_seed(seed)
    results: list[ProblemResult] = []
    samples: list[dict] = []
    total = sum(len(b.problems) for b in benchmarks)
    progress = Progress("eval", total)
    for bench in benchmarks:
        for lo in range(0, len(bench.problems), chunk_prompts):
            chunk = bench.problems[lo : lo + chunk_prompts]
            prompt_ids = encode_prompts(tokenizer, chunk, bench.spec["prompt"])
            requests = [GenerationRequest(prompt_ids=ids, n=n) for ids in prompt_ids]
            groups = engine.generate(requests, params, generator=generator)
            flat = [c for group in groups for c in group]
            all_grades = grade_completions(bench.grader, [p for p, g in zip(chunk, groups) for _ in g], flat)
            votable = bench.spec.get("answer_type", "math") != "code"  # programs cannot vote
            offset = 0
            for problem, group in zip(chunk, groups):
                grades = all_grades[offset : offset + len(group)]
                offset += len(group)
                results.append(
                    ProblemResult(
                        benchmark=bench.name,
                        uid=problem.uid,
                        correct=[g.correct for g in grades],
                        answer_keys=[canonical_answer(g.extracted) if votable else None for g in grades],
                        votable=votable,
                    )
                )
                for c, g in zip(group, grades):
                    samples.append(
                        {
                            "benchmark": bench.name,
                            "prompt_id": problem.uid,
                            "completion": c.text,
                            "extracted": g.extracted,
                            "reference": problem.answer,
                            "correct": g.correct,
                            "finished": c.finished,
                            "response_tokens": len(c.response_ids),
                            "grader_error": g.error,
                            **({"grader_details": g.details} if getattr(g, "details", None) else {}),
                        }
                    )
            progress.update(len(chunk), note=bench.name)
    rows = summarize(results, ks, seed=seed)
    errors = {bench.name: sum(s["grader_error"] is not None for s in samples if s["benchmark"] == bench.name) for bench in benchmarks}
    for row in rows:  # a broken grader reads as a low score: keep the count beside it
        row["grader_errors"] = errors.get(row["benchmark"], sum(errors.values()))
    for name, count in errors.items():
        if count:
            log.warning("%s: the grader failed on %d completions (scored 0; see grader_error in samples.jsonl)", name, count)
    problems = [
        {"benchmark": r.benchmark, "uid": r.uid, "n": len(r.correct), "correct": int(sum(r.correct))} for r in results
    ]
    return EvalResult(
        rows=rows, samples=samples, seconds=time.perf_counter() - start, problems=problems, grader_errors=errors
    )
