"""CLPO's adaptive problem restructuring (Zhang et al. 2025, "CLPO: Curriculum Learning meets Policy Optimization
for LLM Reasoning", arXiv:2509.25004, section 3): the policy rewrites the step's problems by its own accuracy on them,
and later batches mix the accepted rewrites with the dataset's problems (``prompt_sampler=clpo``,
rlbench.training.curricula.ClpoPrompts).

After step s, for every dataset problem q of the step's rollouts (G responses graded against its reference answer a):

    acc(q)    = #correct / G                                          (online difficulty, the paper's Acc(q, pi))
    bucket(q) = hard if acc <= hard_below, easy if acc >= easy_above, else medium       (:func:`difficulty_bucket`)
    for q in a designated bucket (``rewrite``: hard and medium), once per (uid, bucket) (``retry_after``):
        q'    <- the policy's one answer to the bucket's template (:func:`rewrite_request`): medium -> a variant
                 (diversify), hard -> a simpler version (simplify), both with the same answer
        c     <- how many of the policy's ``verify_samples`` answers to q' the run's grader grades correct against a
        q' is accepted iff it is non-empty, differs from q and c >= agreement * verify_samples   (:func:`accepted`)
    accepted q' -> the pool (uid ``<q.uid>~clpo-<bucket>-<s>``, answer a, provenance in its meta)

Every later step draws ``aux_count(share, B)`` of its B prompts from the pool (uniformly, distinct within the step; a
pool smaller than that gives what it has) and the rest from the dataset's problems. The answer check is this
module's choice (the paper's own acceptance rule was not read; docs/replay.md): a rewrite is kept only when the policy
itself, answering it, agrees with the original reference answer. Rewrites are never rewritten, never enter the
evaluation (which reads the benchmark's own problems) and are drawn only by the sampler that made them; the pool,
the attempts, the counters and both random streams are in the checkpoint, so a resumed run equals an uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import re
from collections import deque
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import torch

from rlbench.dataset.base import Problem
from rlbench.reward.judge_tasks import is_aux_task
from rlbench.rollout.engines.base import SamplingParams
from rlbench.rollout.groups import GradedGroups
from rlbench.utils import STREAM_CLPO_REWRITES, make_generator

BUCKETS = ("hard", "medium", "easy")
ORIGIN_KEY, BUCKET_KEY, STEP_KEY = "clpo_origin", "clpo_bucket", "clpo_step"  # a rewrite's provenance, in its meta


def difficulty_bucket(pass_rate: float, hard_below: float, easy_above: float) -> str:
    """CLPO's online difficulty buckets: hard (p <= hard_below), easy (p >= easy_above), medium between."""
    if pass_rate <= hard_below:
        return "hard"
    return "easy" if pass_rate >= easy_above else "medium"


def is_rewrite(problem: Problem) -> bool:
    return ORIGIN_KEY in problem.meta


TEMPLATES = {
    "medium": ("Rewrite the problem below as a new variant of it: change its wording and its setting, but keep every "
               "quantity and relation it needs, so that its answer stays exactly the same. Write only the new problem."),
    "hard": ("Rewrite the problem below as a simpler version of it that is easier to solve: state it more plainly, "
             "split it into smaller steps or add a helpful hint, but keep it asking for the same final answer. "
             "Write only the new problem."),
}
_LABEL = re.compile(r"^\s*(?:new |simpler |rewritten )?(?:problem|version|variant)\s*:\s*", re.IGNORECASE)


def rewrite_request(problem: Problem, bucket: str) -> Problem:
    """The prompt the policy answers with a rewrite of ``problem`` (its bucket's template; the answer is not shown)."""
    return dataclasses.replace(problem, prompt=f"{TEMPLATES[bucket]}\n\nProblem: {problem.prompt}")


def rewritten_problem(origin: Problem, text: str, bucket: str, step: int) -> Problem:
    """The rewrite as a training problem: the policy's text (a leading "New problem:" label dropped), the origin's
    reference answer and meta (graded as the origin is), and its provenance (origin uid, bucket, step)."""
    return Problem(uid=f"{origin.uid}~clpo-{bucket}-{step}", prompt=_LABEL.sub("", text.strip(), count=1).strip(),
                   answer=origin.answer, meta={**origin.meta, ORIGIN_KEY: origin.uid, BUCKET_KEY: bucket, STEP_KEY: step})


def well_formed(origin: Problem, rewrite: Problem) -> bool:
    """A rewrite worth checking: non-empty and not the origin's statement itself."""
    return bool(rewrite.prompt) and rewrite.prompt != origin.prompt.strip()


def accepted(origin: Problem, rewrite: Problem, correct: Sequence[bool], agreement: float) -> bool:
    """The answer check: a well-formed rewrite whose answers by the policy (``correct``: each graded against the
    origin's reference answer) are correct at least ``agreement`` of the time (none given: rejected)."""
    return well_formed(origin, rewrite) and len(correct) > 0 and sum(bool(c) for c in correct) >= agreement * len(correct)


class Rewriter(Protocol):
    """Who rewrites and answers the rewrites: the policy (:class:`PolicyRewriter`), or a test's mock."""

    def rewrite(self, requests: Sequence[Problem], generator: torch.Generator) -> list[str]: ...

    def solve(self, problems: Sequence[Problem], generator: torch.Generator) -> list[list[bool]]: ...


class PolicyRewriter:
    """The policy as CLPO's rewriter and checker, through the run's GroupSampler with the run's sampling (its
    temperature and top-p, read at each call: a stage may change them), so the calls count in the step's generation
    cost: one response of ``rewrite_tokens`` tokens per rewrite, ``verify_samples`` graded responses per rewrite."""

    def __init__(self, ctx: Any, rewrite_tokens: int, verify_samples: int):
        self.ctx, self.rewrite_tokens, self.verify_samples = ctx, rewrite_tokens, verify_samples

    def rewrite(self, requests: Sequence[Problem], generator: torch.Generator) -> list[str]:
        params = self.ctx.params
        params = SamplingParams(params.temperature, params.top_p, self.rewrite_tokens)
        return [group[0].text for group in self.ctx.sampler.sample(list(requests), 1, params, generator)]

    def solve(self, problems: Sequence[Problem], generator: torch.Generator) -> list[list[bool]]:
        graded = self.ctx.sampler(list(problems), self.verify_samples, self.ctx.params, generator)
        return (graded.correct > 0).view(len(problems), self.verify_samples).tolist()


def step_accuracies(graded: GradedGroups) -> list[tuple[Problem, float]]:
    """(problem, #correct / G) of every dataset group of a step (rewrites and auxiliary tasks left out), in order."""
    correct = (graded.correct > 0).tolist()
    out, row = [], 0
    for problem, group in zip(graded.problems, graded.groups):
        if not is_rewrite(problem) and not is_aux_task(problem) and group:
            out.append((problem, sum(correct[row:row + len(group)]) / len(group)))
        row += len(group)
    return out


class RewritePool:
    """The accepted rewrites (newest last, at most ``capacity``), the (uid, bucket) pairs attempted and when, the
    counters, and two seeded streams: the pool's draws (numpy) and the rewriter's sampling (torch). ``settings``: the
    sampler's options (rlbench.training.curricula.ClpoOptions: hard_below, easy_above, rewrite, agreement,
    max_per_step, retry_after, capacity)."""

    def __init__(self, settings: Any, seed: int):
        self.settings = settings
        self.items: deque[Problem] = deque(maxlen=settings.capacity)
        self.attempted: dict[str, int] = {}  # "<uid>|<bucket>" -> the step of its last attempt
        self.rng = np.random.default_rng([seed, STREAM_CLPO_REWRITES])
        self.generator = make_generator(seed, STREAM_CLPO_REWRITES)
        self.totals = {"attempted": 0, "accepted": 0, "rejected": 0, "drawn": 0}
        self.last: dict[str, float] = {}

    def take(self, wanted: int) -> list[Problem]:
        """Up to ``wanted`` distinct rewrites, drawn uniformly; they stay in the pool."""
        count = min(wanted, len(self.items))
        picks = sorted(self.rng.choice(len(self.items), size=count, replace=False).tolist()) if count else []
        self.totals["drawn"] += count
        return [self.items[i] for i in picks]

    def candidates(self, step: int, graded: GradedGroups) -> list[tuple[Problem, str]]:
        """The step's (problem, bucket) to rewrite: dataset problems in a designated bucket whose (uid, bucket) was
        never attempted (or, with retry_after > 0, not within the last retry_after steps), first occurrence only,
        in batch order, at most max_per_step (0: all)."""
        s, out, seen = self.settings, [], set()
        for problem, acc in step_accuracies(graded):
            bucket = difficulty_bucket(acc, s.hard_below, s.easy_above)
            key = f"{problem.uid}|{bucket}"
            last = self.attempted.get(key)
            if bucket not in s.rewrite or key in seen or (last is not None and (s.retry_after == 0 or step - last < s.retry_after)):
                continue
            seen.add(key)
            out.append((problem, bucket))
        return out[: s.max_per_step] if s.max_per_step else out

    def observe(self, step: int, graded: GradedGroups, rewriter: Rewriter | None) -> None:
        """After step ``step``: rewrite its designated problems, check each rewrite, keep the accepted ones."""
        shown = len(graded.problems)
        self.last = {"clpo_rewritten_share": sum(map(is_rewrite, graded.problems)) / shown if shown else 0.0}
        todo = self.candidates(step, graded)
        accepted_count = 0
        if todo:
            if rewriter is None:
                raise RuntimeError("RewritePool.observe before the sampler was bound to the run (ClpoPrompts.bind)")
            texts = rewriter.rewrite([rewrite_request(p, b) for p, b in todo], self.generator)
            proposals = [rewritten_problem(p, text, b, step) for (p, b), text in zip(todo, texts)]
            checked = [i for i, (q, (p, _)) in enumerate(zip(proposals, todo)) if well_formed(p, q)]
            verdicts = dict(zip(checked, rewriter.solve([proposals[i] for i in checked], self.generator))) if checked else {}
            for i, ((origin, bucket), proposal) in enumerate(zip(todo, proposals)):
                self.attempted[f"{origin.uid}|{bucket}"] = step
                if accepted(origin, proposal, verdicts.get(i, []), self.settings.agreement):
                    self.items.append(proposal)
                    accepted_count += 1
        rejected = len(todo) - accepted_count
        for key, count in (("attempted", len(todo)), ("accepted", accepted_count), ("rejected", rejected)):
            self.totals[key] += count
            self.last[f"clpo_rewrites_{key}"] = float(count)

    def metrics(self) -> dict[str, float]:
        """The step's rewrites attempted / accepted / rejected, the share of the step's groups that were rewrites,
        the pool's size and the run's totals."""
        return {**self.last, "clpo_rewrite_pool": float(len(self.items)),
                **{f"clpo_rewrites_{key}_total": float(value) for key, value in self.totals.items()}}

    def state_dict(self) -> dict[str, Any]:
        return {"items": [dataclasses.asdict(p) for p in self.items], "attempted": dict(self.attempted),
                "rng": self.rng.bit_generator.state, "generator": self.generator.get_state(), "totals": dict(self.totals)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.items = deque((Problem(**p) for p in state["items"]), maxlen=self.settings.capacity)
        self.attempted = {str(k): int(v) for k, v in state["attempted"].items()}
        self.rng.bit_generator.state = state["rng"]
        self.generator.set_state(state["generator"])
        self.totals = {str(k): int(v) for k, v in state["totals"].items()}
