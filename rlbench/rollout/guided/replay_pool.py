"""RLEP's two-phase experience pool (Zhang et al. 2025, arXiv:2507.07451, section 2): phase 1 collects the
verified successes per question into a pool file; phase 2 restarts from the base model and replays only
them (``rollout.replay.pool``), so the replay buffer does not fill online.

Phase 1, the paper's way: train once, then sample the run's final policy on the training questions and keep
the responses the grader accepts (``rlbench mode=generate model=checkpoint model.path=<run>/policy
rollout=replay_rlep_collect rollout.replay.pool_save=<file>``, rlbench/guidance/generate.py): one pass,
``rollout.n`` samples per question, a question without a success left out. Phase 1 as a training run
(``rollout=replay_rlep_collect`` with ``mode=train``): after every rollout the graded fresh responses that
the grader marked correct are added (the newest ``pool_per_question`` of each question are kept) and the
whole pool is written atomically (rlbench.utils.atomic_write_json), so a killed run leaves the pool of its
last finished rollout. Both write with :class:`SuccessPool`; phase 2 reads with :func:`read_pool`.

The file (JSON, ``format`` :data:`POOL_FORMAT`)::

    format      "rlbench-replay-pool/1"
    model       the tokenizer's name_or_path when it was collected (informative)
    tokenizer   a fingerprint of the tokenizer's vocabulary (sha256 of the sorted token -> id map), or null
    datasets    the "<dataset>/<split>" prefixes of its question uids, e.g. ["arith/train"]
    rollouts    how many rollouts fed it (1 for a checkpoint's sampling)
    questions   uid -> {prompt, answer, meta, accuracy (the latest fresh accuracy), responses: [stored response,
                each rlbench.rollout.guided.replay.ReplayItem's fields: prompt_ids, response_ids, logprobs
                (the sampling policy's), finished, text, policy_version (the rollout's index; 0 for a
                checkpoint's sampling; phase 2 replays every response as version -1)]}

Phase 2 refuses a pool that does not belong to the run before the model loads
(:func:`check_pool_questions`, called by rlbench.validation): every question of the pool must be a
training problem of this run with the same text and reference answer. When the strategy is built it
refuses a pool collected with another tokenizer (:func:`check_pool_tokenizer`), and while replaying a
response sampled under another prompt (its prompt token ids differ from the fresh responses').
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError
from rlbench.utils import atomic_write_json, tokenizer_fingerprint

if TYPE_CHECKING:  # a type only: replay.py imports this module
    from rlbench.rollout.guided.replay import ReplayItem

POOL_FORMAT = "rlbench-replay-pool/1"


def dataset_of(uid: str) -> str:
    """The ``<dataset>/<split>`` prefix of a problem uid (``arith/train/12`` -> ``arith/train``)."""
    return uid.rsplit("/", 1)[0] if "/" in uid else uid


class SuccessPool:
    """Phase 1: the verified successes of a run per question, written to ``path`` after every rollout."""

    def __init__(self, path: str | Path, per_question: int, tokenizer: Any) -> None:
        self.path, self.per_question = Path(path), int(per_question)
        self.model = str(getattr(tokenizer, "name_or_path", "") or "")
        self.tokenizer = tokenizer_fingerprint(tokenizer)
        self.questions: dict[str, dict[str, Any]] = {}
        self.rollouts = 0

    def add(self, problem: Problem, successes: Sequence[ReplayItem], accuracy: float) -> None:
        """Record one question's fresh accuracy and its verified successes (the newest ``per_question`` stay);
        a question enters with its first success."""
        if not successes and problem.uid not in self.questions:
            return
        entry = self.questions.setdefault(
            problem.uid, {"prompt": problem.prompt, "answer": problem.answer, "meta": problem.meta, "responses": []})
        entry["accuracy"] = float(accuracy)
        entry["responses"] = (entry["responses"] + [dataclasses.asdict(item) for item in successes])[-self.per_question:]

    def write(self) -> None:
        self.rollouts += 1
        atomic_write_json(self.path, self.state_dict())

    def state_dict(self) -> dict[str, Any]:
        return {
            "format": POOL_FORMAT, "model": self.model, "tokenizer": self.tokenizer, "rollouts": self.rollouts,
            "datasets": sorted({dataset_of(uid) for uid in self.questions}), "questions": self.questions,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.questions, self.rollouts = state["questions"], int(state["rollouts"])


QUESTION_KEYS = ("prompt", "answer", "meta", "accuracy", "responses")
RESPONSE_KEYS = ("prompt_ids", "response_ids", "logprobs", "finished", "text", "policy_version")


def malformed(pool: dict[str, Any]) -> str | None:
    """What a pool of the right format lacks (a question's or a stored response's key); None when it is whole."""
    top = [key for key in ("model", "tokenizer", "datasets", "rollouts", "questions") if key not in pool]
    if top:
        return f"it lacks {', '.join(top)}"
    questions = pool["questions"]
    if not isinstance(questions, dict):
        return "'questions' must map each question uid to its entry"
    for uid, entry in questions.items():
        missing = [key for key in QUESTION_KEYS if not isinstance(entry, dict) or key not in entry]
        if missing or not isinstance(entry["responses"], list):
            return f"question {uid} lacks {', '.join(missing) or 'a responses list'}"
        for response in entry["responses"]:
            lacks = [key for key in RESPONSE_KEYS if not isinstance(response, dict) or key not in response]
            if lacks:
                return f"a response of question {uid} lacks {', '.join(lacks)}"
    return None


def read_pool(path: str | Path, key: str = "rollout.replay.pool") -> dict[str, Any]:
    """The pool file at ``path``; ConfigError when it is missing or not a pool. ``key``: the option that
    named it (RLEP's ``rollout.replay.pool``, DART's ``rollout.difficulty_adaptive.pool``), for the messages."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{key}={path}: no such file (write one by sampling a policy: "
                          "mode=generate [model=checkpoint model.path=<run>/policy] rollout=replay_rlep_collect "
                          "rollout.replay.pool_save=<file>, docs/replay.md)")
    try:
        pool = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"{key}={path} is not a readable JSON pool: {err}") from None
    if not isinstance(pool, dict) or pool.get("format") != POOL_FORMAT:
        found = pool.get("format") if isinstance(pool, dict) else type(pool).__name__
        raise ConfigError(f"{key}={path} has format {found!r}, not {POOL_FORMAT!r} "
                          "(written by rollout.replay.pool_save)")
    if (problem := malformed(pool)) is not None:
        raise ConfigError(f"{key}={path} is malformed: {problem} (write it with rollout.replay.pool_save)")
    if not pool["questions"]:
        raise ConfigError(f"{key}={path} holds no verified success: the sampled policy solved nothing")
    return pool


def check_pool_questions(path: str | Path, problems: Sequence[Problem], key: str = "rollout.replay.pool") -> None:
    """Refuse a pool whose questions are not this run's training problems (another dataset, split,
    seed of a generated set, or edited file): every pool uid must be a problem here with the same
    prompt and reference answer."""
    pool = read_pool(path, key)
    here = {p.uid: p for p in problems}
    bad = [uid for uid, entry in pool["questions"].items()
           if uid not in here or (here[uid].prompt, here[uid].answer) != (entry["prompt"], entry["answer"])]
    if not bad:
        return
    uid = bad[0]
    entry = pool["questions"][uid]
    found = ("it is not among this run's problems" if uid not in here else
             f"here it is {here[uid].prompt!r} (answer {here[uid].answer!r}), in the pool {entry['prompt']!r} "
             f"(answer {entry['answer']!r})")
    datasets = sorted({dataset_of(p.uid) for p in problems})
    raise ConfigError(
        f"{key}={path} was collected on {', '.join(pool['datasets'])} (model {pool['model'] or '?'}), "
        f"but this run trains on {', '.join(datasets) or 'no problems'}: {len(bad)} of its {len(pool['questions'])} "
        f"questions do not match (first: {uid}: {found}). Collect the pool with this run's dataset settings "
        f"(dataset, split, arith.level and seed) or drop {key}"
    )


def check_pool_tokenizer(path: str | Path, pool: dict[str, Any], tokenizer: Any, key: str = "rollout.replay.pool") -> None:
    """Refuse a pool whose token ids come from another tokenizer (the fingerprints differ)."""
    mine = tokenizer_fingerprint(tokenizer)
    if pool["tokenizer"] is not None and mine is not None and pool["tokenizer"] != mine:
        model = str(getattr(tokenizer, "name_or_path", "") or "?")
        raise ConfigError(f"{key}={path} was collected with the tokenizer of {pool['model'] or '?'}, "
                          f"whose vocabulary differs from this run's ({model}): its token ids mean other text here")
