"""``rlbench mode=generate model=<teacher> dataset=<set> out=traces.jsonl``: write graded traces.

Samples ``rollout.n`` responses per problem of the dataset's split (``dataset.limit`` problems at
most) with the rollout's temperature, top-p and ``max_new_tokens``, grades each with the run's
grader and writes one JSON object a line (atomically):

    {"uid", "prompt", "text", "response_ids", "tokenizer", "finished", "correct", "reward",
     "extracted", "model"}

Only the traces graded correct are kept unless ``guidance.keep_incorrect=true``; the verdict is stored
either way. ``tokenizer`` is the fingerprint of the writer's tokenizer (rlbench.guidance.traces.
tokenizer_fingerprint): a run with ``guidance=jsonl guidance.path=traces.jsonl`` re-uses the ids when
its policy has the same tokenizer and counts the trace as a tokenizer mismatch otherwise. Each
problem's samples come from their own random stream (seed, uid), so a file is repeatable.

RLEP's pool (Zhang et al. 2025, arXiv:2507.07451, section 2: the phase-1 checkpoint is sampled on the
training questions and its verified correct responses are kept per question)::

    rlbench mode=generate model=checkpoint model.path=<phase-1 run>/policy \
        rollout=replay_rlep_collect rollout.replay.pool_save=pool.json

writes, instead of the JSONL traces, the replay pool that ``rollout.replay.pool`` reads in phase 2 (one
format, rlbench.rollout.guided.replay_pool.SuccessPool writes it and ``read_pool`` reads it): per training
question, the responses the grader marked correct (at most ``rollout.replay.pool_per_question``), with
their token ids and the checkpoint's sampling log-probs, and the question's accuracy over its ``rollout.n``
samples. A question without a success is left out and counted (``no_success`` in the summary). Give it the
phase-1 run's dataset and rollout settings (``rollout.n`` is k, the samples per question); a difference from
the ``config.yaml`` of the run that saved the policy is named in a warning (:func:`warn_unlike_training_run`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from rlbench.config.schema import RunConfig
from rlbench.dataset import load_problems
from rlbench.model import load_policy
from rlbench.prompting import encode_prompts
from rlbench.reward import grade_completions
from rlbench.reward.graders import training_grader
from rlbench.rollout import make_engine
from rlbench.rollout.engines.base import GenerationRequest, SamplingParams
from rlbench.rollout.guided.replay import ReplayItem, ReplayOptions, generated_pool_path
from rlbench.rollout.guided.replay_pool import SuccessPool
from rlbench.utils import Progress, atomic_write_text, tokenizer_fingerprint

log = logging.getLogger(__name__)

CHUNK = 16  # problems per engine call (progress lines between calls)


def trace_seed(seed: int, uid: str) -> int:
    """The random stream of one problem's samples: a function of the run's seed and the uid alone."""
    return int.from_bytes(hashlib.sha256(f"generate\0{int(seed)}\0{uid}".encode()).digest()[:8], "big") >> 2


def sample_graded(cfg: DictConfig, config: RunConfig, model: Any, problems: list, device: torch.device,
                  phase: str = "generate") -> tuple[list[tuple[Any, Any, Any]], Any]:
    """``rollout.n`` samples of ``model`` (a typed model node) for each of ``problems``, graded by the run's grader,
    with a progress line (done, ETA) per chunk: ``[(problem, completion, grade)]`` and the model's tokenizer.
    The model is freed on return."""
    rollout = config.rollout
    policy, tokenizer = load_policy(model, device=device, dtype=torch.float32, seed=config.seed, cache_dir=config.cache_dir)
    engine = make_engine(rollout, policy, tokenizer, device)
    grader = training_grader(config)
    params = SamplingParams(rollout.temperature, rollout.top_p, rollout.max_new_tokens)
    progress = Progress(phase, len(problems))
    graded: list[tuple[Any, Any, Any]] = []
    for start in range(0, len(problems), CHUNK):
        chunk = problems[start : start + CHUNK]
        prompt_ids = encode_prompts(tokenizer, chunk, cfg.dataset.prompt)
        requests = [GenerationRequest(prompt_ids=ids, n=int(rollout.n), seed=trace_seed(cfg.seed, p.uid)) for p, ids in zip(chunk, prompt_ids)]
        groups = engine.generate(requests, params)
        flat = [(p, c) for p, group in zip(chunk, groups) for c in group]
        grades = grade_completions(grader, [p for p, _ in flat], [c for _, c in flat])
        graded += [(p, c, g) for (p, c), g in zip(flat, grades)]
        progress.update(len(chunk), note=f"{sum(g.correct for *_, g in graded)} of {len(graded)} responses correct")
    del engine, policy
    return graded, tokenizer


def write_traces(cfg: DictConfig, config: RunConfig, device: torch.device) -> dict[str, Any]:
    """Generate, grade and write the traces of ``dataset`` to ``out`` with the sampling settings of
    ``rollout`` (``cfg``: the composed config, for the loaders; ``config``: the same, typed); returns the counts.
    With ``rollout.replay.pool_save`` the verified successes go to that RLEP pool instead (module docstring).
    (With a ``warmup`` node the runner calls rlbench/guidance/warmup.py instead, which samples through
    :func:`sample_graded`.)"""
    started = time.perf_counter()
    rollout = config.rollout
    pool_path = generated_pool_path(rollout)
    out = Path(str(pool_path or cfg.out)).expanduser()
    if pool_path and config.model.source == "path":  # before the model loads
        warn_unlike_training_run(cfg, Path(str(config.model.path)).expanduser())
    problems = load_problems(cfg.dataset, seed=cfg.seed, data_dir=cfg.data_dir, source=cfg.data_source)
    graded, tokenizer = sample_graded(cfg, config, config.model, problems, device)
    keep_incorrect = config.guidance is not None and config.guidance.keep_incorrect
    fingerprint = tokenizer_fingerprint(tokenizer)
    pool = SuccessPool(out, ReplayOptions.from_config(rollout).pool_per_question, tokenizer) if pool_path else None
    lines: list[str] = []
    no_success: list[str] = []
    generated, correct = len(graded), sum(int(g.correct) for *_, g in graded)
    by_problem: dict[int, list[tuple[Any, Any]]] = {}
    for problem, completion, grade in graded:
        by_problem.setdefault(id(problem), []).append((completion, grade))
    for problem in problems:
        samples = by_problem.get(id(problem), [])
        if pool is not None:  # RLEP: the question's verified successes, sampled by the checkpoint (version 0)
            successes = [ReplayItem.from_completion(problem.uid, c, policy_version=0) for c, g in samples if g.correct]
            pool.add(problem, successes, len(successes) / max(len(samples), 1))
            if not successes:
                no_success.append(problem.uid)
            continue
        lines.extend(json.dumps(trace_record(cfg, problem, c, g, fingerprint), ensure_ascii=False)
                     for c, g in samples if g.correct or keep_incorrect)
    out.parent.mkdir(parents=True, exist_ok=True)
    if pool is not None:
        pool.write()
        written = sum(len(entry["responses"]) for entry in pool.questions.values())
    else:
        atomic_write_text(out, "".join(line + "\n" for line in lines))
        written = len(lines)
    summary = {
        "mode": "generate",
        "out": str(out),
        "format": "replay_pool" if pool is not None else "traces",
        "model": cfg.model.name,
        "dataset": cfg.dataset.name,
        "problems": len(problems),
        "responses": generated,
        "correct": correct,
        "written": written,
        "keep_incorrect": keep_incorrect,
        "wall_seconds": time.perf_counter() - started,
    }
    if pool is None:
        print(f"traces: {written} of {generated} responses written ({correct} correct) to {out}")
        return summary
    summary.update(questions=len(pool.questions), no_success=len(no_success))
    if no_success:
        log.warning("generate: %d of %d questions have no verified success in %d samples each and are not in the pool "
                    "(first: %s)", len(no_success), len(problems), int(rollout.n), ", ".join(no_success[:5]))
    print(f"pool: {written} verified successes of {len(pool.questions)} questions written to {out} "
          f"({len(no_success)} of {len(problems)} questions without a success)")
    return summary


SAMPLING_KEYS = ("rollout.temperature", "rollout.top_p", "rollout.max_new_tokens", "dataset", "seed")


def warn_unlike_training_run(cfg: DictConfig, checkpoint: Path) -> list[str]:
    """RLEP samples the first run's policy on that run's training questions with its rollout settings: one
    warning naming each of :data:`SAMPLING_KEYS` (a dataset key by its full name) where this command differs
    from the ``config.yaml`` of the run that saved ``checkpoint`` (``<run>/policy``); returns those keys.
    Nothing when the checkpoint is not a run's saved policy."""
    saved_file = checkpoint.parent / "config.yaml"
    if not saved_file.is_file():
        return []
    ours = sampling_settings(OmegaConf.to_container(cfg, resolve=True))
    theirs = sampling_settings(OmegaConf.to_container(OmegaConf.load(saved_file)))
    differ = sorted(k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k))
    if differ:
        log.warning("generate: %s was saved by a run whose %s differ from this command's (%s): RLEP samples the "
                    "first run's policy with its rollout settings on its training questions", checkpoint,
                    ", ".join(differ), "; ".join(f"{k}: {theirs.get(k)!r} there, {ours.get(k)!r} here" for k in differ[:4]))
    return differ


def sampling_settings(config: dict[str, Any]) -> dict[str, Any]:
    """The leaves of :data:`SAMPLING_KEYS` in a resolved config, by dotted name."""

    def leaves(node: Any, prefix: str) -> dict[str, Any]:
        if isinstance(node, dict):
            return {k: v for key, value in node.items() for k, v in leaves(value, f"{prefix}.{key}").items()}
        return {prefix: node}

    def select(dotted: str) -> Any:
        node: Any = config
        for part in dotted.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        return node

    return {k: v for key in SAMPLING_KEYS for k, v in leaves(select(key), key).items()}


def trace_record(cfg: DictConfig, problem: Any, completion: Any, grade: Any, fingerprint: str) -> dict[str, Any]:
    """One line of the traces file (module docstring)."""
    return {
        "uid": problem.uid,
        "prompt": problem.prompt,
        "text": completion.text,
        "response_ids": list(completion.response_ids),
        "tokenizer": fingerprint,
        "finished": bool(completion.finished),
        "correct": bool(grade.correct),
        "reward": float(grade.reward),
        "extracted": grade.extracted,
        "model": cfg.model.name,
    }
