"""Reward shaping: per-response terms combined with the outcome reward before advantages are computed.

A function declares the inputs it needs (response lengths, EOS flags, the budget, the grader's
verdicts, groups, texts, first tokens: the ``shaping`` entries of
rlbench.algorithm.step_inputs.STEP_INPUTS, tabled in docs/algorithms.md).
Every function returns a [B] float tensor. Most are *terms* added to the outcome reward; the ones
in REPLACES_OUTCOME are the whole reward of their paper (it already depends on correctness), so
with one of them the grader's reward is dropped and the terms are added to it instead
(:func:`apply_shaping`). At most one such function may be configured.
"""

from __future__ import annotations

import difflib
import hashlib
import math
import re
from typing import Any, Mapping, Sequence

import torch

from rlbench.algorithm.registry import Registry
from rlbench.errors import ConfigError

REWARD_SHAPING = Registry("reward shaping", reader="shaping")
#: Functions whose value is the paper's whole reward rather than a term on top of the grader's.
REPLACES_OUTCOME = {"cosine_length", "thinkless_mode"}


@REWARD_SHAPING.register("dapo_overlong")
def dapo_overlong_penalty(
    response_lengths: torch.Tensor, finished: torch.Tensor, max_length: int, cache_fraction: float = 0.2
) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement
    Learning System at Scale", arXiv:2503.14476, eq. 13). With L_max = max_length and the punishment
    interval L_cache = round(cache_fraction * L_max):

        R_len(y) = 0                                  if |y| <= L_max - L_cache
                 = ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
                 = -1                                 if |y| > L_max

    A response truncated at the budget (no EOS) would have exceeded L_max and gets -1. The paper
    uses L_max = 20480 and L_cache = 4096, hence the default fraction 0.2.
    """
    if not 0 < cache_fraction <= 1:
        raise ValueError(f"cache_fraction must be in (0, 1], got {cache_fraction}")
    cache = max(1, round(cache_fraction * max_length))
    expected = max_length - cache
    lengths = response_lengths.to(torch.float32)
    penalty = torch.where(lengths <= expected, torch.zeros_like(lengths), (expected - lengths) / cache)
    return torch.where(finished.bool(), penalty, torch.full_like(lengths, -1.0))


LENGTH_TARGETS = (1000, 2000, 3000, 4000)  # INTELLECT-2's target set (recalled, unverified)


def length_target(uid: str, targets: Sequence[int] | None = None, seed: int = 0) -> int:
    """INTELLECT-2's target length of one prompt (Prime Intellect Team 2025, arXiv:2505.07291): drawn
    uniformly from ``targets`` by a hash of (``seed``, the problem's uid), so the same prompt has the
    same target each time it is drawn, in every process and after a resume (no random state). The one
    place that decides a target: the prompt's instruction (:func:`length_target_instruction`) and the
    reward (:func:`length_target_penalty`) both read it."""
    table = LENGTH_TARGETS if targets is None else targets
    digest = hashlib.blake2b(f"{int(seed)}\x00{uid}".encode(), digest_size=8).digest()
    return int(table[int.from_bytes(digest, "little") % len(table)])


def length_target_instruction(uid: str, prompt: str, targets: Sequence[int] | None = None, seed: int = 0) -> str:
    """The sentence that tells the policy its prompt's target: ``prompt`` with ``{target}`` filled in."""
    return prompt.format(target=length_target(uid, targets, seed))


@REWARD_SHAPING.register("length_target")
def length_target_penalty(
    response_lengths: torch.Tensor, problem_uids: list[str], targets: list[int] | None = None, alpha: float = 0.001,
    seed: int = 0, prompt: str | None = None,
) -> torch.Tensor:
    """INTELLECT-2's length-control reward (Prime Intellect Team 2025, arXiv:2505.07291): each prompt gets a
    target length L_target drawn from the set ``targets``, and

        R_len(y) = -alpha * |  |y| - L_target(x)  |          (0 at |y| = L_target, the most)

    added to the task reward (targets default: 1000, 2000, 3000, 4000). L_target(x) is
    :func:`length_target` of the prompt's problem uid and ``seed``. ``prompt`` (e.g. "Think for {target}
    tokens before giving a response."): the sentence written after the problem in the prompt, so the
    policy is told the target it is rewarded towards (the paper's prompts carry it); null: not
    written (GroupSampler.encode writes it, from Algorithm.prompt_instruction). The set and alpha are
    unverified (the paper's, recalled: targets of 1000-4000 tokens, alpha small).
    """
    table = LENGTH_TARGETS if targets is None else targets
    if not table or any(int(t) < 0 for t in table) or alpha < 0:
        raise ValueError(f"targets must be a non-empty list of lengths >= 0 and alpha >= 0, got {list(table)}, {alpha}")
    if prompt is not None and "{target}" not in prompt:
        raise ValueError(f"prompt must contain {{target}}, got {prompt!r}")
    target = torch.tensor([length_target(uid, table, seed) for uid in problem_uids], dtype=torch.float32)
    return -alpha * (response_lengths.to(torch.float32) - target).abs()


def _as_float(values: torch.Tensor) -> torch.Tensor:
    return values.to(torch.float32)


@REWARD_SHAPING.register("cosine_length")
def cosine_length_reward(
    response_lengths: torch.Tensor,
    correct: torch.Tensor,
    finished: torch.Tensor,
    max_length: int,
    correct_at_zero: float = 1.0,
    correct_at_max: float = 0.5,
    wrong_at_zero: float = -1.0,
    wrong_at_max: float = -0.5,
    length_scale: int | None = None,
    truncated_reward: float | None = None,
) -> torch.Tensor:
    """Cosine length-scaled reward (Yeo et al. 2025, "Demystifying Long Chain-of-Thought Reasoning in
    LLMs", arXiv:2502.03373, sec. 4.2). With p = min(|y| / L, 1), L = length_scale (default
    max_length):

        CosFn(p; r_0, r_L) = r_L + (r_0 - r_L) (1 + cos(pi p)) / 2       (r_0 at |y| = 0, r_L at |y| >= L)
        R(y) = CosFn(p; correct_at_zero, correct_at_max)   if correct
             = CosFn(p; wrong_at_zero, wrong_at_max)       if wrong
             = truncated_reward                            if truncated and truncated_reward is set

    Short correct answers earn more than long ones; long wrong answers are punished less than short
    ones (more thinking when unsure). This is the whole reward (REPLACES_OUTCOME). Defaults are the
    open-r1 values the Open-RS recipe uses (1.0/0.5 correct, -1.0/-0.5 wrong, no truncation term);
    the paper's own values (r_0^c=2, r_L^c=1, r_0^w=-10, r_L^w=0, exceed -10) are unverified here
    (check arXiv:2502.03373 sec. 4.2 before using them). Lengths beyond L are clamped to L
    (open-r1's cosine would rise again there).
    """
    scale = max_length if length_scale is None else length_scale
    if scale <= 0:
        raise ValueError(f"cosine_length: length_scale must be > 0, got {scale}")
    progress = (_as_float(response_lengths) / scale).clamp(max=1.0)
    shape = (1.0 + torch.cos(math.pi * progress)) / 2
    right = correct_at_max + (correct_at_zero - correct_at_max) * shape
    wrong = wrong_at_max + (wrong_at_zero - wrong_at_max) * shape
    reward = torch.where(correct.bool(), right, wrong)
    if truncated_reward is not None:
        reward = torch.where(finished.bool(), reward, torch.full_like(reward, float(truncated_reward)))
    return reward


#: DeepSeek-R1-Zero's training template (Guo et al. 2025, arXiv:2501.12948, table 1).
R1_TEMPLATE = r"\s*<think>.*?</think>\s*<answer>.*?</answer>\s*"


@REWARD_SHAPING.register("format")
def format_reward(response_texts: Sequence[str], pattern: str = R1_TEMPLATE, weight: float = 1.0) -> torch.Tensor:
    """Rule-based format reward (DeepSeek-AI 2025, "DeepSeek-R1", arXiv:2501.12948, sec. 2.2.2):

        R_format(y) = weight * 1[y matches pattern]          (re.fullmatch, DOTALL)

    The default pattern is R1-Zero's template: reasoning inside <think></think>, then the answer
    inside <answer></answer>. The grader's own ``reward.format_weight`` is a different check (the
    answer is in the dataset's answer format, e.g. \\boxed{}); this one checks the response layout.
    An empty response matches only a pattern that accepts the empty string.
    """
    try:
        compiled = re.compile(pattern, re.DOTALL)
    except re.error as err:
        raise ValueError(f"format: pattern {pattern!r} is not a valid regular expression ({err})") from None
    return torch.tensor([weight if compiled.fullmatch(text) else 0.0 for text in response_texts], dtype=torch.float32)


def tail_loop_fraction(units: Sequence, min_repeats: int = 2) -> float:
    """The share of a sequence that lies inside the loop it ends in (CAMPO's repetition critic f(o),
    Li et al. 2025, "MiroMind-M1", arXiv:2507.14683, sec. 4.3 eq. 6; the loop is the released
    ``find_infinite_loop_start``'s, MiroMindAsia/MiroMind-M1).

    The loop is the longest period L whose last L units repeat at least ``min_repeats`` times back to
    back at the end; with c such copies, f = c L / n (0 without a loop). "abcabcabc" gives 1,
    "xyzabcabc" 6/9, "xaaaaa" 4/6 (period 2 twice: the longest period wins, as in the released code,
    although period 1 covers 5/6). Computed in O(n) with the Z-function of the reversed sequence:
    Z[L] is how far the sequence and its shift by L agree backwards from the end, so c = 1 + Z[L] // L.
    """
    if min_repeats < 2:
        raise ValueError(f"min_repeats must be >= 2, got {min_repeats}")
    backwards = list(reversed(units))
    n = len(backwards)
    z = [0] * n
    left = right = 0
    for i in range(1, n):
        if i < right:
            z[i] = min(right - i, z[i - left])
        while i + z[i] < n and backwards[z[i]] == backwards[i + z[i]]:
            z[i] += 1
        if i + z[i] > right:
            left, right = i, i + z[i]
    covered = 0
    for period in range(1, n // min_repeats + 1):
        copies = 1 + z[period] // period
        if copies >= min_repeats:
            covered = copies * period
    return covered / n if n else 0.0


@REWARD_SHAPING.register("campo_repetition")
def campo_repetition_penalty(
    response_token_ids: Sequence[Sequence[int]],
    finished: torch.Tensor,
    weight: float = 1.0,
    mode: str = "fraction",
    min_repeats: int = 2,
    truncated_only: bool = True,
) -> torch.Tensor:
    """CAMPO's repetition penalty (Li et al. 2025, "MiroMind-M1: An Open-Source Advancement in
    Mathematical Reasoning via Context-Aware Multi-Stage Policy Optimization", arXiv:2507.14683,
    sec. 4.3, eq. 6 and sec. 4.3.2). With f(o) = :func:`tail_loop_fraction` of the response's token ids
    (the unit of the released ``find_infinite_loop_start``, MiroMindAsia/MiroMind-M1):

        term(o) = -weight f(o)          mode "fraction" (eq. 6: the advantage is GRPO's on r - f;
                                        an earlier loop covers more of the response and costs more)
        term(o) = -weight 1[f(o) > 0]   mode "flag" (the released compute_campo_outcome_advantage,
                                        weight 0.1)

    truncated_only (the released code's choice): only responses that hit the length budget without
    EOS are scanned, which is where a loop that never ends goes; false scans every response. A loop of
    tokens is a loop of text, not always the reverse: text that repeats under different tokenisations
    is no loop here, as in the released code.
    """
    if mode not in ("fraction", "flag"):
        raise ValueError(f"campo_repetition: mode must be 'fraction' or 'flag', got {mode!r}")
    if weight < 0:
        raise ValueError(f"campo_repetition: weight must be >= 0, got {weight}")
    scanned = [not (truncated_only and bool(done)) for done in finished.tolist()]
    if len(scanned) != len(response_token_ids):
        raise ValueError(f"campo_repetition: {len(response_token_ids)} token sequences for {len(scanned)} responses")
    share = [tail_loop_fraction(list(ids), min_repeats) if scan else 0.0
             for ids, scan in zip(response_token_ids, scanned)]
    values = [(float(f > 0) if mode == "flag" else f) for f in share]
    return -weight * torch.tensor(values, dtype=torch.float32)


@REWARD_SHAPING.register("thinkless_mode")
def thinkless_mode_reward(
    correct: torch.Tensor,
    first_tokens: Sequence[str],
    short_token: str = "<short>",
    short_correct: float = 1.0,
    think_correct: float = 0.5,
    wrong: float = -1.0,
) -> torch.Tensor:
    """Thinkless' mode-aware reward (Fang, Ma & Wang 2025, "Thinkless: LLM Learns When to Think",
    arXiv:2505.13379). The policy's first response token is a control token, <short>
    or <think>, that picks the reasoning mode:

        R(y) = short_correct   (1.0)   if correct and the first token is <short>
             = think_correct   (0.5)   if correct and it is not (the <think> mode)
             = wrong          (-1.0)   if wrong, in either mode

    A correct short answer beats a correct long one, so the policy learns to think only when the
    short mode fails. This is the whole reward (REPLACES_OUTCOME). A response whose first token is
    neither control token is scored as the <think> mode (no short-answer bonus): without Thinkless'
    SFT warm-up a model rarely emits a control token, and only an explicit <short> earns the bonus.
    """
    short = torch.tensor([token == short_token for token in first_tokens], dtype=torch.bool, device=correct.device)
    if short.shape != correct.shape:
        raise ValueError(f"thinkless_mode: {len(first_tokens)} first tokens for {correct.shape[0]} responses")
    right = torch.where(short, torch.tensor(short_correct), torch.tensor(think_correct))
    return torch.where(correct.bool(), right, torch.tensor(wrong)).to(torch.float32)


def code_similarity(code: str, other: str) -> float:
    """difflib's character-level ratio 2M / (|a| + |b|) of two code strings (M: the characters of their
    matching blocks; no junk heuristic), 1 for equal strings; 0 when either is empty."""
    if not code or not other:
        return 0.0
    return difflib.SequenceMatcher(None, code, other, autojunk=False).ratio()


@REWARD_SHAPING.register("gtpo_code_similarity")
def gtpo_code_similarity(
    policy_code: Sequence[str], correct: torch.Tensor, group_index: torch.Tensor, weight: float = 0.5,
) -> torch.Tensor:
    """GTPO's self-supervised reward shaping (Ding et al. 2025, "Empowering Multi-Turn Tool-Integrated
    Reasoning with Group Turn Policy Optimization", arXiv:2511.14846, section 3): a failed trajectory earns
    part of a success's reward in proportion to how close its code is to the code of its group's successes,

        term(o_i) = lambda * max_{j in group(i), correct(j)} sim(code_i, code_j)    if o_i is wrong
                  = 0                                                             if o_i is right, or its
                                                                                  group has no success

    with lambda = ``weight`` in [0, 1) (a failure never earns a success's reward; the default 0.5 is
    unverified), code_i the closed ```python blocks the episode's policy turns wrote, joined by newlines
    (``policy_code``: tool outputs left out), and sim :func:`code_similarity` (difflib's character
    ratio, standing in for the paper's similarity). An episode without code gets 0. The term is added to
    the outcome, the grader's 0 for a wrong answer, so r_fail = lambda * max sim.
    """
    if not 0.0 <= weight < 1.0:
        raise ValueError(f"gtpo_code_similarity: weight (lambda) must lie in [0, 1), got {weight}")
    if len(policy_code) != correct.shape[0]:
        raise ValueError(f"gtpo_code_similarity: {len(policy_code)} codes for {correct.shape[0]} responses")
    codes = list(policy_code)
    right, groups = correct.bool().tolist(), group_index.tolist()
    terms = [
        0.0 if right[i] else weight * max(
            (code_similarity(codes[i], codes[j]) for j in range(len(codes)) if right[j] and groups[j] == groups[i]),
            default=0.0)
        for i in range(len(codes))
    ]
    return torch.tensor(terms, dtype=torch.float32)


def apply_shaping(
    rewards: torch.Tensor, shapers: Sequence[tuple[str, Mapping[str, Any]]], inputs: Mapping[str, Any]
) -> torch.Tensor:
    """The reward after shaping: R = base + sum_s term_s(inputs), base = the outcome reward, or 0
    when a shaper in REPLACES_OUTCOME is configured (its term is then the whole reward)."""
    terms = [REWARD_SHAPING.call(name, inputs, params).to(rewards.device, rewards.dtype) for name, params in shapers]
    base = torch.zeros_like(rewards) if any(name in REPLACES_OUTCOME for name, _ in shapers) else rewards
    return base + sum(terms)


def check_shapers(shapers: Sequence[tuple[str, Mapping[str, Any]]]) -> None:
    """Validate shapers before a run: known names and parameters, at most one reward that replaces
    the outcome, and parameter values the functions accept (each is run on a one-response batch)."""
    replacing = [name for name, _ in shapers if name in REPLACES_OUTCOME]
    if len(replacing) > 1:
        raise ConfigError(
            f"algorithm.reward_shaping has {replacing}; each of them is a whole reward (they replace the "
            f"grader's outcome), so keep at most one"
        )
    probe = {
        "response_lengths": torch.tensor([1]), "finished": torch.tensor([True]), "max_length": 8,
        "correct": torch.tensor([True]), "group_index": torch.tensor([0]), "response_texts": [""], "policy_code": [""],
        "response_token_ids": [[]], "first_tokens": [""], "problem_uids": [""],
    }
    for name, params in shapers:
        REWARD_SHAPING.validate_params(name, params)
        try:
            REWARD_SHAPING.call(name, probe, params)
        except (ValueError, TypeError) as err:
            raise ConfigError(f"algorithm.reward_shaping '{name}': {err}") from None
