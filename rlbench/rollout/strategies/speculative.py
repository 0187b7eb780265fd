"""SPEC-RL speculative rollouts (``rollout=speculative``; Liu et al. 2025, "SPEC-RL: Accelerating
On-Policy Reinforcement Learning via Speculative Rollouts", arXiv:2509.23232).

The previous epoch's responses to a prompt are drafts for this epoch's: response k of the last time
the prompt was sampled is the draft of slot k. Each draft is verified token by token against the
current policy as in speculative decoding, with a lenience ``b``:

    accept token t with probability  a_t = min(1, e^b * p_new(y_t) / p_old(y_t))

(p_old: the stored sampling probability of the draft token, p_new: the current policy's, both under
the run's temperature / top-p). The first rejected position ``c`` ends the accepted prefix: the
response is regenerated from ``prompt + draft[:c]`` by the current policy (a fully accepted draft
that ended with EOS, or filled the budget, is reused whole). The accepted prefix is the regeneration
request's ``prefix_ids``, so the step's ``reused_tokens`` counts it and ``generated_tokens`` only the
regenerated tail. A prompt without drafts (its first epoch) is sampled i.i.d.; the step logs it
(metric ``speculative_fallback_prompts`` and a log line).

What the procedure samples. At a position reached along the draft, the output token's law is

    o_b(x) = min(q(x), e^b p(x)) + (1 - sum_y min(q(y), e^b p(y))) * p(x)

(q = p_old, p = p_new): the draft token kept, or, after the rejection, a fresh token from p. This is
the paper's rule (the rejected position is resampled from the current policy, not from speculative
decoding's residual max(0, p - q), which would need q over the whole vocabulary, i.e. the old
weights). So o_0 equals p exactly when the draft policy equals the current one, and otherwise
differs from it by at most TV(p, q) in total variation at each position; b > 0 moves o_b towards the
draft policy q (b -> infinity keeps every draft), b -> -infinity gives p (plain sampling).
tests/test_rollout_speculative.py checks these laws exactly by enumeration on a tiny model.

Behaviour bookkeeping (the choice): accepted draft tokens are trained as the current policy's samples
(``off_policy`` 0; pi_old is recomputed on the final sequence), as SPEC-RL does (the trainer is
unchanged, section 3 of the paper). Each such token passed the acceptance test against the current
policy; its true behaviour probability o_b(y_t) cannot be computed without q over the vocabulary, and
labelling it with the draft's own p_old would be wrong too (the token's law is o_b, not q). The
completions carry ``behaviour="draft"`` so the step counts them (``responses_draft``), and the
residual bias is the one stated above, controlled by ``b``.

State: the drafts per prompt uid (:meth:`SpeculativeRollout.state_dict`).

Engines: both; the drafts are verified with the engine's ``score_prefixes`` (rlbench/rollout/engines/base.py). On
the vLLM engine that is the HF policy model it keeps, so p_new (HF kernels) and the draft's p_old (vLLM's
sampling log-probs) differ by bf16 noise even at unchanged weights, far below the default lenience
(docs/rollout-sampling.md).

Configuration (conf/rollout/speculative.yaml):

    strategy: speculative
    speculative:
      lenience: 0.5    # b (the paper's lenience is e^b); 0: the plain acceptance test min(1, p_new / p_old)
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from rlbench.config.schema import RolloutConfig
from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError
from rlbench.rollout.continuation import continue_with_budgets
from rlbench.rollout.engines.base import Completion, GenerationRequest, SamplingParams
from rlbench.rollout.groups import GradedGroups
from rlbench.rollout.strategy import (
    RolloutSetup,
    RolloutStrategy,
    register_strategy,
    strategy_options,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SpeculativeOptions:
    """The ``rollout.speculative`` block."""

    lenience: float = 0.5  # b: accept with min(1, e^b p_new / p_old)

    @classmethod
    def from_config(cls, rollout: RolloutConfig) -> "SpeculativeOptions":
        options = strategy_options(rollout, "speculative", cls)
        lenience = options.lenience
        if not math.isfinite(lenience):
            raise ConfigError(
                f"rollout.speculative.lenience must be a finite number (b in min(1, e^b p_new / p_old)), got {lenience}; "
                "a large negative b rejects every draft (plain sampling), a large positive one keeps every draft"
            )
        return options


@dataclass
class Draft:
    """A stored response: its tokens, their sampling log-probs under the policy that produced it
    (p_old of the next verification) and whether it ended with EOS."""

    response_ids: list[int]
    logprobs: list[float]
    finished: bool

    def as_state(self) -> list:
        return [list(self.response_ids), list(self.logprobs), bool(self.finished)]

    @classmethod
    def from_state(cls, state: Sequence) -> "Draft":
        ids, logprobs, finished = state
        return cls([int(t) for t in ids], [float(x) for x in logprobs], bool(finished))


def acceptance_probability(current_logprobs: torch.Tensor, draft_logprobs: torch.Tensor, lenience: float) -> torch.Tensor:
    """a_t = min(1, e^b * p_new(y_t) / p_old(y_t)) per draft token (float64)."""
    delta = current_logprobs.double() - draft_logprobs.double() + float(lenience)
    return delta.clamp(max=0.0).exp()


def first_rejection(acceptance: torch.Tensor, uniforms: torch.Tensor) -> int:
    """The accepted prefix length: the first t with u_t > a_t (token t rejected), len if none."""
    rejected = (uniforms > acceptance).nonzero(as_tuple=True)[0]
    return int(rejected[0].item()) if len(rejected) else int(acceptance.shape[0])


def score_under_policy(engine: Any, items: list[tuple[tuple[int, ...], tuple[int, ...]]], params: SamplingParams) -> list[list[float]]:
    """Log-probs of each draft given its prompt under the engine's current policy (its ``score_prefixes``)."""
    return engine.score_prefixes(items, params) if items else []


@register_strategy("speculative")
class SpeculativeRollout(RolloutStrategy):
    """SPEC-RL (arXiv:2509.23232): the previous epoch's responses are drafts, verified against the
    current policy with lenience b; generation resumes at the first rejected token."""

    def __init__(self, setup: RolloutSetup, options: SpeculativeOptions):
        self.setup, self.options = setup, options
        self.drafts: dict[str, list[Draft]] = {}

    @classmethod
    def config_options(cls, rollout: RolloutConfig) -> dict[str, Any]:
        return {"options": SpeculativeOptions.from_config(rollout)}


    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        return {"drafts": {uid: [d.as_state() for d in drafts] for uid, drafts in self.drafts.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.drafts = {uid: [Draft.from_state(d) for d in drafts] for uid, drafts in state["drafts"].items()}

    # ------------------------------------------------------------------ rollout

    def rollout(
        self, problems: list[Problem], draw_prompts: Callable[[int], list[Problem]] | None = None
    ) -> tuple[GradedGroups, dict[str, float]]:
        setup, sampler = self.setup, self.setup.sampler
        params, n = setup.params, setup.n
        budget = params.max_new_tokens
        prompts = sampler.encode(problems)
        # the drafted slots (problem i, slot k), in order, each with its draft cut to the budget
        drafted = [
            (i, k, Draft(d.response_ids[:budget], d.logprobs[:budget], d.finished and len(d.response_ids) <= budget))
            for i, problem in enumerate(problems)
            for k, d in enumerate(self.drafts.get(problem.uid, [])[:n])
        ]
        start = time.perf_counter()
        scores = score_under_policy(sampler.engine, [(prompts[i], tuple(d.response_ids)) for i, _, d in drafted], params)
        verify_s = time.perf_counter() - start

        slots: list[list[Completion | None]] = [[None] * n for _ in problems]
        prefixed: list[tuple[int, int, list[int]]] = []  # regenerate (i, k) from draft[:cut]
        accepted_tokens = draft_tokens = 0
        reused: list[Completion] = []
        for (i, k, draft), current in zip(drafted, scores):
            length = len(draft.response_ids)
            acceptance = acceptance_probability(torch.tensor(current), torch.tensor(draft.logprobs), self.options.lenience)
            uniforms = torch.rand(length, generator=setup.generator, dtype=torch.float64)
            cut = first_rejection(acceptance, uniforms)
            accepted_tokens += cut
            draft_tokens += length
            if cut == length and (draft.finished or length >= budget):
                slots[i][k] = Completion(
                    request_index=i, prompt_ids=prompts[i], response_ids=list(draft.response_ids),
                    logprobs=[float(x) for x in current], finished=draft.finished,
                    text=sampler.tokenizer.decode(draft.response_ids, skip_special_tokens=True),
                    prefix_len=length, behaviour="draft",
                )
                reused.append(slots[i][k])
            else:
                prefixed.append((i, k, draft.response_ids[:cut]))
        sampler.cost.add([reused], verify_s)  # whole drafts: reused tokens, no generation

        continued = {(i, k) for i, k, _ in prefixed}
        fresh = [(i, [k for k in range(n) if slots[i][k] is None and (i, k) not in continued]) for i in range(len(problems))]
        fallback = [i for i, problem in enumerate(problems) if problem.uid not in self.drafts]
        if fallback:
            log.info("speculative: %d of %d prompts have no draft yet (first epoch): sampled without drafts",
                     len(fallback), len(problems))
        self._regenerate(prompts, slots, prefixed, [(i, ks) for i, ks in fresh if ks])
        groups: list[list[Completion]] = [[c for c in row if c is not None] for row in slots]
        graded = sampler.grade(problems, groups, budget)
        for problem, group in zip(problems, groups):
            self.drafts[problem.uid] = [Draft(list(c.response_ids), list(c.logprobs), c.finished) for c in group]
        metrics = {
            "speculative_fallback_prompts": float(len(fallback)),
            "speculative_draft_tokens": float(draft_tokens),
            "speculative_accept_rate": accepted_tokens / draft_tokens if draft_tokens else 0.0,
            "speculative_full_reuse": float(len(reused)),
            "speculative_verify_s": verify_s,
        }
        return graded, metrics

    def _regenerate(
        self,
        prompts: list[tuple[int, ...]],
        slots: list[list[Completion | None]],
        prefixed: list[tuple[int, int, list[int]]],
        fresh: list[tuple[int, list[int]]],
    ) -> None:
        """Fill the open slots: draftless slots sampled from scratch (one request per prompt), drafted
        ones continued from their accepted prefix with the rest of the budget."""
        setup = self.setup
        budget = setup.params.max_new_tokens
        requests = [(GenerationRequest(prompts[i], n=len(ks)), budget) for i, ks in fresh]
        requests += [(GenerationRequest(prompts[i], n=1, prefix_ids=tuple(prefix)), budget - len(prefix)) for i, _, prefix in prefixed]
        places = [[(i, k) for k in ks] for i, ks in fresh] + [[(i, k)] for i, k, _ in prefixed]
        for where, completions in zip(places, continue_with_budgets(setup.sampler, requests, setup.params, setup.generator)):
            for (i, k), completion in zip(where, completions):
                completion.request_index = i
                if completion.prefix_len:
                    completion.behaviour = "draft"
                slots[i][k] = completion
