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
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from rlbench.config.schema import RunConfig
from rlbench.dataset import load_problems
from rlbench.guidance.traces import tokenizer_fingerprint
from rlbench.model import load_policy
from rlbench.prompting import encode_prompts
from rlbench.reward import grade_completions
from rlbench.reward.graders import training_grader
from rlbench.rollout import make_engine
from rlbench.rollout.engines.base import GenerationRequest, SamplingParams
from rlbench.utils import Progress, atomic_write_text

log = logging.getLogger(__name__)

CHUNK = 16  # problems per engine call (progress lines between calls)


def trace_seed(seed: int, uid: str) -> int:
    """The random stream of one problem's samples: a function of the run's seed and the uid alone."""
    return int.from_bytes(hashlib.sha256(f"generate\0{int(seed)}\0{uid}".encode()).digest()[:8], "big") >> 2


def sample_graded(cfg: DictConfig, config: RunConfig, model: Any, problems: list, device: torch.device,
                  phase: str = "generate") -> tuple[list[tuple[Any, Any, Any]], str]:
    """``rollout.n`` samples of ``model`` (a typed model node) for each of ``problems``, graded by the run's grader,
    with a progress line (done, ETA) per chunk: ``[(problem, completion, grade)]`` and the tokenizer's fingerprint.
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
    fingerprint = tokenizer_fingerprint(tokenizer)
    del engine, policy
    return graded, fingerprint


def write_traces(cfg: DictConfig, config: RunConfig, device: torch.device) -> dict[str, Any]:
    """Generate, grade and write the traces of ``dataset`` to ``out`` with the sampling settings of
    ``rollout`` (``cfg``: the composed config, for the loaders; ``config``: the same, typed); returns the counts.
    With a ``warmup`` node, Thinkless' paired warm-up data instead (rlbench/guidance/warmup.py)."""
    if config.warmup is not None:
        from rlbench.guidance.warmup import write_warmup_traces

        return write_warmup_traces(cfg, config, device)
    started = time.perf_counter()
    out = Path(str(cfg.out)).expanduser()
    problems = load_problems(cfg.dataset, seed=cfg.seed, data_dir=cfg.data_dir, source=cfg.data_source)
    graded, fingerprint = sample_graded(cfg, config, config.model, problems, device)
    keep_incorrect = config.guidance is not None and config.guidance.keep_incorrect
    lines: list[str] = []
    for problem, completion, grade in graded:
        if not grade.correct and not keep_incorrect:
            continue
        record = {
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
        lines.append(json.dumps(record, ensure_ascii=False))
    generated, correct = len(graded), sum(int(g.correct) for *_, g in graded)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, "".join(line + "\n" for line in lines))
    summary = {
        "mode": "generate",
        "out": str(out),
        "model": cfg.model.name,
        "dataset": cfg.dataset.name,
        "problems": len(problems),
        "responses": generated,
        "correct": correct,
        "written": len(lines),
        "keep_incorrect": keep_incorrect,
        "wall_seconds": time.perf_counter() - started,
    }
    print(f"traces: {len(lines)} of {generated} responses written ({correct} correct) to {out}")
    return summary
