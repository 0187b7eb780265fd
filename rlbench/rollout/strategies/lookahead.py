"""LATR, lookahead tree-based rollouts (``rollout=lookahead``; Xing et al. 2025, "Lookahead Tree-Based
Rollouts for Enhanced Trajectory-Level Exploration in Reinforcement Learning with Verifiable Rewards",
arXiv:2510.24302): a group's responses branch where the policy hesitates between two tokens, and a
branch whose lookahead stays too similar to its parent is pruned, so the group holds trajectories
that differ beyond one token.

Per prompt, ``k = round(n * share)`` of its ``n`` responses come from LATR's tree (``share``: a decaying
fraction, ``mix_schedule``, the released ``mix_ratio``) and the other ``n - k`` are i.i.d.

``mode: decode`` (the default; the HF engine's ``generate_branching``, rlbench/rollout/engines/branching.py):
the tree grows while it decodes. Each prompt starts one row; at every step each running row takes its
token (``parent_token``: ``top1``, the released code's, its top token while the trees grow, so a branch
point gives the parent a1 and the branch the runner-up; ``sampled``: a sample), and each other top-2 token
v with ``p(v) > abs_threshold`` and ``p(a1) - p(v) < rel_threshold`` (and not a stop word, with ``stop_word_filter``)
(at most ``max_branches_per_token``, within the first ``branch_window`` tokens, while the tree holds fewer
than ``k`` rows not pruned) starts a branch: the row's keys and values copied, v as its token, v's log-prob
under the warped distribution. At each checkpoint c, once a branch holds c tokens from its branch point
(its branch token included), those c tokens and its parent's are compared (:func:`continuations_similar`:
ROUGE-L F1 above ``rouge_l_threshold`` or suffix-match score above ``suffix_match_threshold``) and a
similar branch is pruned with its descendants (their places freed), as the released ``RolloutFilter``
does (starreeze/latr/model/sample_filter.py), with its two exceptions: ``skip_eos`` (the release's) skips a
checkpoint where either continuation holds EOS (or ended before it), and ``keep_math_symbols`` (the
release's default) never prunes a branch whose parent's token at the branch point decodes, stripped, to
a substring of ``+-*/\\<>=()[]{}_^&%$0123456789`` (:func:`is_math_symbol`; an empty or white-space token
is one, the released substring check's consequence). The release drops such a comparison from its
batch but not from the list of branch ids it zips the batch's verdicts with, so a verdict lands on
another branch; rlbench builds the intended rule (such a branch is exempt) and not that pairing
(tests/test_rollout_lookahead.py says why). The trees decoded
together *return* (the released ``return_on_full``) after the first step at which they are nearly full,
the count of their rows (a tree with no running row counted full) reaching ``round(N * (return_threshold -
return_threshold_decay * step / max_new_tokens))`` of their ``N`` places (the released
``return_nb_thres_init`` and ``return_nb_thres_decay``: the threshold decays linearly over the decoding
steps of each call), with every row more than ``max(checkpoints)`` tokens past its branch point; or after
``branch_window`` tokens. From then on rows sample, and none branches or is pruned
(rlbench/rollout/engines/branching.py :func:`~rlbench.rollout.engines.branching.nearly_full`). A tree
left short of ``k`` is filled (``fill``, metric ``lookahead_filled``): ``repeat``, the released code's
``fill_return_sequences``, with copies of its first member (the trunk; one still running at the return
is copied as it stood then and each copy sampled on from there, as the released rollout copies the row
and hands every row, the copies included, to vLLM), or ``iid``, with i.i.d. responses. Repeating biases the group statistics: the m copies carry the trunk's
reward, so the group mean leans toward it (weight 1 + m of n), the standard deviation shrinks (a tree
that stayed the trunk alone, with share 1, is n equal rewards: zero advantage for the prompt), and the
trunk's advantage enters the loss 1 + m times; ``iid`` keeps the fill an unbiased sample.

``mode: resample`` (any engine, vLLM too): the branch points are read off sampled responses, level by level:

1. one response, the trunk, is sampled;
2. a response is scored (the engine's ``position_stats``): position t is a branch point
   when the runner-up token is likely and close to the top one,
   ``p(a2) > abs_threshold and p(a1) - p(a2) < rel_threshold``; the branch takes the top-two token the
   response did not take there;
3. each branch (the earliest ``2 (k - members)`` branch points of the level) continues
   ``max(checkpoints)`` tokens from ``parent[:t] + [branch token]`` (the prefix is the request's
   ``prefix_ids``, counted as reused);
4. a branch is pruned when, at any checkpoint c, its tokens t..t+c are too similar to its parent's:
   ROUGE-L F1 above ``rouge_l_threshold`` or suffix-match score above ``suffix_match_threshold``
   (:func:`suffix_match`);
5. the surviving branches, earliest first, join the tree until it holds ``k`` members, and are
   completed to the budget; then they are scored in turn and branch again at their own branch points
   after their birth (a level's branch points before the next level's, until the tree is full or no
   branch point is left);
6. **fallback**: branch points lie within the first ``branch_window`` tokens (the released
   ``force_return_step``: after it the released rollout samples the rest plainly); a tree that stays
   short of ``k`` is filled as in mode decode (``fill``).

``stop_word_filter`` (off, as in the released script: starreeze/latr/model/utils.py
``KeyTokenGenConfigMixin.stop_word_filter=False``, not set in scripts/grpo-kt-math.sh): a candidate
whose decoded text (stripped, a leading SentencePiece ``▁`` or WordPiece ``##`` removed) is one of
NLTK's English stop words (lower-cased), consists of the punctuation ``.,;:!?"'`` only, or is empty or
white space never branches (the released starreeze/latr/model/sample_filter.py ``StopWordFilter``; :func:`stop_word_tokens`).

The branch rule ``p(a1) - p(v) < rel_threshold`` is the released ``ProbFilter``'s since starreeze/latr
2adb0ed (2026-01-23, "fix probability filter logic"; the revisions before it had ``>``).

Deviations from the released code (starreeze/latr): mode resample reads the branch points off sampled
responses level by level (its trunk is a sample; ``parent_token``, ``return_threshold`` and
``return_threshold_decay`` apply to mode decode; its fill copies are cut at ``branch_window``); the
threshold scheduler (``enable_param_scheduler``) is off in the released script and not built; the trees
counted for the early return are those the HF engine decodes together (``batch_size // n`` prompts), where
the released rollout counts a GPU's micro-batch and waits for every GPU; branch points are read off the
warped distribution, the released ones off the plain softmax (the same at temperature 1 and top-p 1, as
in its script); ``keep_math_symbols`` exempts such a branch where the release, filtering its comparisons,
pairs the verdicts left with the wrong branches (above); the end-of-sequence tokens skipped are the
engine's (the release: the tokenizer's one ``eos_token_id``). Mode resample's pruning (:func:`too_similar`)
compares c + 1 tokens at checkpoint c (the branch token and the c after it), on what both have, with
neither of the two exceptions (``skip_eos`` and ``keep_math_symbols`` apply to mode decode).

Behaviour bookkeeping (the choice): as in LATR, whose trainer is unchanged, the branches are trained
as the policy's samples (pi_old recomputed); the branch token was chosen, not sampled, so a group is
not an i.i.d. sample of the policy: that is the method's point (diversity). Branches are labelled
``behaviour="branch"`` (metric ``responses_branch``).

State: the number of steps taken, for the schedule (:meth:`LookaheadRollout.state_dict`).

Engines: mode decode the HF engine (another is refused before the model loads); mode resample both, the
statistics being the engine's ``position_stats`` (rlbench/rollout/engines/base.py), which the vLLM engine
computes on the HF policy model it keeps in step.

Configuration (conf/rollout/lookahead.yaml):

    strategy: lookahead
    lookahead:
      mode: decode               # decode: branch while decoding (HF engine) | resample: level by level (any engine)
      abs_threshold: 0.15        # p(a2) above this ...
      rel_threshold: 0.25        # ... and p(a1) - p(a2) below this: a branch point
      checkpoints: [4]           # lookahead lengths at which similarity is checked (< max_new_tokens)
      rouge_l_threshold: 0.5     # prune a branch whose ROUGE-L F1 to its parent exceeds this
      suffix_match_threshold: 0.2  # ... or whose suffix-match score exceeds this (1: off)
      max_branches_per_token: 2  # mode decode: branches one row spawns at one token
      branch_window: 1024        # branch points only before this many tokens
      mix_schedule: [[0, 1.0], [100, 0.75], [200, 0.5], [300, 0.25]]  # [step, share of each group from LATR]
      parent_token: top1         # mode decode: rows take their top token while the trees grow (released) | sampled
      fill: repeat               # a short tree: copies of its first member (released) | iid: i.i.d. responses
      stop_word_filter: false    # true: stop words and punctuation never branch (off in the released script)
      return_threshold: 0.98     # mode decode: the trees return (rows sample) once this share of their places is filled ...
      return_threshold_decay: 0.05  # ... less this times step / max_new_tokens (1.0 and 0.0: only when all are full)
      skip_eos: true             # mode decode: a checkpoint where either continuation holds EOS is skipped (released)
      keep_math_symbols: true    # mode decode: a branch whose parent's token there is a math symbol or digit is never pruned (released)
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlbench.config.schema import RolloutConfig
from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError
from rlbench.rollout.continuation import continue_with_budgets
from rlbench.rollout.engines.base import Completion, GenerationRequest, PositionStats
from rlbench.rollout.engines.branching import BranchRule, BranchTree
from rlbench.rollout.groups import GradedGroups
from rlbench.rollout.strategy import (
    RolloutSetup,
    RolloutStrategy,
    needs_groups,
    register_strategy,
    strategy_options,
)

log = logging.getLogger(__name__)

CANDIDATES_PER_BRANCH = 2  # resample mode: branch points tried per branch wanted (the earliest 2 (n - 1))
MODES = ("decode", "resample")
PARENT_TOKENS = ("top1", "sampled")
FILLS = ("repeat", "iid")
# NLTK's English stop-word list (nltk.corpus.stopwords.words("english"), 179 words), which the released
# StopWordFilter loads (starreeze/latr/model/sample_filter.py)
STOP_WORDS = frozenset("""
i me my myself we our ours ourselves you you're you've you'll you'd your yours yourself yourselves he him his
himself she she's her hers herself it it's its itself they them their theirs themselves what which who whom this
that that'll these those am is are was were be been being have has had having do does did doing a an the and but
if or because as until while of at by for with about against between into through during before after above
below to from up down in out on off over under again further then once here there when where why how all any
both each few more most other some such no nor not only own same so than too very s t can will just don don't
should should've now d ll m o re ve y ain aren aren't couldn couldn't didn didn't doesn doesn't hadn hadn't hasn
hasn't haven haven't isn isn't ma mightn mightn't mustn mustn't needn needn't shan shan't shouldn shouldn't wasn
wasn't weren weren't won won't wouldn wouldn't
""".split())
STOP_PUNCTUATION = ".,;:!?\"'"
# the released math_core_symbols (starreeze/latr/model/sample_filter.py), checked as a substring
MATH_SYMBOLS = "+-*/\\<>=()[]{}_^&%$0123456789"


@dataclass(frozen=True)
class LookaheadOptions:
    """The ``rollout.lookahead`` block."""

    abs_threshold: float = 0.15
    rel_threshold: float = 0.25
    checkpoints: tuple[int, ...] = (4,)
    rouge_l_threshold: float = 0.5
    suffix_match_threshold: float = 0.2
    branch_window: int = 1024
    mix_schedule: tuple[tuple[int, float], ...] = ((0, 1.0), (100, 0.75), (200, 0.5), (300, 0.25))
    mode: str = "decode"
    max_branches_per_token: int = 2
    parent_token: str = "top1"
    fill: str = "repeat"
    stop_word_filter: bool = False
    return_threshold: float = 0.98
    return_threshold_decay: float = 0.05
    skip_eos: bool = True
    keep_math_symbols: bool = True

    @classmethod
    def from_config(cls, rollout: RolloutConfig) -> LookaheadOptions:
        options = strategy_options(rollout, "lookahead", cls)
        for key in ("abs_threshold", "rel_threshold", "rouge_l_threshold", "suffix_match_threshold", "return_threshold",
                    "return_threshold_decay"):
            if not 0.0 <= getattr(options, key) <= 1.0:
                raise ConfigError(f"rollout.lookahead.{key} must be in [0, 1], got {getattr(options, key)}")
        if not options.checkpoints or list(options.checkpoints) != sorted(set(options.checkpoints)) or options.checkpoints[0] < 1:
            raise ConfigError(f"rollout.lookahead.checkpoints must be increasing lengths >= 1, got {list(options.checkpoints)}")
        if options.mode not in MODES:
            raise ConfigError(f"rollout.lookahead.mode must be one of {', '.join(MODES)}, got {options.mode!r}")
        if options.parent_token not in PARENT_TOKENS:
            raise ConfigError(f"rollout.lookahead.parent_token must be one of {', '.join(PARENT_TOKENS)}, got {options.parent_token!r}")
        if options.fill not in FILLS:
            raise ConfigError(f"rollout.lookahead.fill must be one of {', '.join(FILLS)}, got {options.fill!r}")
        if options.max_branches_per_token < 1:
            raise ConfigError(f"rollout.lookahead.max_branches_per_token must be >= 1, got {options.max_branches_per_token}")
        if options.branch_window < 1:
            raise ConfigError(f"rollout.lookahead.branch_window must be >= 1 token, got {options.branch_window}")
        steps = [s for s, _ in options.mix_schedule]
        if not steps or steps[0] != 0 or steps != sorted(set(steps)) or not all(0.0 <= r <= 1.0 for _, r in options.mix_schedule):
            raise ConfigError(
                "rollout.lookahead.mix_schedule must be [[0, share], [step, share], ...] with increasing steps from 0 and "
                f"shares in [0, 1], got {[list(e) for e in options.mix_schedule]}"
            )
        return options

    def rule(self, can_branch: Callable[[int], bool] | None = None, can_prune: Callable[[int], bool] | None = None) -> BranchRule:
        """The decoding engine's :class:`~rlbench.rollout.engines.branching.BranchRule` of these options
        (mode decode): a branch is pruned when its continuation at a checkpoint is
        :func:`continuations_similar` to its parent's; ``can_branch``: the stop-word filter's test of a
        candidate (None: off); ``can_prune``: ``keep_math_symbols``' test of the parent's token at the branch
        point (:func:`math_symbol_tokens`; used only with ``keep_math_symbols``)."""
        def similar(a: list[int], b: list[int]) -> bool:
            return continuations_similar(a, b, self.rouge_l_threshold, self.suffix_match_threshold)

        return BranchRule(self.abs_threshold, self.rel_threshold, self.checkpoints, similar, self.branch_window,
                          self.max_branches_per_token, parent_top1=self.parent_token == "top1", can_branch=can_branch,
                          return_threshold=self.return_threshold, return_decay=self.return_threshold_decay,
                          skip_eos=self.skip_eos, can_prune=can_prune if self.keep_math_symbols else None)

    def share(self, step: int) -> float:
        """The share of each group sampled with LATR at ``step`` (0-based): the last entry at or before it."""
        return [r for s, r in self.mix_schedule if s <= step][-1]


def is_stop_word(text: str) -> bool:
    """The released StopWordFilter's test of a candidate token's decoded text (starreeze/latr
    starreeze/latr/model/sample_filter.py): stripped, a leading ``▁`` or ``##`` removed, it is empty or white space,
    consists of ``.,;:!?"'`` only, or is an NLTK English stop word (lower-cased)."""
    text = text.strip()
    text = text[1:] if text.startswith("\u2581") else text[2:] if text.startswith("##") else text
    return not text.strip() or all(c in STOP_PUNCTUATION for c in text) or text.lower() in STOP_WORDS


def tokens_whose_text_fails(tokenizer, test: Callable[[str], bool]) -> Callable[[int], bool]:
    """``allowed(token)``: False for a token whose decoded text passes ``test`` (memoised per id)."""
    seen: dict[int, bool] = {}

    def allowed(token: int) -> bool:
        if token not in seen:
            seen[token] = not test(tokenizer.decode([token]))
        return seen[token]

    return allowed


def stop_word_tokens(tokenizer) -> Callable[[int], bool]:
    """``can_branch(token)``: False for a token whose decoded text :func:`is_stop_word`."""
    return tokens_whose_text_fails(tokenizer, is_stop_word)


def is_math_symbol(text: str) -> bool:
    """The released ``keep_math_symbols`` test of a token's decoded text
    (starreeze/latr/model/sample_filter.py ``RolloutFilter``): stripped, it is a substring of ``+-*/\\<>=()[]{}_^&%$0123456789``
    (so a digit, an operator, ``12`` or ``()``, but not ``10`` or ``<=``; and the empty string: a white-space
    token counts)."""
    return text.strip() in MATH_SYMBOLS


def math_symbol_tokens(tokenizer) -> Callable[[int], bool]:
    """``can_prune(token)``: False for a token whose decoded text :func:`is_math_symbol`."""
    return tokens_whose_text_fails(tokenizer, is_math_symbol)


def branch_points(stats: PositionStats, response: list[int], abs_threshold: float, rel_threshold: float,
                  can_branch: Callable[[int], bool] | None = None) -> list[tuple[int, int]]:
    """``(t, token)`` for every position where ``p(a2) > abs_threshold`` and ``p(a1) - p(a2) <
    rel_threshold``; ``token`` is the top-two token the response did not take there (dropped where
    ``can_branch`` says no: the stop-word filter)."""
    p1, p2 = stats.top_probs[:, 0], stats.top_probs[:, 1]
    eligible = ((p2 > abs_threshold) & (p1 - p2 < rel_threshold)).nonzero(as_tuple=True)[0].tolist()
    out = []
    for t in eligible:
        a1, a2 = (int(x) for x in stats.top_tokens[t])
        token = a2 if response[t] == a1 else a1
        if can_branch is None or can_branch(token):
            out.append((t, token))
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


def longest_suffix_inside(a: list[int], b: list[int]) -> int:
    """The length of the longest suffix of ``a`` that occurs as a contiguous run somewhere in ``b``."""
    best = 0
    for length in range(1, len(a) + 1):
        suffix = a[len(a) - length :]
        if any(b[s : s + length] == suffix for s in range(len(b) - length + 1)):
            best = length
        else:
            break  # a longer suffix contains this one, so it cannot occur either
    return best


def suffix_match(a: list[int], b: list[int]) -> float:
    """LATR's suffix-match score of two equally long continuations (the released
    ``suffix_match_score`` of starreeze/latr, re-implemented): the longest suffix of either that occurs
    contiguously in the other, over the length. A branch that rejoins its parent's text scores high."""
    if not a or not b:
        return 0.0
    return max(longest_suffix_inside(a, b), longest_suffix_inside(b, a)) / len(a)


def continuations_similar(a: list[int], b: list[int], threshold: float, suffix_threshold: float = 1.0) -> bool:
    """LATR's pruning test of a branch's continuation ``a`` and its parent's ``b`` from the branch point
    (arXiv:2510.24302 Sec. 3; the released ``RolloutFilter``'s ``rouge_l_thres`` and ``suffix_match_thres``):
    ROUGE-L F1 above ``threshold`` or a suffix-match score above ``suffix_threshold`` (the latter on the
    tokens both have)."""
    both = min(len(a), len(b))
    return rouge_l_f1(a, b) > threshold or suffix_match(a[:both], b[:both]) > suffix_threshold


def too_similar(
    branch: list[int], parent: list[int], t: int, checkpoints: tuple[int, ...], threshold: float,
    suffix_threshold: float = 1.0,
) -> bool:
    """Mode resample's pruning: True when, at some checkpoint c, tokens t..t+c of the branch and of its
    parent (c + 1 tokens: the branch token and the c after it, on what both have) are
    :func:`continuations_similar`."""
    return any(continuations_similar(branch[t : t + c + 1], parent[t : t + c + 1], threshold, suffix_threshold) for c in checkpoints)


@register_strategy("lookahead")
class LookaheadRollout(RolloutStrategy):
    """LATR (arXiv:2510.24302): branch at tokens where the runner-up is close to the top token, look
    ahead, prune branches too similar to their parent; a decaying share of each group."""

    def __init__(self, setup: RolloutSetup, options: LookaheadOptions):
        self.setup, self.options = setup, options
        self.steps = 0
        self.can_branch = stop_word_tokens(setup.sampler.tokenizer) if options.stop_word_filter else None
        self.can_prune = math_symbol_tokens(setup.sampler.tokenizer) if options.keep_math_symbols else None
        if options.mode == "decode" and not hasattr(setup.sampler.engine, "generate_branching"):
            raise ConfigError(f"rollout.lookahead.mode=decode needs an engine that branches while decoding (the HF "
                              f"engine); {type(setup.sampler.engine).__name__} does not: use rollout.lookahead.mode=resample")

    @classmethod
    def config_options(cls, rollout: RolloutConfig) -> dict[str, Any]:
        return {"options": LookaheadOptions.from_config(rollout)}

    @classmethod
    def validate(cls, rollout: RolloutConfig, advantage: str) -> None:
        options = LookaheadOptions.from_config(rollout)
        needs_groups("lookahead", rollout, "branches within a group")
        if options.mode == "decode" and rollout.engine != "hf":
            raise ConfigError(
                f"rollout.lookahead.mode=decode branches inside the HF engine's decoding loop; rollout.engine="
                f"{rollout.engine} cannot: use rollout.engine=hf or rollout.lookahead.mode=resample"
            )
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

    def _branch(
        self, prompts: list[tuple[int, ...]], parents: list[tuple[int, Completion, int]], room: list[int]
    ) -> tuple[list[tuple[int, Completion, int]], int, int]:
        """One level: the branch points of each ``(prompt, parent, birth)`` after its birth, looked ahead
        and pruned; the survivors (earliest first, at most ``room[i]`` per prompt) completed to the budget.
        Returns the new members as ``(prompt, completion, birth)``, the candidates tried and those pruned."""
        setup, sampler, options = self.setup, self.setup.sampler, self.options
        params, budget = setup.params, setup.params.max_new_tokens
        stats = sampler.engine.position_stats([(prompts[i], tuple(c.response_ids)) for i, c, _ in parents], params)
        found: list[tuple[int, int, int, int]] = []  # (t, prompt i, parent index, branch token)
        for k, ((i, parent, birth), s) in enumerate(zip(parents, stats)):
            points = branch_points(s, parent.response_ids, options.abs_threshold, options.rel_threshold, self.can_branch)
            found += [(t, i, k, a) for t, a in points if birth < t and t + 1 < budget and t < options.branch_window]
        found.sort(key=lambda x: (x[1], x[0], x[2]))  # per prompt, earliest first
        tried = [0] * len(room)
        candidates = []
        for t, i, k, a in found:
            if tried[i] < CANDIDATES_PER_BRANCH * room[i]:
                tried[i] += 1
                candidates.append((t, i, k, a))
        look = continue_with_budgets(
            sampler,
            [(GenerationRequest(prompts[i], 1, tuple(parents[k][1].response_ids[:t]) + (a,)),
              min(options.checkpoints[-1], budget - t - 1)) for t, i, k, a in candidates],
            params, setup.generator,
        )
        kept: list[tuple[int, Completion, int]] = []
        taken = [0] * len(room)
        pruned = 0
        for (t, i, k, _), (branch,) in zip(candidates, look):
            parent = parents[k][1].response_ids
            if too_similar(branch.response_ids, parent, t, options.checkpoints, options.rouge_l_threshold,
                           options.suffix_match_threshold):
                pruned += 1
            elif taken[i] < room[i]:
                taken[i] += 1
                kept.append((i, branch, t))
        open_ended = [(i, b, t) for i, b, t in kept if not (b.finished or len(b.response_ids) >= budget)]
        completed = continue_with_budgets(
            sampler, [(GenerationRequest(prompts[i], 1, tuple(b.response_ids)), budget - len(b.response_ids)) for i, b, _ in open_ended],
            params, setup.generator,
        )
        done = {id(b): c for (_, b, _), (c,) in zip(open_ended, completed)}
        return [(i, done.get(id(b), b), t) for i, b, t in kept], len(candidates), pruned

    def _decoded(self, prompts: list[tuple[int, ...]], latr: int, tree_size: int) -> tuple[list[BranchTree], int]:
        """Mode decode: the first ``latr`` prompts' trees of at most ``tree_size`` members, branched while
        decoding (rlbench/rollout/engines/branching.py), counted in the sampler's cost (a branch's tokens
        before its branch point are its parent's, decoded once); and the trees' depth."""
        sampler, setup = self.setup.sampler, self.setup
        start = time.perf_counter()
        trees = sampler.engine.generate_branching(
            [GenerationRequest(prompts[i], n=tree_size) for i in range(latr)], setup.params, self.options.rule(self.can_branch, self.can_prune),
            setup.generator,
        )
        shared = sum(t for tree in trees for t in tree.births if t > 0)
        sampler.cost.add([tree.members for tree in trees], time.perf_counter() - start, shared=shared)
        depth = 0
        for tree in trees:
            levels = [0] * len(tree.members)
            for k, parent in enumerate(tree.parents):
                levels[k] = levels[parent] + 1 if parent >= 0 else int(k > 0)
            depth = max(depth, *levels)
        return trees, depth

    def rollout(
        self, problems: list[Problem], draw_prompts: Callable[[int], list[Problem]] | None = None
    ) -> tuple[GradedGroups, dict[str, float]]:
        setup, sampler, options = self.setup, self.setup.sampler, self.options
        params, n, budget = setup.params, setup.n, setup.params.max_new_tokens
        share = options.share(self.steps)
        self.steps += 1
        tree_size = round(share * n)  # responses per group from LATR's tree; the rest are i.i.d.
        latr = len(problems) if tree_size >= 2 else 0
        prompts = sampler.encode(problems)
        if options.mode == "decode":
            # the trees, branched while decoding; then the i.i.d. responses and the fill of short trees, in one call
            decoded, levels = self._decoded(prompts, latr, tree_size)
            trees = [tree.members for tree in decoded]
            tried, pruned = sum(t.spawned for t in decoded), sum(t.pruned for t in decoded)
            filled = sum(tree_size - len(tree) for tree in trees)
            iid = options.fill == "iid"
            plain = sampler.generate(
                [GenerationRequest(ids, n=n - (len(trees[i]) if iid else tree_size) if i < latr else n) for i, ids in enumerate(prompts)],
                params, setup.generator,
            )
            if not iid:
                self._repeat_fill(prompts, trees, tree_size, [t.returned if t.returned >= 0 else budget for t in decoded])
            groups = [[*trees[i], *plain[i]] if i < latr else list(plain[i]) for i in range(len(prompts))]
            for i in range(latr):
                for c in groups[i]:
                    c.request_index = i
            return sampler.grade(problems, groups, budget), self._metrics(share, latr, tried, pruned, trees, levels, filled)
        # mode resample, 1. each LATR group's trunk and the i.i.d. responses, in one call
        first = sampler.generate(
            [GenerationRequest(ids, n=n - tree_size + 1 if i < latr else n) for i, ids in enumerate(prompts)], params, setup.generator
        )
        groups: list[list[Completion]] = [list(g) for g in first]
        trees: list[list[Completion]] = [[groups[i][0]] for i in range(latr)]
        # 2-5. level by level: branch the last level's members until the trees are full
        level = [(i, trees[i][0], -1) for i in range(latr)]
        tried = pruned = levels = 0
        while level:
            room = [tree_size - len(tree) for tree in trees]
            level = [(i, c, birth) for i, c, birth in level if room[i] > 0]
            if not level:
                break
            level, level_tried, level_pruned = self._branch(prompts, level, room)
            tried, pruned = tried + level_tried, pruned + level_pruned
            levels += bool(level)
            for i, branch, _ in level:
                branch.behaviour = "branch"
                trees[i].append(branch)
        # 6. fill short trees: copies of the trunk (repeat) or i.i.d. responses
        short = [(i, tree_size - len(tree)) for i, tree in enumerate(trees) if len(tree) < tree_size]
        if short and options.fill == "repeat":
            self._repeat_fill(prompts, trees, tree_size, [options.branch_window] * len(trees))
        elif short:
            fill = sampler.generate([GenerationRequest(prompts[i], m) for i, m in short], params, setup.generator)
            for (i, _), completions in zip(short, fill):
                trees[i].extend(completions)
        for i in range(latr):
            groups[i] = [trees[i][0], *trees[i][1:], *groups[i][1:]]
            for c in groups[i]:
                c.request_index = i
        filled = sum(m for _, m in short)
        return sampler.grade(problems, groups, budget), self._metrics(share, latr, tried, pruned, trees, levels, filled)

    def _repeat_fill(self, prompts: list[tuple[int, ...]], trees: list[list[Completion]], tree_size: int, cuts: list[int]) -> None:
        """``fill: repeat`` (the released ``fill_return_sequences``): each tree short of ``tree_size`` gets
        copies of its first member; a first member longer than its tree's cut (``cuts[i]`` tokens: where
        the trees returned, mode decode; ``branch_window``, mode resample) is copied up to the cut and
        each copy sampled on from there (the released rollout returns early or at ``force_return_step``,
        copies the first row as it stands, and vLLM continues every row, the copies included). Module
        docstring: what this does to the group."""
        setup = self.setup
        budget = setup.params.max_new_tokens
        short = [(i, tree_size - len(tree)) for i, tree in enumerate(trees) if len(tree) < tree_size]
        on = [(i, m) for i, m in short if len(trees[i][0].response_ids) > cuts[i]]
        continued = continue_with_budgets(
            setup.sampler,
            [(GenerationRequest(prompts[i], m, tuple(trees[i][0].response_ids[: cuts[i]])), budget - cuts[i]) for i, m in on],
            setup.params, setup.generator,
        )
        more = {i: list(c) for (i, _), c in zip(on, continued)}
        for i, m in short:
            first = trees[i][0]
            copies = more.get(i) or [dataclasses.replace(first, response_ids=list(first.response_ids), logprobs=list(first.logprobs))
                                     for _ in range(m)]
            for c in copies:
                c.behaviour = first.behaviour
            trees[i].extend(copies)

    @staticmethod
    def _metrics(share: float, latr: int, tried: int, pruned: int, trees: list[list[Completion]], levels: int,
                 filled: int) -> dict[str, float]:
        return {
            "lookahead_share": share,
            "lookahead_prompts": float(latr),
            "lookahead_candidates": float(tried),
            "lookahead_pruned": float(pruned),
            "lookahead_branches": float(sum(c.behaviour == "branch" for tree in trees for c in tree)),
            "lookahead_levels": float(levels),
            "lookahead_filled": float(filled),
        }
