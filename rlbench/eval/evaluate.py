"""Evaluation: n samples per problem on every benchmark of a suite, graded, then pass@k tables.

With an environment (``env=<name>``: ``rlbench mode=eval env=python_tool``, and the evaluations of a run
that trains with rollout=multi_turn) each sample is an episode through it, run by the training's own
episode loop (rlbench.rollout.strategies.multi_turn.EpisodeRunner) and graded as training grades an
episode (the environment's verdict on its return); pass@k is then over the n episodes of a problem, and
each sample of the samples file lists its turns (docs/agents.md)."""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from rlbench.dataset.base import Problem, spec_value
from rlbench.errors import DataError
from rlbench.eval.metrics import METRIC_COLUMNS, ProblemResult, summarize
from rlbench.eval.self_reflection import reflection_figures, self_reflect
from rlbench.eval.streams import problem_seed
from rlbench.model.lora import role_adapters
from rlbench.prompting import encode_prompts
from rlbench.reward import canonical_answer, grade_completions
from rlbench.rollout.engines.base import Completion, GenerationRequest, RolloutEngine, SamplingParams
from rlbench.rollout.strategies.multi_turn import Episode, EpisodeRunner, episode_turns, grade_episode
from rlbench.rollout.strategies.multiround import round_problem
from rlbench.utils import Progress

log = logging.getLogger(__name__)


@dataclass
class Benchmark:
    name: str
    spec: Mapping[str, Any]
    problems: list[Problem]
    grader: Any  # MathReward or another grader with the same call signature
    skipped: int = 0  # records of the source left out (skip_bad_answers), reported beside the scores


def usable_problems(name: str, problems: list[Problem], spec: Mapping[str, Any], skipped: int = 0) -> list[Problem]:
    """``problems``, or a DataError (before any model loads) when there are none and the
    benchmark's ``allow_empty`` is not set: an empty file, or one whose every record was skipped,
    must not read as a finished evaluation."""
    if problems or spec.get("allow_empty"):
        return problems
    why = f"all {skipped} records were skipped (skip_bad_answers)" if skipped else "the source has no records"
    raise DataError(
        f"benchmark {name!r} has no usable problems: {why}. Fix the file or the field mapping, or set "
        f"eval.benchmarks.{name}.allow_empty=true to report it as a row marked empty"
    )


class BudgetProgress:
    """Progress of an evaluation in token slots of its budget (``max_new_tokens`` per sample), with
    an ETA: the engine reports every sampled token and a finished sample's unused rest
    (SamplingParams.on_budget), so one long sample shows progress while it decodes, and at the end of
    each chunk of problems the count is set to exactly what that chunk budgeted (an engine that
    reports nothing then shows progress per chunk). A line at most every ``interval`` seconds:
    ``[eval] 35% ... ETA 04:10  gsm8k: 16/48 problems done``. The ETA assumes the rest decodes at the
    rate so far and that every sample may run to the budget: an upper bound when samples stop early."""

    def __init__(self, problems: int, n: int, max_new_tokens: int, interval: float = 5.0, enabled: bool = True):
        self.per_problem = n * max(int(max_new_tokens), 0)
        self.meter = Progress("eval: token budget", problems * self.per_problem, min_interval=interval, enabled=enabled)
        self.interval = interval
        self.problems, self.problems_done, self.chunk_start, self.chunk_size, self.benchmark = problems, 0, 0, 0, ""

    def begin(self, benchmark: str, problems: int) -> None:
        self.benchmark, self.chunk_size, self.chunk_start = benchmark, problems, self.meter.done

    def used(self, slots: int) -> None:
        """SamplingParams.on_budget: ``slots`` more token slots used (kept within the current chunk)."""
        room = self.chunk_start + self.chunk_size * self.per_problem - 1 - self.meter.done
        slots = max(min(int(slots), room), 0)
        if time.perf_counter() - self.meter.start < self.interval:  # no line (and no wild ETA) from the first steps
            self.meter.done += slots
        else:
            self.meter.update(slots, note=self.note())

    def end_chunk(self) -> None:
        self.problems_done += self.chunk_size
        self.meter.update(self.chunk_start + self.chunk_size * self.per_problem - self.meter.done, note=self.note())

    def note(self) -> str:
        return f"{self.benchmark}: {self.problems_done}/{self.problems} problems done"


@dataclass
class EvalResult:
    rows: list[dict]            # one per (benchmark, k)
    samples: list[dict]         # one per completion
    seconds: float
    problems: list[dict] = field(default_factory=list)  # one per problem: benchmark, uid, n, correct
    grader_errors: dict[str, int] = field(default_factory=dict)  # per benchmark: completions the grader failed on
    skipped: dict[str, int] = field(default_factory=dict)  # per benchmark: source records left out

    def with_phase(self, phase: str) -> "EvalResult":
        """Tag every table row and problem row with the evaluation phase (before / after / eval)."""
        for row in self.rows + self.problems:
            row["phase"] = phase
        return self

    def pass_at(self, k: int = 1) -> dict[str, float | None]:
        """pass@k per benchmark; None for a benchmark without problems (JSON has no NaN)."""
        return {r["benchmark"]: None if r["problems"] == 0 else r["pass_at_k"] for r in self.rows if r["k"] == k}


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
    world: Any = None,
    progress_interval: float = 5.0,
    rounds: int = 1,
    env: Any = None,
    reflection_rounds: int = 0,
) -> EvalResult:
    """Sample ``n`` completions per problem, grade them and summarise pass@k / maj@k / accuracy.

    ``rounds`` > 1 (``eval.rounds``): each sample is MOTIF's multi-round inference, graded on its last
    round (:func:`final_rounds`).

    ``reflection_rounds`` > 0 (``eval.self_reflection``): each sample goes through SPARK's judge-then-revise
    loop, at most that many rounds (:func:`rlbench.eval.self_reflection.self_reflect`); its final answer is
    graded, each sample row gets its ``reflection`` record and each table row the
    :data:`~rlbench.eval.self_reflection.REFLECTION_COLUMNS`.

    ``env`` (an rlbench.rollout.env.EnvFactory; the run's ``env``): each sample is an episode through the
    environment (:func:`run_episodes`), graded by the environment's verdict, as in training; the budget is
    ``env.max_turns`` turns of ``env.turn_tokens`` per sample, and each sample row gets its ``turns``.

    Each problem's samples draw from their own stream, :func:`problem_seed` (seed, benchmark,
    uid): the evaluation before and after training draws the same random numbers (a paired
    comparison), and a benchmark's samples do not depend on the other benchmarks of the suite. A
    benchmark without problems (allowed by its ``allow_empty``) gets rows marked ``empty``.

    ``world`` (rlbench.training.distributed.World, trainer.parallelism=ddp|fsdp): each rank samples
    and grades its share of every benchmark's problems (``shard_padded``: the same number on every
    rank), and the shares are gathered back into the problems' order before the summary, which
    is therefore the one a single process computes.

    Progress (:class:`BudgetProgress`) goes to stderr at most every ``progress_interval`` seconds,
    while samples decode.
    """
    if env is not None and rounds > 1:
        raise ValueError("eval.rounds > 1 (multi-round inference) and an environment (env=) do not combine")
    if reflection_rounds and (env is not None or rounds > 1):
        raise ValueError("eval.self_reflection combines with neither an environment (env=) nor eval.rounds > 1")
    start = time.perf_counter()
    results: list[ProblemResult] = []
    samples: list[dict] = []
    shares = [world.shard_padded(b.problems) if world is not None and b.problems else (b.problems, len(b.problems)) for b in benchmarks]
    budget = params.max_new_tokens if env is None else env.config.max_turns * env.config.turn_tokens  # every turn counts
    progress = BudgetProgress(sum(len(own) for own, _ in shares), n * rounds, budget, progress_interval,
                              enabled=world is None or world.is_main)  # rank 0 speaks for its share
    params = dataclasses.replace(params, on_budget=progress.used)
    for bench, (own, real) in zip(benchmarks, shares):
        for lo in range(0, len(own), chunk_prompts):
            chunk = own[lo : lo + chunk_prompts]
            progress.begin(bench.name, len(chunk))
            episodes: list[Episode] = []
            reflections: list[dict] = []
            if env is not None:
                groups, episodes = run_episodes(engine, tokenizer, bench, chunk, env, n, params, seed)
                all_grades = [grade_episode(e, env.config.name) for e in episodes]
            else:
                prompt_ids = encode_prompts(tokenizer, chunk, bench.spec["prompt"])
                requests = [
                    GenerationRequest(prompt_ids=ids, n=n, seed=problem_seed(seed, bench.name, p.uid))
                    for ids, p in zip(prompt_ids, chunk)
                ]
                groups = engine.generate(requests, params)
                if rounds > 1:
                    groups = final_rounds(engine, tokenizer, bench, chunk, groups, rounds, params, seed)
                if reflection_rounds:
                    groups, all_grades, reflections = self_reflect(engine, tokenizer, bench, chunk, groups, params, seed, reflection_rounds)
                else:
                    flat = [c for group in groups for c in group]
                    all_grades = grade_completions(bench.grader, [p for p, g in zip(chunk, groups) for _ in g], flat)
            votable = spec_value(bench.spec, "answer_type") != "code"  # programs cannot vote
            offset = 0
            for position, (problem, group) in enumerate(zip(chunk, groups), start=lo):
                if position >= real:  # padding of this rank's share (scored by another rank)
                    break
                grades = all_grades[offset : offset + len(group)]
                group_episodes = episodes[offset : offset + len(group)]
                group_reflections = reflections[offset : offset + len(group)]
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
                for i, (c, g) in enumerate(zip(group, grades)):
                    samples.append(
                        {
                            "benchmark": bench.name,
                            "prompt_id": problem.uid,
                            "completion": c.text,
                            "extracted": g.extracted,
                            "extraction": g.extraction,
                            "reference": problem.answer,
                            "correct": g.correct,
                            "finished": c.finished,
                            "response_tokens": len(c.response_ids),
                            "grader_error": g.error,
                            **({"grader_details": g.details} if getattr(g, "details", None) else {}),
                            **(episode_fields(group_episodes[i], tokenizer) if group_episodes else {}),
                            **({"reflection": group_reflections[i]} if group_reflections else {}),
                        }
                    )
            progress.end_chunk()
    if world is not None:
        results, samples = in_problem_order(benchmarks, world.gather(results), world.gather(samples))
    rows = summarize(results, ks, seed=seed) if results else []
    rows = _with_empty_rows(rows, benchmarks, n, ks)
    errors = {bench.name: sum(s["grader_error"] is not None for s in samples if s["benchmark"] == bench.name) for bench in benchmarks}
    skipped = {bench.name: bench.skipped for bench in benchmarks}
    for row in rows:  # a broken grader or skipped records read as a low score: keep the counts beside it
        row["grader_errors"] = errors.get(row["benchmark"], sum(errors.values()))
        row["skipped"] = skipped.get(row["benchmark"], sum(skipped.values()))
        own = [s for s in samples if s["benchmark"] == row["benchmark"]] if row["benchmark"] in errors else samples
        row.update(finish_rates(own))
        if reflection_rounds:
            row.update(reflection_figures(own))
        row["empty"] = row["problems"] == 0
    for name, count in errors.items():
        if count:
            log.warning("%s: the grader failed on %d completions (scored 0; see grader_error in samples.jsonl)", name, count)
    problems = [
        {"benchmark": r.benchmark, "uid": r.uid, "n": len(r.correct), "correct": int(sum(r.correct))} for r in results
    ]
    return EvalResult(
        rows=rows,
        samples=samples,
        seconds=time.perf_counter() - start,
        problems=problems,
        grader_errors=errors,
        skipped=skipped,
    )


def run_episodes(
    engine: RolloutEngine, tokenizer: Any, bench: Benchmark, problems: Sequence[Problem], env: Any, n: int,
    params: SamplingParams, seed: int,
) -> tuple[list[list[Completion]], list[Episode]]:
    """``n`` episodes per problem through the environment, run to their end by rollout=multi_turn's episode
    loop (the same turns, turn ends, caps and end reasons as in training; tool code runs in the sandbox
    with the run's limits) on the benchmark's prompt templates; the environment grades final answers with
    the benchmark's grader. Episode k of a problem draws from its own stream (:func:`problem_seed` of the
    benchmark and k; each turn its own seed from it), so the evaluations before and after training draw the
    same numbers. Returns the completions per problem (every turn's tokens, observations included) and the
    episodes, flat in the same order."""
    runner = EpisodeRunner(env.with_context(grader=bench.grader), tokenizer, bench.spec["prompt"], engine.generate, params,
                           role_adapters(getattr(engine, "model", None)))
    episodes = [runner.start(problem, seed=problem_seed(seed, f"{bench.name}/episode{k}", problem.uid))
                for problem in problems for k in range(n)]
    runner.run_to_end(episodes, time.perf_counter())
    completions = [e.completion(tokenizer) for e in episodes]
    return [completions[i * n : (i + 1) * n] for i in range(len(problems))], episodes


def episode_fields(e: Episode, tokenizer: Any) -> dict[str, Any]:
    """What a sample row adds for an episode: its turns (number, the policy's text, the observation that
    followed), the reason it ended, its tool calls and errors, and its policy tokens (``response_tokens``
    counts the observations too)."""
    return {"turns": episode_turns(e, tokenizer), "ended_by": e.ended_by, "tool_calls": e.tool_calls,
            "tool_errors": e.tool_errors, "policy_tokens": sum(e.loss_mask)}


def final_rounds(
    engine: RolloutEngine, tokenizer: Any, bench: Benchmark, problems: Sequence[Problem], groups: list[list[Completion]],
    rounds: int, params: SamplingParams, seed: int,
) -> list[list[Completion]]:
    """MOTIF's multi-round inference (Mitra & Ulukus 2025, arXiv:2507.02851, section 3; rollout=multiround's
    prompts, :func:`rlbench.rollout.strategies.multiround.round_problem`): round r + 1 of a sample is one
    response to the problem followed by "Progress in round r: <round r's progress>" (its <answer> part, or the
whole response without one; and, in the last round,
    the note that it is the last), in the benchmark's template; the last round's response stands for the
    sample and is what is graded. Each continuation draws from its own stream, :func:`problem_seed` of the
    benchmark, the round and the sample's index, so before and after training draw the same numbers."""
    for round_number in range(1, rounds):
        final = round_number == rounds - 1
        flat = [(problem, k, c) for problem, group in zip(problems, groups) for k, c in enumerate(group)]
        round_problems = [round_problem(problem, round_number, c.text, final) for problem, _, c in flat]
        prompt_ids = encode_prompts(tokenizer, round_problems, bench.spec["prompt"])
        requests = [GenerationRequest(prompt_ids=ids, n=1, seed=problem_seed(seed, f"{bench.name}/round{round_number}/{k}", problem.uid))
                    for ids, (problem, k, _) in zip(prompt_ids, flat)]
        answers = iter(response[0] for response in engine.generate(requests, params))
        groups = [[next(answers) for _ in group] for group in groups]
    return groups


def finish_rates(samples: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Whether a score is about finishing or about answering: ``finished_share``, the share of
    samples that ended (EOS or a stop string) within the token budget, the rest being cut off, and
    ``finished_accuracy``, the share of those finished samples graded correct (NaN when none
    finished). A gain in accuracy that is all in ``finished_share`` is learning the budget."""
    finished = [s for s in samples if s["finished"]]
    return {
        "finished_share": len(finished) / len(samples) if samples else math.nan,
        "finished_accuracy": sum(bool(s["correct"]) for s in finished) / len(finished) if finished else math.nan,
    }


def in_problem_order(
    benchmarks: Sequence[Benchmark], results: list[ProblemResult], samples: list[dict]
) -> tuple[list[ProblemResult], list[dict]]:
    """Results and samples gathered from the ranks, put back in the suite's order (benchmark, then
    problem), as one process produces them."""
    position = {(b.name, p.uid): (i, j) for i, b in enumerate(benchmarks) for j, p in enumerate(b.problems)}
    results = sorted(results, key=lambda r: position[(r.benchmark, r.uid)])
    samples = sorted(samples, key=lambda s: position[(s["benchmark"], s["prompt_id"])])  # stable: sample order kept
    return results, samples


def _with_empty_rows(rows: list[dict], benchmarks: Sequence[Benchmark], n: int, ks: Sequence[int]) -> list[dict]:
    """``rows`` with NaN rows (``problems`` 0) for the benchmarks that have no problems, in suite
    order; the macro average (over the benchmarks with problems) stays last."""
    by_name: dict[str, list[dict]] = {}
    for row in rows:
        by_name.setdefault(row["benchmark"], []).append(row)
    out: list[dict] = []
    for bench in benchmarks:
        if bench.problems:
            out += by_name.pop(bench.name, [])
        else:
            nan = {column: math.nan for columns in METRIC_COLUMNS for column in columns}
            out += [{"benchmark": bench.name, "k": k, **nan, "n": n, "problems": 0} for k in sorted(set(ks))]
    return out + [row for group in by_name.values() for row in group]
