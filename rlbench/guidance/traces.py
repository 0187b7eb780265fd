"""Guidance traces: responses the policy did not sample, keyed by problem uid, for the methods that
learn from them (LUFFY's off-policy traces, hints and prefixes taken from a solution).

A guidance source (``guidance=<source>``, conf/guidance/) gives zero or more traces per training
problem:

``none``        no traces (a guided method then reduces to its base algorithm);
``dataset``     the dataset's own worked solutions: GSM8K's answer (calculator annotations removed,
                ``#### N`` written as ``The final answer is \\boxed{N}.``), MATH's solution, arith's
                derivation (rlbench.dataset.arith.derivation);
``jsonl``       a file of traces, one JSON object a line: ``uid`` and ``text`` (re-tokenised with the
                policy's tokenizer) or ``response_ids`` with the ``tokenizer`` fingerprint they were
                written with (:func:`tokenizer_fingerprint`); ``rlbench mode=generate`` writes such files;
``even_tokens`` the toy task's trace: ``max_tokens`` even token ids per problem (reward 1 under
                reward=even_tokens), so the toy learning checks of guided methods have a meaningful guide.

Every trace is checked before training: unknown uids, empty traces, traces longer than
``max_tokens``, response ids written with another tokenizer, and traces the run's grader marks wrong
(kept only with ``keep_incorrect``) are counted and logged; ``on_bad=stop`` refuses the run before
training when any was found, ``on_bad=skip`` leaves them out and goes on.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from rlbench.config.schema import DatasetConfig, GuidanceConfig
from rlbench.dataset.arith import derivation
from rlbench.dataset.base import Problem
from rlbench.dataset.jsonl import iter_jsonl
from rlbench.errors import ConfigError, DataError
from rlbench.reward import grade_completions
from rlbench.utils import tokenizer_fingerprint

log = logging.getLogger(__name__)

SOURCES = ("none", "dataset", "jsonl", "even_tokens")
# the behaviour label (Completion.behaviour) of each source's traces
SOURCE_LABELS = {"dataset": "dataset", "jsonl": "teacher", "even_tokens": "dataset"}
BAD_KINDS = ("unknown_uid", "empty", "too_long", "tokenizer_mismatch", "incorrect")


@dataclass(frozen=True)
class Trace:
    """One guidance response: its text, its token ids under the policy's tokenizer (EOS included
    when the trace ends), where it came from and the run grader's verdict."""

    uid: str
    text: str
    token_ids: tuple[int, ...]
    behaviour: str
    finished: bool = True
    correct: bool = True
    reward: float = 1.0


class GuidanceOptions(GuidanceConfig):
    """The ``guidance`` config node (conf/guidance/<source>.yaml): the schema's GuidanceConfig (its fields and
    defaults are declared there only) with the checks that need the disk."""

    @classmethod
    def from_config(cls, guidance: GuidanceConfig | None) -> GuidanceOptions:
        """The typed ``guidance`` node, checked (a run without the node: the schema's defaults, no guidance)."""
        guidance = guidance if guidance is not None else GuidanceConfig()
        options = cls(**{spec.name: getattr(guidance, spec.name) for spec in dataclasses.fields(GuidanceConfig)})
        options.validate()
        return options

    def validate(self) -> None:
        if self.source not in SOURCES:
            raise ConfigError(f"guidance.source={self.source!r} is unknown; choose one of {list(SOURCES)} (conf/guidance/)")
        if self.on_bad not in ("skip", "stop"):
            raise ConfigError(f"guidance.on_bad={self.on_bad!r}: choose skip (count, log, go on) or stop (refuse the run)")
        if self.source == "jsonl":
            if not self.path:
                raise ConfigError("guidance=jsonl needs guidance.path=<file of traces> (rlbench mode=generate writes one)")
            if not Path(str(self.path)).expanduser().is_file():
                raise DataError(f"guidance.path={self.path}: no such file")
        if self.max_tokens is not None and int(self.max_tokens) < 1:
            raise ConfigError(f"guidance.max_tokens must be >= 1 or null (rollout.max_new_tokens), got {self.max_tokens}")


@dataclass
class GuidanceLibrary:
    """The checked traces of a run, per problem uid, with the counts of what was left out."""

    traces: dict[str, list[Trace]] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=lambda: {kind: 0 for kind in ("kept", *BAD_KINDS)})

    def for_problem(self, problem: Problem) -> list[Trace]:
        return self.traces.get(problem.uid, [])

    def __len__(self) -> int:
        return sum(len(traces) for traces in self.traces.values())

    def add(self, trace: Trace) -> None:
        self.traces.setdefault(trace.uid, []).append(trace)
        self.counts["kept"] += 1


def text_token_ids(tokenizer: Any, text: str) -> tuple[int, ...]:
    """A response's text as token ids under ``tokenizer``: the stripped text, EOS appended (an empty text: no ids)."""
    text = text.strip()
    body = tuple(tokenizer.encode(text, add_special_tokens=False)) if text else ()
    return body + ((tokenizer.eos_token_id,) if body and tokenizer.eos_token_id is not None else ())


GSM8K_CALCULATOR = re.compile(r"<<[^<>]*>>")


def solution_trace_text(solution: str) -> str:
    """A dataset solution as a response: GSM8K's calculator annotations (``<<48/2=24>>``) dropped
    and its ``#### N`` line written as ``The final answer is \\boxed{N}.`` (the prompt asks for a box);
    other solutions (MATH, arith derivations) unchanged."""
    text = GSM8K_CALCULATOR.sub("", solution)
    if "####" in text:
        body, answer = text.rsplit("####", 1)
        text = body.rstrip() + f"\nThe final answer is \\boxed{{{answer.strip().replace(',', '')}}}."
    return text.strip()


def dataset_solution(problem: Problem, dataset: DatasetConfig | None) -> str:
    """The problem's worked solution: arith's derivation, else ``meta["solution"]`` (the dataset
    config's ``fields.solution``), else ""."""
    if dataset is not None and dataset.loader == "arith":
        return derivation(problem.prompt)
    solution = problem.meta.get("solution")
    return solution_trace_text(solution) if isinstance(solution, str) else ""


def even_token_ids(tokenizer: Any, length: int, uid: str, seed: int) -> tuple[int, ...]:
    """The toy trace of ``uid``: ``length`` even, non-special token ids drawn from a stream seeded
    by (seed, uid) (the same trace every step and every run of that seed)."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    size = len(tokenizer)
    rng = random.Random(f"rlbench-guidance/even_tokens/{seed}/{uid}")
    ids: list[int] = []
    while len(ids) < length:
        token = 2 * rng.randrange(size // 2)
        if token not in special:
            ids.append(token)
    return tuple(ids)


def trace_completion(trace: Trace, prompt_ids: Sequence[int], request_index: int = 0) -> Any:
    """The trace as a response in a group (a rlbench.rollout.engines.base.Completion): every token off-policy,
    behaviour log-prob 0 (mu = 1, LUFFY's assumption for a teacher whose probabilities are unknown,
    arXiv:2504.14945, section 3.2)."""
    from rlbench.rollout.engines.base import Completion  # here: the rollout strategies import this module

    r = len(trace.token_ids)
    return Completion(
        request_index=request_index,
        prompt_ids=tuple(prompt_ids),
        response_ids=tuple(trace.token_ids),
        logprobs=[0.0] * r,
        finished=trace.finished,
        text=trace.text,
        behaviour=trace.behaviour,
        off_policy=[1] * r,
        behaviour_logprobs=[0.0] * r,
    )


@dataclass(frozen=True)
class _Candidate:
    uid: str
    where: str
    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    fingerprint: str | None = None
    finished: bool = True  # ended with EOS (a file's record may say it was cut at the token limit)


def _jsonl_candidates(path: str) -> list[_Candidate]:
    candidates = []
    for lineno, record in iter_jsonl(Path(path).expanduser()):
        where = f"{path}:{lineno}"
        if not isinstance(record.get("uid"), str):
            raise DataError(f"{where}: a trace record needs a string 'uid' (the problem's uid, e.g. gsm8k/train/17)")
        ids = record.get("response_ids")
        if ids is not None and not (isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in ids)):
            raise DataError(f"{where}: 'response_ids' must be a list of integers")
        text = record.get("text")
        if text is not None and not isinstance(text, str):
            raise DataError(f"{where}: 'text' must be a string")
        if ids is None and text is None:
            raise DataError(f"{where}: a trace record needs 'text' or 'response_ids' (with 'tokenizer')")
        ids = tuple(ids) if ids is not None else None
        candidates.append(_Candidate(record["uid"], where, text, ids, record.get("tokenizer"), bool(record.get("finished", True))))
    return candidates


def load_guidance(
    options: GuidanceOptions,
    problems: Sequence[Problem],
    tokenizer: Any,
    grader: Any,
    max_tokens: int,
    dataset: DatasetConfig | None = None,
    seed: int = 0,
) -> GuidanceLibrary:
    """The checked traces of ``options.source`` for the training ``problems`` (see the module
    docstring). ``max_tokens``: the longest trace (``options.max_tokens`` wins). Logs the counts;
    raises DataError before training when ``on_bad=stop`` and a trace was bad."""
    library = GuidanceLibrary()
    if options.source == "none":
        return library
    limit = int(options.max_tokens or max_tokens)
    label = SOURCE_LABELS[options.source]
    by_uid = {p.uid: p for p in problems}
    if options.source == "dataset":
        candidates = [_Candidate(p.uid, p.uid, text=dataset_solution(p, dataset)) for p in problems]
    elif options.source == "even_tokens":
        candidates = []
        for p in problems:
            ids = even_token_ids(tokenizer, limit, p.uid, seed)
            candidates.append(_Candidate(p.uid, p.uid, tokenizer.decode(ids), ids, None))
    else:
        candidates = _jsonl_candidates(str(options.path))
    own_fingerprint = tokenizer_fingerprint(tokenizer) if any(c.fingerprint for c in candidates) else None
    bad_examples: dict[str, str] = {}
    accepted: list[tuple[_Candidate, Trace]] = []

    def reject(kind: str, candidate: _Candidate) -> None:
        library.counts[kind] += 1
        bad_examples.setdefault(kind, candidate.where)

    for c in candidates:
        if c.uid not in by_uid:
            reject("unknown_uid", c)
            continue
        if c.token_ids is not None and options.source == "jsonl":
            if c.fingerprint != own_fingerprint:
                reject("tokenizer_mismatch", c)
                continue
            ids, text, finished = c.token_ids, c.text if c.text is not None else tokenizer.decode(c.token_ids), c.finished
        elif c.token_ids is not None:  # the toy trace: exactly max_tokens ids, cut like a truncated response
            ids, text, finished = c.token_ids, c.text or "", False
        else:
            text = (c.text or "").strip()
            ids, finished = text_token_ids(tokenizer, text), True
        if not ids or not (text or options.source == "even_tokens"):
            reject("empty", c)
            continue
        if len(ids) > limit:
            reject("too_long", c)
            continue
        accepted.append((c, Trace(c.uid, text, tuple(int(t) for t in ids), label, finished)))
    if accepted:
        grades = grade_completions(
            grader, [by_uid[c.uid] for c, _ in accepted], [trace_completion(t, ()) for _, t in accepted]
        )
        for (c, trace), grade in zip(accepted, grades):
            if not grade.correct and not options.keep_incorrect:
                reject("incorrect", c)
                continue
            library.add(Trace(trace.uid, trace.text, trace.token_ids, trace.behaviour, trace.finished, bool(grade.correct), float(grade.reward)))
    bad = {kind: library.counts[kind] for kind in BAD_KINDS if library.counts[kind]}
    summary = ", ".join(f"{kind} {n} (e.g. {bad_examples[kind]})" for kind, n in bad.items())
    if bad and options.on_bad == "stop":
        raise DataError(
            f"guidance={options.source}: {summary} of {len(candidates)} traces; fix the traces or set "
            "guidance.on_bad=skip to train without them (guidance.keep_incorrect=true keeps wrong ones)"
        )
    log.info("guidance=%s: %d traces kept for %d of %d problems", options.source, library.counts["kept"], len(library.traces), len(problems))
    if bad:
        log.warning("guidance=%s: left out %s (guidance.on_bad=skip)", options.source, summary)
    return library
