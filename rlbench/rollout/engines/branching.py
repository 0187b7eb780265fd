"""Tree decoding on the HF engine: rows that branch while they decode (LATR, Xing et al. 2025,
arXiv:2510.24302, Sec. 3: lookahead tree-based rollouts), :meth:`HFGenerateEngine.generate_branching`.

Each request starts one row (its trunk). At every decoding step each running row takes its token:
with ``parent_top1`` (the released code, starreeze/latr/model/generation.py, ``sample_nk="none"``) the
top token ``a1`` of the engine's warped distribution while the trees grow (before ``window`` tokens and
until the batch *returns*: every tree holds ``n`` rows not pruned, or has no running row, and every row
is more than ``max(checkpoints)`` tokens past its branch point, the released ``return_on_full``), so rows
decode greedily and the diversity comes from the branches; after that, or without ``parent_top1``, it
samples as the plain loop does (one inverse-CDF draw per row). Each of the top-``top_m`` tokens ``v``
of that distribution that the row did not take spawns a new row (a branch) when

    p(v) > abs_threshold   and   p(a1) - p(v) < rel_threshold          (a1: the top token)

and ``can_branch(v)`` (the stop-word filter, when set) (:func:`spawn_tokens`; at most ``max_per_token``
branches per row and step, none at or after ``window`` tokens, none while the tree already holds ``n``
rows that were not pruned). A branch is its
parent's row with the other token: the decoding state's ``select_rows`` with the parent's index
repeated copies the parent's keys and values, so the shared prefix is decoded once. Its token's
log-prob is that token's log-prob under the same warped distribution (so is the top-1 token's). ``r`` tokens after its branch
point, for each checkpoint ``r`` of ``checkpoints``, a branch whose continuation since the branch point
is too similar to its parent's (``similar(branch, parent, t, (r,))``; at the end of the branch, the
checkpoints it did not reach, on what it has) is pruned: dropped from the decoding state and from the
result, which frees its place in the tree.

Randomness: one generator (a seed drawn from the caller's, as in ``generate``) draws, per step, one
uniform per row created so far in the batch (finished and pruned rows included; drawn while rows take
their top token too), so a tree is a function of the generator's state; with no branch and without
``parent_top1`` the trunks are the plain loop's samples of the same requests with ``n = 1`` (the same
draws, prefill and decoding steps); with ``parent_top1`` they are its greedy responses up to ``window``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from rlbench.rollout.engines.base import Completion, GenerationRequest, SamplingParams


@dataclass(frozen=True)
class BranchRule:
    """When a decoding row branches and when a branch is pruned (module docstring)."""

    abs_threshold: float
    rel_threshold: float
    checkpoints: tuple[int, ...]
    similar: Callable[[list[int], list[int], int, tuple[int, ...]], bool]  # (branch, parent, t, checkpoints)
    window: int = 1024
    max_per_token: int = 2
    top_m: int = 2
    parent_top1: bool = True  # rows take their top token while the trees grow (the released sample_nk="none")
    can_branch: Callable[[int], bool] | None = None  # a candidate token may branch (None: any; the stop-word filter)


@dataclass
class BranchTree:
    """One request's tree: its members (trunk first, then the surviving branches in the order they were
    born), each member's parent (an index into ``members``; -1: the trunk, or a parent that was pruned)
    and branch position (its first token that differs from the parent's; -1: the trunk), and how many
    branches were spawned and pruned."""

    members: list[Completion] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    births: list[int] = field(default_factory=list)
    spawned: int = 0
    pruned: int = 0


def spawn_tokens(top_tokens: Sequence[int], top_probs: Sequence[float], sampled: int, rule: BranchRule) -> list[int]:
    """The tokens of the branches a row spawns at one step (LATR's filter, arXiv:2510.24302 Sec. 3):
    each top-m token ``v`` (``top_tokens``, probabilities ``top_probs``, best first) other than the sampled
    one with ``p(v) > abs_threshold`` and ``p(a1) - p(v) < rel_threshold`` that ``rule.can_branch`` admits,
    at most ``max_per_token``."""
    p1 = top_probs[0]
    out = [v for v, p in zip(top_tokens, top_probs) if v != sampled and p > rule.abs_threshold and p1 - p < rule.rel_threshold
           and (rule.can_branch is None or rule.can_branch(v))]
    return out[: rule.max_per_token]


@dataclass
class _Row:
    tree: int
    tokens: list[int]
    logprobs: list[float]
    parent: int = -1  # row id
    birth: int = -1
    checked: int = 0  # checkpoints already checked
    pruned: bool = False


def decode_trees(engine, requests: Sequence[GenerationRequest], params: SamplingParams, rule: BranchRule,
                 generator: torch.Generator, lean) -> list[BranchTree]:
    """The trees of one batch of ``requests`` (prompts only; ``n``: a tree's size); the model in eval
    mode under inference mode (the caller's)."""
    from rlbench.rollout.engines.hf import ModelSteps, draw_uniforms, inverse_cdf_sample, warped_logprobs, _warpers

    warpers = _warpers(params)
    inputs, row_input, seen = [], [], {}
    for req in requests:
        key = tuple(req.prompt_ids) if engine.share_prefill else len(inputs)
        if key not in seen:
            seen[key] = len(inputs)
            inputs.append(tuple(req.prompt_ids))
        row_input.append(seen[key])
    logits, cache, mask, last_pos = engine._prefill_reusing(inputs, [0] * len(inputs), 1)
    rows = [_Row(i, [], []) for i in range(len(requests))]
    live = [1] * len(requests)  # rows of each tree not pruned
    spawned = [0] * len(requests)
    budget = params.max_new_tokens
    if budget > 0:
        index = torch.tensor(row_input, dtype=torch.long, device=logits.device)
        scores = logits[:, -1].index_select(0, index)
        decoding = lean.steps(cache, mask, index, budget) if lean is not None else ModelSteps(engine.model, cache, mask, index, len(inputs))
        del cache
        position = last_pos.index_select(0, index)
        eos = set(engine.eos_ids)
        active = list(range(len(rows)))  # row ids in decoding order
        returned = False  # the batch's trees are full and past their checkpoints: rows sample (module docstring)
        for step in range(budget):
            logp = warped_logprobs(scores, warpers)
            greedy = rule.parent_top1 and not returned and step < rule.window
            if params.temperature == 0:
                chosen = logp.argmax(-1)
            else:
                uniforms = draw_uniforms(len(rows), generator, logp.device)  # one per row so far (module docstring)
                if len(active) != len(rows):
                    uniforms = uniforms[torch.tensor(active, device=uniforms.device)]
                chosen = logp.argmax(-1) if greedy else inverse_cdf_sample(logp, uniforms)
            chosen_lp = logp.gather(-1, chosen[:, None]).squeeze(-1).tolist()
            branching = step < rule.window and any(live[rows[r].tree] < requests[rows[r].tree].n for r in active)
            if branching:
                top_lp, top_tok = logp.topk(min(rule.top_m, logp.shape[-1]), dim=-1)
                top_p, top_tok, top_lp = top_lp.exp().tolist(), top_tok.tolist(), top_lp.tolist()
            followers = []  # (decoding index of the row whose state it continues, row id)
            for a, (r, t, lp) in enumerate(zip(active, chosen.tolist(), chosen_lp)):
                row = rows[r]
                followers.append((a, r))
                if branching:
                    for v in spawn_tokens(top_tok[a], top_p[a], t, rule):
                        if live[row.tree] >= requests[row.tree].n:
                            break
                        rows.append(_Row(row.tree, row.tokens + [v], row.logprobs + [top_lp[a][top_tok[a].index(v)]], r, step))
                        live[row.tree] += 1
                        spawned[row.tree] += 1
                        followers.append((a, len(rows) - 1))
                row.tokens.append(t)
                row.logprobs.append(lp)
            kept = []
            for a, r in followers:
                row = rows[r]
                ended = row.tokens[-1] in eos or step == budget - 1
                if row.parent >= 0 and row.checked < len(rule.checkpoints):
                    due = [c for c in rule.checkpoints[row.checked :] if c <= step - row.birth or ended]
                    row.checked += len(due)
                    if due and rule.similar(row.tokens, rows[row.parent].tokens, row.birth, tuple(due)):
                        row.pruned = True
                        live[row.tree] -= 1
                        continue
                if not ended:
                    kept.append((a, r))
            if not kept:
                break
            active = [r for _, r in kept]
            if rule.parent_top1 and not returned:
                running = {rows[r].tree for r in active}
                returned = all(live[i] >= requests[i].n or i not in running for i in range(len(requests))) and all(
                    rows[r].birth + rule.checkpoints[-1] < step for r in active)
            select = [a for a, _ in kept]
            if select != list(range(len(chosen_lp))):  # rows ended, were pruned or branched
                where = torch.tensor(select, dtype=torch.long, device=position.device)
                position = position[where]
                decoding.select_rows(where)
            position = position + 1
            scores = decoding.step(torch.tensor([rows[r].tokens[-1] for r in active], dtype=torch.long, device=position.device), position)
    trees = [BranchTree(spawned=spawned[i], pruned=spawned[i] + 1 - live[i]) for i in range(len(requests))]
    member: dict[int, int] = {}
    for r, row in enumerate(rows):
        if row.pruned:
            continue
        tree = trees[row.tree]
        member[r] = len(tree.members)
        completion = engine._make_completion(row.tree, requests[row.tree], row.tokens, row.logprobs, [])
        if row.parent >= 0:
            completion.behaviour = "branch"
        tree.members.append(completion)
        tree.parents.append(member.get(row.parent, -1))
        tree.births.append(row.birth)
    return trees
