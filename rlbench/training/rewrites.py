"""CLPO's adaptive problem restructuring (Zhang et al. 2025, "CLPO: Curriculum Learning meets Policy Optimization
for LLM Reasoning", arXiv:2509.25004, section 3): the policy rewrites the step's problems by its own accuracy on them,
and the accepted rewrites are trained on (``prompt_sampler=clpo``, rlbench.training.curricula.ClpoPrompts). The
defaults follow the authors' release (github.com/csuking/CLPO @ cb77b56, verl/trainer/ppo/ray_trainer.py and
scripts/clpo_qwen3_8b.sh); today's earlier choices stay reachable by options (docs/replay.md).

After step s's rollout, for every dataset problem q of the step (G responses graded against its reference answer a):

    acc(q)    = #correct / G                                          (online difficulty, the paper's Acc(q, pi))
    bucket(q) = hard if acc <= hard_below, easy if acc > easy_above (``easy_strict``; else acc >= easy_above),
                medium between                                        (:func:`difficulty_bucket`; the release: 0.3, 0.7)
    for q in a designated bucket (``rewrite``: hard and medium), once per (uid, bucket) (``retry_after``):
        q'    <- the policy's one answer (``rewrite_temperature``, ``rewrite_tokens``: the release's 0.7 and 400) to the
                 bucket's template (:func:`rewrite_request`; ``show_answer``: the template states a, "do not reveal it"):
                 medium -> a variant (diversify), hard -> a simpler version (simplify), both with the same answer
        c     <- how many of the policy's ``verify_samples`` answers to q' the run's grader grades correct against a
        q' is accepted iff it is non-empty, differs from q and (:func:`accepted`)
              acceptance=mixed:      0 < c < verify_samples                      (the release's keep_mid_acc)
              acceptance=agreement:  c >= agreement * verify_samples             (rlbench's earlier rule)

Where the accepted rewrites go (``mixing``):
    same_step   (the release) the step trains on its dataset groups with 0 < acc < 1 (all-correct and all-wrong ones
                leave the loss), the other groups (auxiliary tasks), and the accepted rewrites' ``verify_samples``
                answers as groups of their own; a step left with nothing trains on all its groups
    next_steps  the pool (uid ``<q.uid>~clpo-<bucket>-<s>``): every later step draws ``aux_count(share, B)`` of its B
                prompts from it (uniformly, distinct within the step) and the rest from the dataset's problems

Every group the step trains on carries its curriculum label in its problem's meta (``clpo_bucket``: a dataset
problem's bucket of acc, a rewrite's origin bucket), which CLPO's dynamic KL reads (algorithm.kl.difficulty_scale,
rlbench.algorithm.kl.difficulty_kl_scale; :func:`response_labels`). Rewrites are never rewritten, never enter the
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


def difficulty_bucket(pass_rate: float, hard_below: float, easy_above: float, easy_strict: bool = False) -> str:
    """CLPO's online difficulty buckets: hard (p <= hard_below), easy (p >= easy_above, or p > easy_above when
    ``easy_strict``: the release's medium is 0.3 < acc <= 0.7), medium between."""
    if pass_rate <= hard_below:
        return "hard"
    return "easy" if pass_rate > easy_above or (pass_rate == easy_above and not easy_strict) else "medium"


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


ANSWER_RULE = ("The new problem must lead to the same correct answer as the original: {answer}. Do not reveal or "
               "suggest that answer in the new problem.")


def rewrite_request(problem: Problem, bucket: str, show_answer: bool = False) -> Problem:
    """The prompt the policy answers with a rewrite of ``problem``: its bucket's template and, with ``show_answer``,
    the reference answer it must keep without revealing it (the release's templates state {ANSWER} so)."""
    rule = " " + ANSWER_RULE.format(answer=problem.answer) if show_answer else ""
    return dataclasses.replace(problem, prompt=f"{TEMPLATES[bucket]}{rule}\n\nProblem: {problem.prompt}")


def rewritten_problem(origin: Problem, text: str, bucket: str, step: int) -> Problem:
    """The rewrite as a training problem: the policy's text (a leading "New problem:" label dropped), the origin's
    reference answer and meta (graded as the origin is), and its provenance (origin uid, bucket, step)."""
    return Problem(uid=f"{origin.uid}~clpo-{bucket}-{step}", prompt=_LABEL.sub("", text.strip(), count=1).strip(),
                   answer=origin.answer, meta={**origin.meta, ORIGIN_KEY: origin.uid, BUCKET_KEY: bucket, STEP_KEY: step})


def well_formed(origin: Problem, rewrite: Problem) -> bool:
    """A rewrite worth checking: non-empty and not the origin's statement itself."""
    return bool(rewrite.prompt) and rewrite.prompt != origin.prompt.strip()


ACCEPTANCE = ("mixed", "agreement")


def accepted(origin: Problem, rewrite: Problem, correct: Sequence[bool], agreement: float,
             acceptance: str = "agreement") -> bool:
    """The answer check of a well-formed rewrite from its answers by the policy (``correct``: each graded against
    the origin's reference answer; none given: rejected), c of k correct: ``mixed`` keeps it iff 0 < c < k (the
    release's keep_mid_acc: a rewrite whose group carries a learning signal), ``agreement`` iff c >= agreement * k."""
    c, k = sum(bool(x) for x in correct), len(correct)
    if not well_formed(origin, rewrite) or k == 0:
        return False
    return 0 < c < k if acceptance == "mixed" else c >= agreement * k


def response_labels(graded: GradedGroups) -> list[str | None]:
    """The curriculum label (``clpo_bucket`` of its problem's meta; None: unlabelled) of every response."""
    return [problem.meta.get(BUCKET_KEY) for problem, group in zip(graded.problems, graded.groups) for _ in group]


def group_verdicts(graded: GradedGroups) -> list[list[bool]]:
    """Each group's grader verdicts, in order."""
    correct, out, row = (graded.correct > 0).tolist(), [], 0
    for group in graded.groups:
        out.append(correct[row:row + len(group)])
        row += len(group)
    return out


class Rewriter(Protocol):
    """Who rewrites and answers the rewrites: the policy (:class:`PolicyRewriter`), or a test's mock."""

    def rewrite(self, requests: Sequence[Problem], generator: torch.Generator) -> list[str]: ...

    def solve(self, problems: Sequence[Problem], generator: torch.Generator) -> GradedGroups: ...


class PolicyRewriter:
    """The policy as CLPO's rewriter and checker, through the run's GroupSampler, so the calls count in the step's
    generation cost: one response of ``rewrite_tokens`` tokens per rewrite at ``rewrite_temperature`` (None: the
    run's temperature; top-p the run's, read at each call: a stage may change them), and ``verify_samples`` graded
    responses per rewrite with the run's sampling (None: rollout.n, read at each call; the groups a same-step mix
    trains on)."""

    def __init__(self, ctx: Any, rewrite_tokens: int, verify_samples: int | None, rewrite_temperature: float | None = None):
        self.ctx, self.rewrite_tokens, self.verify_samples = ctx, rewrite_tokens, verify_samples
        self.rewrite_temperature = rewrite_temperature

    def rewrite(self, requests: Sequence[Problem], generator: torch.Generator) -> list[str]:
        params = self.ctx.params
        temperature = params.temperature if self.rewrite_temperature is None else self.rewrite_temperature
        params = SamplingParams(temperature, params.top_p, self.rewrite_tokens)
        return [group[0].text for group in self.ctx.sampler.sample(list(requests), 1, params, generator)]

    def solve(self, problems: Sequence[Problem], generator: torch.Generator) -> GradedGroups:
        samples = self.verify_samples or self.ctx.strategy.setup.n
        return self.ctx.sampler(list(problems), samples, self.ctx.params, generator)


def group_accuracies(graded: GradedGroups) -> list[float | None]:
    """#correct / G of every dataset group of a step, None for the rest (rewrites, auxiliary tasks, empty groups)."""
    return [sum(verdicts) / len(verdicts) if verdicts and not is_rewrite(problem) and not is_aux_task(problem) else None
            for problem, verdicts in zip(graded.problems, group_verdicts(graded))]


def step_accuracies(graded: GradedGroups) -> list[tuple[Problem, float]]:
    """(problem, #correct / G) of every dataset group of a step (rewrites and auxiliary tasks left out), in order."""
    return [(problem, acc) for problem, acc in zip(graded.problems, group_accuracies(graded)) if acc is not None]


class RewritePool:
    """The accepted rewrites (newest last, at most ``capacity``; mixing=next_steps), the (uid, bucket) pairs attempted
    and when, the counters, and two seeded streams: the pool's draws (numpy) and the rewriter's sampling (torch).
    ``settings``: the sampler's options (rlbench.training.curricula.ClpoOptions: bucket(), rewrite, show_answer,
    acceptance, agreement, mixing, max_per_step, retry_after, capacity)."""

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
            bucket = s.bucket(acc)
            key = f"{problem.uid}|{bucket}"
            last = self.attempted.get(key)
            if bucket not in s.rewrite or key in seen or (last is not None and (s.retry_after == 0 or step - last < s.retry_after)):
                continue
            seen.add(key)
            out.append((problem, bucket))
        return out[: s.max_per_step] if s.max_per_step else out

    def observe(self, step: int, graded: GradedGroups, rewriter: Rewriter | None) -> GradedGroups:
        """After step ``step``'s rollout: rewrite its designated problems, check each rewrite, keep the accepted ones
        (the pool, or this step's batch: ``mixing``). Returns the groups the step trains on, labelled
        (:meth:`trained_groups`)."""
        s = self.settings
        todo = self.candidates(step, graded)
        solved, kept = None, []  # the rewrites' graded answers, the positions in them of the accepted ones
        if todo:
            if rewriter is None:
                raise RuntimeError("RewritePool.observe before the sampler was bound to the run (ClpoPrompts.bind)")
            texts = rewriter.rewrite([rewrite_request(p, b, s.show_answer) for p, b in todo], self.generator)
            proposals = [rewritten_problem(p, text, b, step) for (p, b), text in zip(todo, texts)]
            checked = [i for i, (q, (p, _)) in enumerate(zip(proposals, todo)) if well_formed(p, q)]
            solved = rewriter.solve([proposals[i] for i in checked], self.generator) if checked else None
            verdicts = dict(zip(checked, group_verdicts(solved))) if checked else {}
            for i, ((origin, bucket), proposal) in enumerate(zip(todo, proposals)):
                self.attempted[f"{origin.uid}|{bucket}"] = step
                if accepted(origin, proposal, verdicts.get(i, []), s.agreement, s.acceptance):
                    kept.append(checked.index(i))
                    if s.mixing == "next_steps":
                        self.items.append(proposal)
        trained = self.trained_groups(graded, solved, kept)
        shown = len(trained.problems)
        self.last = {"clpo_rewritten_share": sum(map(is_rewrite, trained.problems)) / shown if shown else 0.0,
                     "clpo_trained_groups": float(shown)}
        for key, count in (("attempted", len(todo)), ("accepted", len(kept)), ("rejected", len(todo) - len(kept))):
            self.totals[key] += count
            self.last[f"clpo_rewrites_{key}"] = float(count)
        return trained

    def trained_groups(self, graded: GradedGroups, solved: GradedGroups | None, kept: Sequence[int]) -> GradedGroups:
        """The step's groups, each dataset problem labelled with its bucket (``clpo_bucket`` in a copy of its meta; a
        rewrite keeps its origin's); with mixing=same_step only the dataset groups with 0 < acc < 1 and the rest
        (auxiliary tasks, rewrites), followed by the accepted rewrites' groups ``kept`` of ``solved`` (new group ids);
        a step left with no group keeps all of its own (as the release does)."""
        accuracies = group_accuracies(graded)
        problems = [problem if acc is None else dataclasses.replace(problem, meta={**problem.meta, BUCKET_KEY: self.settings.bucket(acc)})
                    for problem, acc in zip(graded.problems, accuracies)]
        labelled = dataclasses.replace(graded, problems=problems)
        if self.settings.mixing == "next_steps":
            return labelled
        own = labelled.select([g for g, acc in enumerate(accuracies) if acc is None or 0 < acc < 1])
        parts = [own] + ([solved.select(list(kept)).with_group_ids(max(graded.group_ids, default=-1) + 1)] if kept else [])
        mixed = GradedGroups.concat(parts)
        return mixed if mixed.groups else labelled

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
