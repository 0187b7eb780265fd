"""Tree decoding on the HF engine: rows that branch while they decode (LATR, Xing et al. 2025,
arXiv:2510.24302, Sec. 3: lookahead tree-based rollouts). This module holds the rule and the tree
(:class:`BranchRule`, :func:`spawn_tokens`, :class:`BranchTree`); the decoding loop that applies them is the
engine's (:meth:`HFGenerateEngine.generate_branching` in rlbench/rollout/engines/hf.py, which imports this module).

Each request starts one row (its trunk). At every decoding step each running row takes its token:
with ``parent_top1`` (the released code, starreeze/latr/model/generation.py, ``sample_nk="none"``) the
top token ``a1`` of the engine's warped distribution while the trees grow (until the batch *returns*,
:func:`nearly_full`), so rows decode greedily and the diversity comes from the branches; after that, or
without ``parent_top1``, it samples as the plain loop does (one inverse-CDF draw per row).

The batch returns (the released ``return_on_full``, starreeze/latr/model/generation.py) after the step at
which its trees are nearly full: a tree counts ``n`` when it holds ``n`` rows not pruned or has no running
row, else the rows it holds, and the batch's count reaches ``round(N * (return_threshold -
return_decay * step / max_new_tokens))`` (``N``: the sum of the trees' ``n``; ``step``: the 0-based decoding
step, so the threshold decays linearly over the response budget, afresh in every call; Python's
``round``); and every row not pruned (finished ones included) is more than ``max(checkpoints)`` tokens
past its branch point (the trunk's counted as 0). It also returns after ``window`` tokens (the released
``force_return_step``). From the return on, no row branches and none is pruned; a tree then short of
``n`` keeps what it holds and records the return (:attr:`BranchTree.returned`: the tokens each row had),
for its fill (the released ``fill_return_sequences`` copies its first row as it stands then, and every row,
the copies included, is sampled on: rlbench/rollout/strategies/lookahead.py). With ``return_threshold`` 1
the batch returns only when every tree is full or done. Each of the top-``top_m`` tokens ``v``
of that distribution that the row did not take spawns a new row (a branch) when

    p(v) > abs_threshold   and   p(a1) - p(v) < rel_threshold          (a1: the top token)

and ``can_branch(v)`` (the stop-word filter, when set) (:func:`spawn_tokens`; at most ``max_per_token``
branches per row and step, none after the return, none while the tree already holds ``n`` rows that
were not pruned). This is the released ``ProbFilter`` (starreeze/latr/model/sample_filter.py, as fixed in
2adb0ed, 2026-01-23: ``p(a1) - p(v) < prob_filter_rel_thres``; earlier revisions had ``>``). A branch is its
parent's row with the other token: the decoding state's ``select_rows`` with the parent's index
repeated copies the parent's keys and values, so the shared prefix is decoded once. Its token's
log-prob is that token's log-prob under the same warped distribution (so is the top-1 token's).

Pruning (the released ``RolloutFilter``, starreeze/latr/model/sample_filter.py, at 2adb0ed): at checkpoint
``c`` of ``checkpoints``, the step at which a branch born at ``t`` holds ``c`` tokens since its branch
point (its branch token included: step ``t + c - 1``, the released ``current_step - birth_step = c``
with ``current_step = step + 1``), its continuation ``a = branch[t : t + c]`` and its parent's ``b =
parent[t : t + c]`` are compared, and the branch is pruned when ``similar(a, b)``. With ``skip_eos``
(the release) a checkpoint where ``a`` or ``b`` holds an end-of-sequence token or is short of ``c``
tokens (the row ended before it: the release pads a finished row with EOS) is skipped; without it, at
the end of the branch, the checkpoints it did not reach are compared on what it has. With
``can_prune`` a branch whose parent's token at its branch point (``b[0]``) it refuses is never compared
(the released ``keep_math_symbols``: rlbench/rollout/strategies/lookahead.py). A pruned branch is dropped
from the decoding state and from the result, which frees its place in the tree; so are its descendants,
the branches born of it or of them (the released ``BranchInfo.remove`` removes a branch with its children,
recursively).

Randomness: one generator (a seed drawn from the caller's, as in ``generate``) draws, per step, one
uniform per row created so far in the batch (finished and pruned rows included; drawn while rows take
their top token too), so a tree is a function of the generator's state; with no branch and without
``parent_top1`` the trunks are the plain loop's samples of the same requests with ``n = 1`` (the same
draws, prefill and decoding steps); with ``parent_top1`` they are its greedy responses up to ``window``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


from rlbench.rollout.engines.base import Completion


@dataclass(frozen=True)
class BranchRule:
    """When a decoding row branches and when a branch is pruned (module docstring)."""

    abs_threshold: float
    rel_threshold: float
    checkpoints: tuple[int, ...]
    similar: Callable[[list[int], list[int]], bool]  # (a, b): the branch's and its parent's c tokens from the branch point
    window: int = 1024
    max_per_token: int = 2
    top_m: int = 2
    parent_top1: bool = True  # rows take their top token while the trees grow (the released sample_nk="none")
    can_branch: Callable[[int], bool] | None = None  # a candidate token may branch (None: any; the stop-word filter)
    return_threshold: float = 1.0  # the batch returns when its trees are this full (the released return_nb_thres_init) ...
    return_decay: float = 0.0  # ... less this times step / max_new_tokens (return_nb_thres_decay)
    skip_eos: bool = False  # a checkpoint where either continuation holds EOS or is short is skipped (the released RolloutFilter)
    can_prune: Callable[[int], bool] | None = None  # the parent's token at the branch point lets the branch be pruned (None: any)


@dataclass
class BranchTree:
    """One request's tree: its members (trunk first, then the surviving branches in the order they were
    born), each member's parent (an index into ``members``; -1: the trunk)
    and branch position (its first token that differs from the parent's; -1: the trunk), and how many
    branches were spawned and pruned."""

    members: list[Completion] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    births: list[int] = field(default_factory=list)
    spawned: int = 0
    pruned: int = 0
    returned: int = -1  # tokens each row had when the batch returned (module docstring); -1: it never did


def spawn_tokens(top_tokens: Sequence[int], top_probs: Sequence[float], sampled: int, rule: BranchRule) -> list[int]:
    """The tokens of the branches a row spawns at one step (LATR's filter, arXiv:2510.24302 Sec. 3):
    each top-m token ``v`` (``top_tokens``, probabilities ``top_probs``, best first) other than the sampled
    one with ``p(v) > abs_threshold`` and ``p(a1) - p(v) < rel_threshold`` that ``rule.can_branch`` admits,
    at most ``max_per_token``."""
    p1 = top_probs[0]
    out = [v for v, p in zip(top_tokens, top_probs) if v != sampled and p > rule.abs_threshold and p1 - p < rule.rel_threshold
           and (rule.can_branch is None or rule.can_branch(v))]
    return out[: rule.max_per_token]


def nearly_full(live: Sequence[int], sizes: Sequence[int], done: Sequence[bool], step: int, budget: int, rule: BranchRule) -> bool:
    """The released early return's count (LATR, arXiv:2510.24302; starreeze/latr/model/generation.py): the
    trees of a batch, ``live[i]`` rows not pruned of ``sizes[i]`` (``done[i]``: no row running, counted
    full), are nearly full at decoding step ``step`` (0-based) of ``budget`` when

        sum_i (sizes[i] if done[i] else min(live[i], sizes[i]))  >=  round(sum_i sizes[i] * (init - decay * step / budget))

    with ``init = rule.return_threshold`` and ``decay = rule.return_decay`` (Python's ``round``)."""
    threshold = rule.return_threshold - rule.return_decay * step / budget
    counted = sum(n if d else min(k, n) for k, n, d in zip(live, sizes, done))
    return counted >= round(sum(sizes) * threshold)


@dataclass
class BranchRow:
    tree: int
    tokens: list[int]
    logprobs: list[float]
    parent: int = -1  # row id
    birth: int = -1
    checked: int = 0  # checkpoints already checked
    pruned: bool = False


def checkpoint_due(rule: BranchRule, branch: list[int], parent: list[int], t: int, checked: int, ended: bool,
                   eos: set[int]) -> tuple[int, list[tuple[list[int], list[int]]]]:
    """The checkpoints of ``rule`` a branch born at ``t`` (tokens ``branch``, its parent's ``parent``) has
    reached, past the ``checked`` first ones (module docstring): how many, and the ``(a, b)`` pairs to
    compare (``c`` tokens from the branch point each; at the end of the branch, ``ended``, every
    checkpoint left; with ``rule.skip_eos`` those whose ``a`` or ``b`` holds a token of ``eos`` or is
    short of ``c`` left out, and with ``rule.can_prune`` none where it refuses ``parent[t]``)."""
    due = [c for c in rule.checkpoints[checked:] if c <= len(branch) - t or ended]
    if rule.can_prune is not None and due and not rule.can_prune(parent[t]):
        return len(due), []
    pairs = [(branch[t : t + c], parent[t : t + c]) for c in due]
    if rule.skip_eos:
        pairs = [(a, b) for (a, b), c in zip(pairs, due) if len(a) == len(b) == c and eos.isdisjoint(a) and eos.isdisjoint(b)]
    return len(due), pairs
