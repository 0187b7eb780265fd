"""Thinkless' warm-up data (Fang, Ma & Wang 2025, "Thinkless: LLM Learns When to Think", arXiv:2505.13379,
section 3.1, "distillation for warm-up"): two teachers answer the same prompts, a reasoning model with a long
chain of thought and an instruction model with a concise answer; each response is written after its control
token, ``<think>`` or ``<short>``, and the target model is fine-tuned on both, so that it can answer in either
mode and its first token picks the mode. DeGRPO (algorithm=thinkless) then starts from that checkpoint.

``rlbench mode=generate +model@warmup.think=<teacher> +model@warmup.short=<teacher> out=warmup.jsonl``
samples ``rollout.n`` responses per teacher for each problem of the dataset's split, grades them with the
run's grader and writes, atomically, one trace a line that ``rollout=offline`` reads (docs/algorithms.md):

    {"uid", "prompt", "text": "<think>\\n...", "mode": "think", "teacher", "finished", "correct", "reward", "extracted"}

The traces carry text, not ids: the student re-tokenises them with its own tokenizer, in which
``model.add_tokens=[<short>,<think>]`` makes each control token one id. Only responses the grader marks
correct are kept unless ``guidance.keep_incorrect=true`` (as mode=generate), and a prompt is written only
when both teachers have a kept response (the data set is paired). The paper's own filtering was not read
here (its warm-up code is not released).
"""

from __future__ import annotations

import gc
import json
import logging
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from rlbench.config.schema import RunConfig
from rlbench.dataset import load_problems
from rlbench.guidance.generate import sample_graded
from rlbench.utils import atomic_write_text

log = logging.getLogger(__name__)

MODES = ("think", "short")  # the teachers: warmup.think and warmup.short


def control_text(token: str, text: str) -> str:
    """A teacher's response as the student's target: its control token, a newline, the response (stripped)."""
    return f"{token}\n{text.strip()}"


def paired_records(graded: dict[str, list[tuple[Any, Any, Any]]], tokens: dict[str, str], teachers: dict[str, str],
                   keep_incorrect: bool) -> list[dict[str, Any]]:
    """The records of the prompts that both teachers answered (``graded[mode]``: (problem, completion, grade)
    triples), each response after its mode's control token, in problem order, think before short; a wrong
    response is left out unless ``keep_incorrect``."""
    kept: dict[str, dict[str, list[dict[str, Any]]]] = {}
    order: list[str] = []
    for mode in MODES:
        for problem, completion, grade in graded[mode]:
            if not grade.correct and not keep_incorrect:
                continue
            if problem.uid not in kept:
                kept[problem.uid] = {m: [] for m in MODES}
                order.append(problem.uid)
            kept[problem.uid][mode].append({
                "uid": problem.uid,
                "prompt": problem.prompt,
                "text": control_text(tokens[mode], completion.text),
                "mode": mode,
                "teacher": teachers[mode],
                "finished": bool(completion.finished),
                "correct": bool(grade.correct),
                "reward": float(grade.reward),
                "extracted": grade.extracted,
            })
    return [record for uid in order if all(kept[uid][m] for m in MODES) for m in MODES for record in kept[uid][m]]


def write_warmup_traces(cfg: DictConfig, config: RunConfig, device: torch.device) -> dict[str, Any]:
    """Sample both teachers (one at a time, each freed before the next loads), pair and write the traces to
    ``out``; returns the counts."""
    started = time.perf_counter()
    warmup = config.warmup
    out = Path(str(cfg.out)).expanduser()
    problems = load_problems(cfg.dataset, seed=cfg.seed, data_dir=cfg.data_dir, source=cfg.data_source)
    teachers = {mode: getattr(warmup, mode) for mode in MODES}
    graded: dict[str, list[tuple[Any, Any, Any]]] = {}
    for mode in MODES:
        graded[mode], _ = sample_graded(cfg, config, teachers[mode], problems, device, phase=f"warmup {mode} teacher")
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the first teacher's memory, before the second loads
    keep_incorrect = config.guidance is not None and config.guidance.keep_incorrect
    tokens = {"think": warmup.think_token, "short": warmup.short_token}
    names = {mode: str(teachers[mode].name) for mode in MODES}
    records = paired_records(graded, tokens, names, keep_incorrect)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    correct = {mode: sum(int(g.correct) for *_, g in graded[mode]) for mode in MODES}
    summary = {
        "mode": "generate",
        "warmup": True,
        "out": str(out),
        "teachers": names,
        "dataset": cfg.dataset.name,
        "problems": len(problems),
        "responses": {mode: len(graded[mode]) for mode in MODES},
        "correct": correct,
        "paired_prompts": len({r["uid"] for r in records}),
        "written": len(records),
        "keep_incorrect": keep_incorrect,
        "wall_seconds": time.perf_counter() - started,
    }
    print(f"traces: {len(records)} warm-up responses for {summary['paired_prompts']} of {len(problems)} prompts written to {out} "
          f"(correct: think {correct['think']}/{len(graded['think'])}, short {correct['short']}/{len(graded['short'])})")
    return summary
