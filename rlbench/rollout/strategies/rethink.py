"""Cog-Rethinker re-rollouts of zero-accuracy problems (``rollout=rethink``; Sun et al. 2025,
"Cog-Rethinker: Hierarchical Metacognitive Reinforcement Learning for LLM Reasoning", arXiv:2510.15979).

After the direct rollout (n responses per prompt), the problems none of whose responses is correct go
through two stages: **decompose** (the problem inside ``decompose_template``, which asks for
subproblems first; ``samples`` responses) and, for those still unsolved, **refine** (the problem with up
to ``shown_attempts`` of its wrong direct responses inside ``refine_template``). Both stages keep the
dataset's template around the rewritten problem, so the answer format is unchanged.

Training on the successes (``successes``). ``sft`` (the default, the paper's rule, section 3): every
stage success of a problem (S1 of decompose, S2 of refine) is re-attached to the **direct** prompt
(train-test consistency) and added to the batch, a problem's successes together as a group of their own
after the direct groups (``behaviour="rethink_sft"``), their tokens marked 1 in the step input
``sft_target`` (0 on every other response): the loss ``ppo_clip_sft`` trains them by cross-entropy,
L = L_GRPO + lambda * L_SFT with L_SFT over y in S1 u S2 (rlbench/algorithm/losses/auxiliary_sft.py), each
success one response of the batch; a group whose responses are all correct has advantage 0 under GRPO's
and Dr.GRPO's estimators, so the direct groups' advantages are the plain GRPO ones. ``off_policy`` (the
earlier stand-in): a problem's first success replaces a wrong direct response in its group,
labelled off-policy: ``behaviour="rethink"``, ``off_policy`` 1 on every token and ``behaviour_logprobs``
= its sampling log-probs under the stage's prompt, so the ratio is pi_theta(y | direct prompt) /
pi_old(y | stage prompt), never a silent 1 (rlbench.training.step.behaviour_old_logp); the group then
has a correct response and a non-zero group-relative advantage.

Demonstrations (``demonstrations`` = k > 0; the paper's OpenReview reviewers describe the decompose stage's
demonstrations as retrieved by BM25 from a dynamically updated buffer of past successful decompositions):
the strategy keeps a FIFO buffer of ``buffer_size`` past decompose-stage successes (the problem's text and
the first correct decompose response of each solved problem, added after the step's stages ran), and the
decompose prompt of a problem shows, in its ``{demonstrations}`` field, the k buffered problems most similar
to it by Okapi BM25 (:func:`bm25_scores`; documents sharing no word with it, and its own past entries, are
never shown; ties go to the earlier entry), each as ``DEMONSTRATION``. k = 0 keeps no buffer and the field
is empty: the prompts are the plain ones. The buffer is the strategy's state (``state_dict``), so a resumed
run continues exactly. k, the capacity, the demonstration format and BM25's k1 = 1.5, b = 0.75 are
rlbench's choices (the paper's are not read).

Configuration (conf/rollout/rethink.yaml):

    strategy: rethink
    rethink:
      samples: 4               # responses per stage for each unsolved problem
      shown_attempts: 2        # wrong direct responses shown in the refine prompt
      decompose_template: "..." # must contain {problem}; {demonstrations} (needed when demonstrations > 0)
      demonstrations: 2         # k past successful decompositions shown (BM25 top-k); 0: none, no buffer
      buffer_size: 512          # the buffer's capacity (FIFO)
      refine_template: "..."    # must contain {problem} and {attempts}
      successes: sft            # sft: trained by the loss's SFT term (ppo_clip_sft) | off_policy: into the group
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
from typing import Any, Callable

from rlbench.config.schema import RolloutConfig
from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError
from rlbench.rollout.engines.base import Completion
from rlbench.rollout.groups import GradedGroups
from rlbench.rollout.strategy import (
    RolloutSetup,
    RolloutStrategy,
    register_strategy,
    strategy_options,
)

DECOMPOSE_TEMPLATE = (
    "Break the following problem into smaller subproblems, solve them one by one, then give the final answer.\n\n"
    "{demonstrations}{problem}"
)
DEMONSTRATION = "Example problem:\n{problem}\nExample solution:\n{response}\n\n"  # one shown decomposition
FIELDS = re.compile(r"\{(problem|attempts|demonstrations)\}")
SUCCESS_TRAINING = ("sft", "off_policy")
SFT_TARGET = "sft_target"  # the step input marking SFT tokens (rlbench/algorithm/step_inputs.py)
REFINE_TEMPLATE = "{problem}\n\nThese attempts are wrong:\n{attempts}\n\nFind the mistakes and solve the problem correctly."


@dataclasses.dataclass(frozen=True)
class RethinkOptions:
    """The ``rollout.rethink`` block."""

    samples: int = 4
    shown_attempts: int = 2
    decompose_template: str = DECOMPOSE_TEMPLATE
    refine_template: str = REFINE_TEMPLATE
    successes: str = "sft"
    demonstrations: int = 2
    buffer_size: int = 512

    @classmethod
    def from_config(cls, rollout: RolloutConfig) -> "RethinkOptions":
        options = strategy_options(rollout, "rethink", cls)
        if options.samples < 1 or options.shown_attempts < 1:
            raise ConfigError(f"rollout.rethink.samples and .shown_attempts must be >= 1, got {options.samples}, "
                              f"{options.shown_attempts}")
        if "{problem}" not in options.decompose_template:
            raise ConfigError("rollout.rethink.decompose_template must contain {problem}")
        if options.demonstrations < 0 or options.buffer_size < 1:
            raise ConfigError(f"rollout.rethink.demonstrations must be >= 0 and .buffer_size >= 1, got "
                              f"{options.demonstrations}, {options.buffer_size}")
        if options.demonstrations and "{demonstrations}" not in options.decompose_template:
            raise ConfigError("rollout.rethink.demonstrations > 0 shows them in the decompose prompt: its "
                              "decompose_template must contain {demonstrations}")
        if "{problem}" not in options.refine_template or "{attempts}" not in options.refine_template:
            raise ConfigError("rollout.rethink.refine_template must contain {problem} and {attempts}")
        if options.successes not in SUCCESS_TRAINING:
            raise ConfigError(f"rollout.rethink.successes={options.successes!r}: choose one of {SUCCESS_TRAINING}")
        return options


def check_success_training(rollout: RolloutConfig, loss: str, loss_inputs: set[str]) -> None:
    """``successes: sft`` needs a loss that reads ``sft_target`` (ppo_clip_sft): with another loss the SFT
    groups would train on nothing (advantage 0, no SFT term)."""
    if rollout.strategy != "rethink" or SFT_TARGET in loss_inputs:
        return
    if RethinkOptions.from_config(rollout).successes == "sft":
        raise ConfigError(f"rollout.rethink.successes=sft trains the stage successes by the loss's SFT term, but loss "
                          f"'{loss}' has none: use algorithm/loss=ppo_clip_sft (Cog-Rethinker's L_GRPO + lambda L_SFT) "
                          "or rollout.rethink.successes=off_policy")


def stage_problem(problem: Problem, template: str, attempts: str = "", demonstrations: str = "") -> Problem:
    """The problem rewritten by a stage's template (one pass of plain substitution: the texts may hold
    braces, even a field's name)."""
    values = {"problem": problem.prompt, "attempts": attempts, "demonstrations": demonstrations}
    return dataclasses.replace(problem, prompt=FIELDS.sub(lambda m: values[m.group(1)], template))


def demonstration(problem: str, response: str) -> str:
    """One past decomposition as ``DEMONSTRATION`` shows it (one pass: the texts may hold braces)."""
    values = {"problem": problem, "response": response}
    return re.sub(r"\{(problem|response)\}", lambda m: values[m.group(1)], DEMONSTRATION)


def words(text: str) -> list[str]:
    """BM25's tokens: the lower-cased text split into words (runs of letters, digits and _)."""
    return re.findall(r"\w+", text.lower())


def bm25_scores(query: str, documents: list[str], k1: float = 1.5, b: float = 0.75) -> list[float]:
    """Okapi BM25 (Robertson and Zaragoza 2009, "The Probabilistic Relevance Framework: BM25 and Beyond",
    eq. 3.15) of each document for the query, over :func:`words`:

        score(D, Q) = sum over the query's words q (each occurrence) of
                      idf(q) * f(q, D) (k1 + 1) / (f(q, D) + k1 (1 - b + b |D| / avgdl))
        idf(q) = ln((N - n(q) + 0.5) / (n(q) + 0.5) + 1)

    f(q, D): q's count in D; |D|: D's word count; avgdl: the mean over the N documents; n(q): the documents
    holding q. This idf (+1 inside the log, as Lucene's) is positive, so a document scores > 0 exactly when it
    shares a word with the query."""
    docs = [words(d) for d in documents]
    if not docs:
        return []
    avgdl = sum(len(d) for d in docs) / len(docs) or 1.0
    counts = [collections.Counter(d) for d in docs]
    holding = collections.Counter(w for c in counts for w in c)
    scores = []
    for doc, count in zip(docs, counts):
        norm = k1 * (1 - b + b * len(doc) / avgdl)
        scores.append(sum(
            math.log((len(docs) - holding[q] + 0.5) / (holding[q] + 0.5) + 1) * count[q] * (k1 + 1) / (count[q] + norm)
            for q in words(query) if count[q]
        ))
    return scores


def top_k(scores: list[float], k: int) -> list[int]:
    """The indices of the k highest positive scores, best first; a tie goes to the lower index (the earlier
    entry)."""
    ranked = sorted((i for i, s in enumerate(scores) if s > 0), key=lambda i: (-scores[i], i))
    return ranked[:k]


def as_direct_response(success: Completion, direct_prompt: tuple[int, ...], index: int) -> Completion:
    """A stage's correct response re-attached to the direct prompt, off-policy with its stage log-probs."""
    return dataclasses.replace(
        success, request_index=index, prompt_ids=direct_prompt, prefix_len=0, behaviour="rethink",
        off_policy=[1] * len(success.response_ids), behaviour_logprobs=list(success.logprobs), policy_version=None,
        extras={**success.extras, SFT_TARGET: [0.0] * len(success.response_ids)},
    )


def as_sft_response(success: Completion, direct_prompt: tuple[int, ...], index: int) -> Completion:
    """A stage's correct response re-attached to the direct prompt as an SFT target (``sft_target`` 1 on
    every token; on-policy label: its group, all correct, has advantage 0, so only the SFT term trains it)."""
    return dataclasses.replace(
        success, request_index=index, prompt_ids=direct_prompt, prefix_len=0, behaviour="rethink_sft",
        off_policy=None, behaviour_logprobs=None, policy_version=None,
        extras={**success.extras, SFT_TARGET: [1.0] * len(success.response_ids)},
    )


@register_strategy("rethink")
class RethinkRollout(RolloutStrategy):
    """Cog-Rethinker (arXiv:2510.15979): zero-accuracy problems re-rolled with a decompose and a refine
    prompt; a success is trained by SFT under the direct prompt (or joins its group off-policy)."""

    provides = frozenset({SFT_TARGET})

    def __init__(self, setup: RolloutSetup, options: RethinkOptions):
        self.setup, self.options = setup, options
        # past decompose successes, oldest first: (problem uid, problem text, response text)
        self.buffer: collections.deque[tuple[str, str, str]] = collections.deque(maxlen=options.buffer_size)

    def demonstrations(self, problem: Problem) -> str:
        """The ``{demonstrations}`` text of ``problem``'s decompose prompt: its BM25 top-k of the buffer
        (other problems only), each as ``DEMONSTRATION``; "" when k = 0 or nothing matches."""
        if not self.options.demonstrations:
            return ""
        others = [entry for entry in self.buffer if entry[0] != problem.uid]
        chosen = top_k(bm25_scores(problem.prompt, [text for _, text, _ in others]), self.options.demonstrations)
        return "".join(demonstration(others[i][1], others[i][2]) for i in chosen)

    def state_dict(self) -> dict[str, Any] | None:
        return {"buffer": [list(entry) for entry in self.buffer]} if self.options.demonstrations else None

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        self.buffer.clear()
        self.buffer.extend(tuple(entry) for entry in (state or {}).get("buffer", []))

    @classmethod
    def config_options(cls, rollout: RolloutConfig) -> dict[str, Any]:
        return {"options": RethinkOptions.from_config(rollout)}

    def _stage_successes(self, stage: list[Problem], positions: list[int]) -> dict[int, list[Completion]]:
        """Sample ``samples`` responses to each stage problem; its correct ones, in sampling order
        (problems without one are left out)."""
        if not stage:
            return {}
        graded = self.setup.sampler(stage, self.options.samples, self.setup.params, self.setup.generator)
        found: dict[int, list[Completion]] = {}
        for g, (i, group) in enumerate(zip(positions, graded.groups)):
            verdicts = graded.correct[graded.group_index == g].tolist()
            correct = [c for c, ok in zip(group, verdicts) if ok]
            if correct:
                found[i] = correct
        return found

    def rollout(
        self, problems: list[Problem], draw_prompts: Callable[[int], list[Problem]] | None = None
    ) -> tuple[GradedGroups, dict[str, float]]:
        setup, sampler, options = self.setup, self.setup.sampler, self.options
        direct = setup.sample(problems)
        correct = direct.correct.view(len(problems), -1)
        zero = [i for i in range(len(problems)) if not bool(correct[i].any())]
        decomposed = self._stage_successes(
            [stage_problem(problems[i], options.decompose_template, demonstrations=self.demonstrations(problems[i]))
             for i in zero], zero)
        if options.demonstrations:  # after the step's prompts are built: a step retrieves only earlier steps' successes
            self.buffer.extend((problems[i].uid, problems[i].prompt, found[0].text) for i, found in sorted(decomposed.items()))
        unsolved = [i for i in zero if i not in decomposed]
        refine = [
            stage_problem(problems[i], options.refine_template,
                          "\n".join(f"- {c.text}" for c in direct.groups[i][: options.shown_attempts]))
            for i in unsolved
        ]
        refined = self._stage_successes(refine, unsolved)
        for group in direct.groups:
            for completion in group:
                completion.extras[SFT_TARGET] = [0.0] * len(completion.response_ids)
        successes = sorted({**decomposed, **refined}.items())
        graded = direct
        if successes and options.successes == "sft":  # a problem's successes, a group after the direct groups
            sft = sampler.grade([problems[i] for i, _ in successes],
                                [[as_sft_response(success, direct.groups[i][0].prompt_ids, len(problems) + k)
                                  for success in found] for k, (i, found) in enumerate(successes)],
                                setup.params.max_new_tokens)
            graded = GradedGroups.concat([direct.with_group_ids(0), sft.with_group_ids(len(problems))])
        elif successes:
            groups = [list(g) for g in direct.groups]
            for i, found in successes:
                groups[i][-1] = as_direct_response(found[0], groups[i][0].prompt_ids, i)
            graded = sampler.grade(problems, groups, setup.params.max_new_tokens)
        metrics = {
            "rethink_successes": float(sum(len(found) for _, found in successes)),
            "rethink_zero_accuracy_prompts": float(len(zero)),
            "rethink_decompose_solved": float(len(decomposed)),
            "rethink_refine_solved": float(len(refined)),
        }
        if options.demonstrations:
            metrics["rethink_buffer_size"] = float(len(self.buffer))
        return graded, metrics
