"""LATR, lookahead tree-based rollouts (``rollout=lookahead``; Xing et al. 2025, "Lookahead Tree-Based
Rollouts for Enhanced Trajectory-Level Exploration in Reinforcement Learning with Verifiable Rewards",
arXiv:2510.24302): a group's responses branch where the policy hesitates between two tokens, and a
branch whose lookahead stays too similar to its parent is pruned, so the group holds trajectories
that differ beyond one token.

Per prompt that uses LATR this step (a decaying share of the prompts, ``mix_schedule``):

1. one response, the trunk, is sampled;
2. the trunk is scored (the engine's ``position_stats``): position t is a branch point
   when the runner-up token is likely and close to the top one,
   ``p(a2) > abs_threshold and p(a1) - p(a2) < rel_threshold``; the branch takes the top-two token the
   trunk did not take;
3. each branch (the earliest ``2 (n - 1)`` branch points) continues ``max(checkpoints)`` tokens from
   ``trunk[:t] + [branch token]`` (the prefix is the request's ``prefix_ids``, counted as reused);
4. a branch is pruned when, at any checkpoint c, the ROUGE-L F1 of its tokens t..t+c against the
   trunk's is above ``rouge_l_threshold``;
5. the first ``n - 1`` surviving branches are completed to the budget; a group with fewer survivors is
   filled with i.i.d. responses (metric ``lookahead_filled``).

The other prompts get ``n`` i.i.d. responses. Deviations from the released code (starreeze/latr): the
branches grow from the trunk only (one level; LATR branches every active branch again), pruning uses
ROUGE-L alone (LATR's suffix-match filter is not implemented), and the branch points are read off a
sampled trunk rather than found while decoding.

Behaviour bookkeeping (the choice): as in LATR, whose trainer is unchanged, the branches are trained
as the policy's samples (pi_old recomputed); the branch token was chosen, not sampled, so a group is
not an i.i.d. sample of the policy: that is the method's point (diversity). Branches are labelled
``behaviour="branch"`` (metric ``responses_branch``).

State: the number of steps taken, for the schedule (:meth:`LookaheadRollout.state_dict`).

Engines: both; the statistics are the engine's ``position_stats`` (rlbench/rollout/engines/base.py), which the vLLM
engine computes on the HF policy model it keeps in step.

Configuration (conf/rollout/lookahead.yaml):

    strategy: lookahead
    lookahead:
      abs_threshold: 0.15        # p(a2) above this ...
      rel_threshold: 0.25        # ... and p(a1) - p(a2) below this: a branch point
      checkpoints: [4]           # lookahead lengths at which similarity is checked (< max_new_tokens)
      rouge_l_threshold: 0.5     # prune a branch whose ROUGE-L F1 to the trunk exceeds this
      mix_schedule: [[0, 1.0], [100, 0.75], [200, 0.5], [300, 0.25]]  # [step, share of prompts with LATR]
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

from rlbench.config.schema import RolloutConfig
from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError
from rlbench.rollout.continuation import continue_with_budgets
from rlbench.rollout.engines.base import Completion, GenerationRequest, PositionStats
from rlbench.rollout.groups import GradedGroups
from rlbench.rollout.strategy import (
    RolloutSetup,
    RolloutStrategy,
    needs_groups,
    register_strategy,
    strategy_options,
)

log = logging.getLogger(__name__)

CANDIDATES_PER_BRANCH = 2  # branch points tried per branch wanted (the earliest 2 (n - 1))


@dataclass(frozen=True)
class LookaheadOptions:
    """The ``rollout.lookahead`` block."""

    abs_threshold: float = 0.15
    rel_threshold: float = 0.25
    checkpoints: tuple[int, ...] = (4,)
    rouge_l_threshold: float = 0.5
    mix_schedule: tuple[tuple[int, float], ...] = ((0, 1.0), (100, 0.75), (200, 0.5), (300, 0.25))

    @classmethod
    def from_config(cls, rollout: RolloutConfig) -> "LookaheadOptions":
        options = strategy_options(rollout, "lookahead", cls)
        for key in ("abs_threshold", "rel_threshold", "rouge_l_threshold"):
            if not 0.0 <= getattr(options, key) <= 1.0:
                raise ConfigError(f"rollout.lookahead.{key} must be in [0, 1], got {getattr(options, key)}")
        if not options.checkpoints or list(options.checkpoints) != sorted(set(options.checkpoints)) or options.checkpoints[0] < 1:
            raise ConfigError(f"rollout.lookahead.checkpoints must be increasing lengths >= 1, got {list(options.checkpoints)}")
        steps = [s for s, _ in options.mix_schedule]
        if not steps or steps[0] != 0 or steps != sorted(set(steps)) or not all(0.0 <= r <= 1.0 for _, r in options.mix_schedule):
            raise ConfigError(
                "rollout.lookahead.mix_schedule must be [[0, share], [step, share], ...] with increasing steps from 0 and "
                f"shares in [0, 1], got {[list(e) for e in options.mix_schedule]}"
            )
        return options

    def share(self, step: int) -> float:
        """The share of prompts sampled with LATR at ``step`` (0-based): the last entry at or before it."""
        return [r for s, r in self.mix_schedule if s <= step][-1]


def branch_points(stats: PositionStats, response: list[int], abs_threshold: float, rel_threshold: float) -> list[tuple[int, int]]:
    """``(t, token)`` for every position where ``p(a2) > abs_threshold`` and ``p(a1) - p(a2) <
    rel_threshold``; ``token`` is the top-two token the response did not take there."""
    p1, p2 = stats.top_probs[:, 0], stats.top_probs[:, 1]
    eligible = ((p2 > abs_threshold) & (p1 - p2 < rel_threshold)).nonzero(as_tuple=True)[0].tolist()
    out = []
    for t in eligible:
        a1, a2 = (int(x) for x in stats.top_tokens[t])
        out.append((t, a2 if response[t] == a1 else a1))
    return out


def rouge_l_f1(candidate: list[int], reference: list[int]) -> float:
    """ROUGE-L F1 of two token lists: 2 P R / (P + R) with P = LCS / |candidate|, R = LCS / |reference|."""
    if not candidate or not reference:
        return 0.0
    previous = [0] * (len(reference) + 1)
    for x in candidate:
        current = [0]
        for j, y in enumerate(reference):
            current.append(previous[j] + 1 if x == y else max(previous[j + 1], current[j]))
        previous = current
    lcs = previous[-1]
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(candidate), lcs / len(reference)
    return 2 * precision * recall / (precision + recall)


def too_similar(branch: list[int], trunk: list[int], t: int, checkpoints: tuple[int, ...], threshold: float) -> bool:
    """True when, at some checkpoint c, tokens t..t+c of the branch and of the trunk have ROUGE-L F1
    above ``threshold`` (checked on the tokens both have)."""
    return any(rouge_l_f1(branch[t : t + c + 1], trunk[t : t + c + 1]) > threshold for c in checkpoints)


@register_strategy("lookahead")
class LookaheadRollout(RolloutStrategy):
    """LATR (arXiv:2510.24302): branch at tokens where the runner-up is close to the top token, look
    ahead, prune branches too similar to the trunk; a decaying share of the prompts."""

    def __init__(self, setup: RolloutSetup, options: LookaheadOptions):
        self.setup, self.options = setup, options
        self.steps = 0

    @classmethod
    def config_options(cls, rollout: RolloutConfig) -> dict[str, Any]:
        return {"options": LookaheadOptions.from_config(rollout)}

    @classmethod
    def validate(cls, rollout: RolloutConfig, advantage: str) -> None:
        options = LookaheadOptions.from_config(rollout)
        needs_groups("lookahead", rollout, "branches within a group")
        budget = int(rollout.max_new_tokens)
        if options.checkpoints[-1] >= budget:
            raise ConfigError(
                f"rollout.lookahead.checkpoints reach {options.checkpoints[-1]} tokens, not shorter than "
                f"rollout.max_new_tokens={budget}: a branch would end before its similarity is checked; lower the "
                f"checkpoints below {budget} or raise rollout.max_new_tokens"
            )

    def state_dict(self) -> dict:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.steps = int(state["steps"])

    def rollout(
        self, problems: list[Problem], draw_prompts: Callable[[int], list[Problem]] | None = None
    ) -> tuple[GradedGroups, dict[str, float]]:
        setup, sampler, options = self.setup, self.setup.sampler, self.options
        params, n, budget = setup.params, setup.n, setup.params.max_new_tokens
        share = options.share(self.steps)
        self.steps += 1
        latr = round(share * len(problems))
        prompts = sampler.encode(problems)
        # 1. trunks of the LATR prompts and the other prompts' i.i.d. groups, in one call
        first = sampler.generate(
            [GenerationRequest(ids, n=1 if i < latr else n) for i, ids in enumerate(prompts)], params, setup.generator
        )
        groups: list[list[Completion]] = [list(g) for g in first]
        trunks = [groups[i][0] for i in range(latr)]
        # 2. branch points along each trunk
        stats = sampler.engine.position_stats([(prompts[i], tuple(c.response_ids)) for i, c in enumerate(trunks)], params)
        candidates = []  # (prompt i, t, branch token)
        for i, (trunk, s) in enumerate(zip(trunks, stats)):
            points = [(t, a) for t, a in branch_points(s, trunk.response_ids, options.abs_threshold, options.rel_threshold)
                      if t + 1 < budget]
            candidates += [(i, t, a) for t, a in points[: CANDIDATES_PER_BRANCH * (n - 1)]]
        # 3. lookahead from trunk[:t] + [branch token]
        look = continue_with_budgets(
            sampler,
            [(GenerationRequest(prompts[i], 1, tuple(trunks[i].response_ids[:t]) + (a,)), min(options.checkpoints[-1], budget - t - 1))
             for i, t, a in candidates],
            params, setup.generator,
        )
        # 4. prune; keep the first n - 1 survivors per prompt
        kept: list[list[Completion]] = [[] for _ in range(latr)]
        pruned = 0
        for (i, t, _), (branch,) in zip(candidates, look):
            if too_similar(branch.response_ids, trunks[i].response_ids, t, options.checkpoints, options.rouge_l_threshold):
                pruned += 1
            elif len(kept[i]) < n - 1:
                kept[i].append(branch)
        # 5. complete the survivors; fill short groups with i.i.d. responses
        requests, places = [], []
        for i, branches in enumerate(kept):
            for branch in branches:
                if branch.finished or len(branch.response_ids) >= budget:
                    groups[i].append(branch)
                else:
                    requests.append((GenerationRequest(prompts[i], 1, tuple(branch.response_ids)), budget - len(branch.response_ids)))
                    places.append(i)
            if len(branches) < n - 1:
                requests.append((GenerationRequest(prompts[i], n - 1 - len(branches)), budget))
                places.append(i)
        filled = sum(n - 1 - len(b) for b in kept)
        for i, completions in zip(places, continue_with_budgets(sampler, requests, params, setup.generator)):
            groups[i].extend(completions)
        for i in range(latr):
            for c in groups[i][1:]:
                c.request_index = i
                if c.prefix_len:
                    c.behaviour = "branch"
        metrics = {
            "lookahead_share": share,
            "lookahead_prompts": float(latr),
            "lookahead_candidates": float(len(candidates)),
            "lookahead_pruned": float(pruned),
            "lookahead_branches": float(sum(len(b) for b in kept)),
            "lookahead_filled": float(filled),
        }
        return sampler.grade(problems, groups, budget), metrics
