"""Composed rewards: a response's reward is a weighted sum of named terms (``reward.terms``, term ->
weight; docs/judges.md). The default ``{grader: 1.0}`` is the grader's reward alone, so a run with a
single grader is the one-term case of the same composition. Each term's mean is logged under its own
name (``reward_term_<name>``).

Terms (:data:`TERMS`):

* ``grader``: the grader's reward (rlbench.reward.graders: math, code, even_tokens);
* ``format``: 1 when the grader found an answer in the expected format (refused beside the math
  grader's own ``format_weight``: one way to weigh the format);
* ``pairwise_rl``: Pairwise-RL (arXiv:2504.04950, the pairwise PPO's reward): the win probability against the group's anchor,
  position-swap averaged, ``r(y) = ½[P(y ≻ y_ref) + 1 − P(y_ref ≻ y)]``; the anchor itself gets ½;
* ``brpo``: BRPO (Writing-Zero, arXiv:2506.00103, the BRPO algorithm): per group and step a reference response k
  drawn uniformly (seeded by the run seed, the step and the group), ``s_i = ±1`` as the judge prefers
  y_i or y_k (swap averaged; 0 on a tie), 0 for the reference;
* ``fapo``: FAPO (arXiv:2510.22543, the flawed-positive penalty): the judge checks the *correct* responses only; a flawed one
  gets −1, so with outcomes ±1 and weights ``{grader: 1, fapo: 1}`` a flawed positive is rewarded 0
  (``R_FAPO = R_RLVR − λ·1[flawed]``, λ = the term's weight).
* ``xml_count``, ``soft_format``, ``strict_format``: MOTIF's format rewards of a
  ``<reasoning>``/``<answer>`` response (arXiv:2507.02851, its released code; rlbench.reward.xml_format):
  partial credit 1/8 per correctly placed tag less 1/1000 per character after ``</answer>``; 1 when the
  response starts with a reasoning then an answer block; 1 when it is exactly the two blocks, one tag a line.

A judge verdict that failed (rlbench.reward.judges: unparseable, over budget) gives the term's
``failure_reward`` (null: the term's neutral value, ½ for pairwise_rl, 0 for brpo and fapo),
counted per term (``reward_term_<name>_failed``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from rlbench.errors import ConfigError
from rlbench.reward.judges import Judge, PairItem, PointItem, Verdict
from rlbench.reward.math import Grade
from rlbench.reward.xml_format import soft_format, strict_format, xml_count

DEFAULT_TERMS = {"grader": 1.0}


@dataclass
class TermInputs:
    """What a term reads, per response (flat, group after group) unless said otherwise.

    questions / references: the problem statement and reference answer of each response's prompt;
    texts: the responses; grades: the grader's; group_index [B]: each response's group (0..G-1);
    step: the composition's call count (the seeds of brpo's draws); seed: the run seed."""

    questions: list[str]
    references: list[str]
    texts: list[str]
    grades: list[Grade]
    group_index: torch.Tensor
    step: int
    seed: int


@dataclass
class TermValues:
    """A term's value per response and which of them are a failed verdict's default."""

    values: torch.Tensor
    failed: torch.Tensor


def _members(inputs: TermInputs) -> list[list[int]]:
    groups = int(inputs.group_index.max().item()) + 1 if len(inputs.group_index) else 0
    return [(inputs.group_index == g).nonzero(as_tuple=True)[0].tolist() for g in range(groups)]


def swap_averaged(judge: Judge, inputs: TermInputs, pairs: Sequence[tuple[int, int]]) -> list[Verdict]:
    """½[P(y_i ≻ y_j) + 1 − P(y_j ≻ y_i)] for each (i, j): the judge asked in both orders (one batch),
    so a judge's position bias cancels; None when either order failed."""
    t, q = inputs.texts, inputs.questions
    items = [PairItem(q[i], t[i], t[j]) for i, j in pairs] + [PairItem(q[i], t[j], t[i]) for i, j in pairs]
    verdicts = judge.prefer(items) if items else []
    forward, backward = verdicts[: len(pairs)], verdicts[len(pairs):]
    return [None if a is None or b is None else 0.5 * (a + 1.0 - b) for a, b in zip(forward, backward)]


def grader_term(inputs: TermInputs, judge: Judge | None, failure: float | None) -> TermValues:
    values = torch.tensor([g.reward for g in inputs.grades], dtype=torch.float32)
    return TermValues(values, torch.zeros(len(values), dtype=torch.bool))


def format_term(inputs: TermInputs, judge: Judge | None, failure: float | None) -> TermValues:
    values = torch.tensor([float(g.format_ok) for g in inputs.grades], dtype=torch.float32)
    return TermValues(values, torch.zeros(len(values), dtype=torch.bool))


def pairwise_rl_term(inputs: TermInputs, judge: Judge | None, failure: float | None) -> TermValues:
    """Pairwise-RL: each response against its group's anchor (the group's first response)."""
    values = torch.full((len(inputs.texts),), 0.5)
    failed = torch.zeros(len(inputs.texts), dtype=torch.bool)
    pairs = [(i, members[0]) for members in _members(inputs) for i in members[1:]]
    for (i, _), reward in zip(pairs, swap_averaged(judge, inputs, pairs)):
        failed[i] = reward is None
        values[i] = (0.5 if failure is None else failure) if reward is None else reward
    return TermValues(values, failed)


def brpo_reference(seed: int, step: int, group: int, size: int) -> int:
    """BRPO's bootstrapped reference of one group at one step: uniform over the group, seeded by
    (run seed, step, group), so it changes across steps and repeats with the seed."""
    return int(np.random.default_rng([int(seed), int(step), int(group)]).integers(size))


def brpo_term(inputs: TermInputs, judge: Judge | None, failure: float | None) -> TermValues:
    """BRPO: s_i = +1 when the judge prefers y_i to the group's bootstrapped reference, −1 when it
    prefers the reference, 0 on a tie and for the reference itself."""
    values = torch.zeros(len(inputs.texts))
    failed = torch.zeros(len(inputs.texts), dtype=torch.bool)
    pairs = []
    for g, members in enumerate(_members(inputs)):
        k = members[brpo_reference(inputs.seed, inputs.step, g, len(members))]
        pairs += [(i, k) for i in members if i != k]
    for (i, _), p in zip(pairs, swap_averaged(judge, inputs, pairs)):
        failed[i] = p is None
        values[i] = (0.0 if failure is None else failure) if p is None else float(np.sign(p - 0.5))
    return TermValues(values, failed)


def fapo_term(inputs: TermInputs, judge: Judge | None, failure: float | None, sees_reference: bool = False) -> TermValues:
    """FAPO: −1 for a correct response the judge flags as flawed (P(flawed) > ½); only correct
    responses are sent to the judge."""
    values = torch.zeros(len(inputs.texts))
    failed = torch.zeros(len(inputs.texts), dtype=torch.bool)
    positives = [i for i, g in enumerate(inputs.grades) if g.correct]
    items = [
        PointItem(inputs.questions[i], inputs.texts[i], inputs.references[i] if sees_reference else None)
        for i in positives
    ]
    for i, p in zip(positives, judge.flag(items) if items else []):
        failed[i] = p is None
        values[i] = (0.0 if failure is None else failure) if p is None else -float(p > 0.5)
    return TermValues(values, failed)


def text_values(inputs: TermInputs, score: Callable[[str], float]) -> TermValues:
    """``score`` of each response's text (a term that needs no grade and no judge)."""
    values = torch.tensor([score(t) for t in inputs.texts], dtype=torch.float32)
    return TermValues(values, torch.zeros(len(values), dtype=torch.bool))


def xml_count_term(inputs: TermInputs, judge: Judge | None, failure: float | None) -> TermValues:
    """MOTIF (arXiv:2507.02851): 1/8 per correctly placed tag, less 1/1000 per character after ``</answer>``
    (:func:`rlbench.reward.xml_format.xml_count`; at most 0.5)."""
    return text_values(inputs, xml_count)


def soft_format_term(inputs: TermInputs, judge: Judge | None, failure: float | None) -> TermValues:
    """MOTIF (arXiv:2507.02851): 1 when the response starts ``<reasoning>…</reasoning> <answer>…</answer>``
    (:func:`rlbench.reward.xml_format.soft_format`)."""
    return text_values(inputs, soft_format)


def strict_format_term(inputs: TermInputs, judge: Judge | None, failure: float | None) -> TermValues:
    """MOTIF (arXiv:2507.02851): 1 when the response is exactly the two blocks, one tag a line
    (:func:`rlbench.reward.xml_format.strict_format`)."""
    return text_values(inputs, strict_format)


TermFunction = Callable[..., TermValues]
TERMS: dict[str, TermFunction] = {
    "grader": grader_term,
    "format": format_term,
    "pairwise_rl": pairwise_rl_term,
    "brpo": brpo_term,
    "fapo": fapo_term,
    "xml_count": xml_count_term,
    "soft_format": soft_format_term,
    "strict_format": strict_format_term,
}
JUDGE_TERMS = frozenset({"pairwise_rl", "brpo", "fapo"})


def check_reward_terms(weights: Mapping[str, Any], has_judge: bool, format_weight: float = 0.0) -> None:
    """ConfigError for unknown terms, a non-numeric weight, a judge term without ``reward.judge``,
    and ``format`` beside the math grader's ``format_weight`` (before anything is loaded)."""
    if not weights:
        raise ConfigError("reward.terms is empty; the default is {grader: 1.0}")
    unknown = sorted(set(weights) - set(TERMS))
    if unknown:
        raise ConfigError(f"reward.terms: unknown term(s) {unknown}; choose from {sorted(TERMS)}")
    for name, weight in weights.items():
        if isinstance(weight, bool) or not isinstance(weight, (int, float)):
            raise ConfigError(f"reward.terms.{name}={weight!r}: a weight is a number")
    needs = sorted(JUDGE_TERMS & {name for name, w in weights.items() if w != 0})
    if needs and not has_judge:
        raise ConfigError(f"reward.terms {needs} ask a judge and reward.judge is null; add one with "
                          "+reward/judge=default (then reward.judge.kind=scripted | policy | frozen | model), or choose "
                          "reward=fapo | pairwise_rl | brpo")
    if weights.get("format", 0) != 0 and format_weight != 0:
        raise ConfigError("reward.terms.format and reward.format_weight both weigh the answer format; use one "
                          "(set reward.format_weight=0)")


PAIRWISE_TERMS = frozenset({"pairwise_rl", "brpo"})
POINTWISE_TERMS = frozenset({"fapo"})
PAIRWISE_RULES = frozenset({"shorter", "longer"})


def check_reward_config(reward: Any) -> None:
    """Every check of ``reward.terms`` and ``reward.judge`` (a typed rlbench.config.schema.RewardConfig):
    :func:`check_reward_terms`, a scripted rule or a model verdict (step_index is pointwise) that answers the
    terms' questions (pairwise or pointwise), and kind=model with its model."""
    judge = reward.judge
    check_reward_terms(reward.terms, judge is not None, reward.format_weight)
    if judge is None:
        return
    used = {name for name, weight in reward.terms.items() if weight != 0}
    if judge.kind == "scripted":
        pairwise = judge.rule in PAIRWISE_RULES
        wrong = sorted(used & (POINTWISE_TERMS if pairwise else PAIRWISE_TERMS))
        if wrong:
            kind = "pairwise" if pairwise else "pointwise"
            raise ConfigError(f"reward.judge.rule={judge.rule} is a {kind} rule and reward.terms {wrong} ask the other "
                              "kind of question; choose " + ("bare_answer" if pairwise else "shorter or longer"))
    pairwise_used = sorted(used & PAIRWISE_TERMS)
    if judge.kind != "scripted" and judge.verdict == "step_index" and pairwise_used:
        raise ConfigError(f"reward.judge.verdict=step_index (FAPO's GenRM: the earliest wrong step of one response) asks "
                          f"a pointwise question and reward.terms {pairwise_used} ask a pairwise one; choose "
                          "verdict=probability or label")
    if judge.kind == "model" and judge.model is None:
        raise ConfigError("reward.judge.kind=model needs the judge's model: +model@reward.judge.model=<option> (e.g. tiny)")


class RewardComposer:
    """The weighted sum of the terms, with the judge they share. ``__call__`` grades one batch of groups;
    :meth:`take` returns the step's term means and judge counts (and starts the judge's next step)."""

    def __init__(
        self,
        weights: Mapping[str, float] | None = None,
        judge: Judge | None = None,
        failure_reward: float | None = None,
        seed: int = 0,
        sees_reference: bool = False,
    ) -> None:
        self.weights = dict(DEFAULT_TERMS if weights is None else weights)
        check_reward_terms(self.weights, judge is not None)
        self.judge, self.failure_reward, self.seed = judge, failure_reward, int(seed)
        self.sees_reference = bool(sees_reference)
        self.calls = 0
        self._sums: dict[str, float] = {}
        self._failed: dict[str, int] = {}
        self._count = 0

    def __call__(
        self, problems: Sequence[Any], texts: Sequence[Sequence[str]], grades: Sequence[Grade]
    ) -> torch.Tensor:
        """[B] rewards of the responses ``texts[g]`` to ``problems[g]`` (``grades`` flat, group after group)."""
        sizes = [len(group) for group in texts]
        inputs = TermInputs(
            questions=[p.prompt for p, n in zip(problems, sizes) for _ in range(n)],
            references=[p.answer for p, n in zip(problems, sizes) for _ in range(n)],
            texts=[t for group in texts for t in group],
            grades=list(grades),
            group_index=torch.arange(len(sizes)).repeat_interleave(torch.tensor(sizes, dtype=torch.long)),
            step=self.calls,
            seed=self.seed,
        )
        self.calls += 1
        total = torch.zeros(len(inputs.texts))
        for name, weight in self.weights.items():
            extra = {"sees_reference": self.sees_reference} if name == "fapo" else {}
            term = TERMS[name](inputs, self.judge, self.failure_reward, **extra)
            total = total + weight * term.values  # {grader: 1.0}: exactly the grader's rewards
            self._sums[name] = self._sums.get(name, 0.0) + float(term.values.sum())
            self._failed[name] = self._failed.get(name, 0) + int(term.failed.sum())
        self._count += len(inputs.texts)
        return total

    def take(self) -> dict[str, float]:
        """``reward_term_<name>`` (mean over the responses composed since the last take) and, for the
        judge terms, ``reward_term_<name>_failed``; the judge's counts; then the judge's budgets restart."""
        out: dict[str, float] = {}
        if self._count:
            for name, total in self._sums.items():
                out[f"reward_term_{name}"] = total / self._count
                if name in JUDGE_TERMS:
                    out[f"reward_term_{name}_failed"] = float(self._failed[name])
        if self.judge is not None:
            out.update(self.judge.stats.take())
            if hasattr(self.judge, "new_step"):
                self.judge.new_step()
        self._sums, self._failed, self._count = {}, {}, 0
        return out

    def sibling(self) -> RewardComposer:
        """A composer of the same terms and judge with counts of its own (its step count and term means start
        at zero): for rewards computed beside the step's, e.g. QRPO's reference samples."""
        return RewardComposer(self.weights, self.judge, self.failure_reward, self.seed, self.sees_reference)

    def state_dict(self) -> dict[str, int]:
        return {"calls": self.calls}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        self.calls = int(state["calls"])
