"""SPEC-RL speculative rollouts (rlbench/rollout/strategies/speculative.py, arXiv:2509.23232).

The law of the accept / regenerate procedure is computed exactly by enumerating every short sequence
of a tiny model with a 3-token vocabulary (no sampling), and compared with the closed form of the
module docstring; the strategy itself runs on the HF engine and on a scripted engine."""

from __future__ import annotations

import itertools
import logging
import math
from pathlib import Path

import pytest
import torch

from rlbench.config.typed import rollout_config
from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError
from rlbench.model import load_policy
from rlbench.reward.toy import EvenTokenReward
from rlbench.rollout import GroupSampler, HFGenerateEngine, RolloutSetup, make_strategy, validate_strategy
from rlbench.rollout.engines.base import Completion, SamplingParams
from rlbench.rollout.strategies.speculative import (
    Draft,
    SpeculativeOptions,
    SpeculativeRollout,
    acceptance_probability,
    first_rejection,
)
from rlbench.rollout.continuation import budget_bucket

from conftest import smoke_cli_steps, model_preset

ROOT = Path(__file__).resolve().parents[1]
VOCAB, LENGTH = 3, 3  # every sequence of 3 tokens over a 3-token vocabulary: 27 sequences


# ---------------------------------------------------------------- the acceptance test


def test_acceptance_is_min_one_e_b_ratio_and_the_cut_is_the_first_rejection():
    current = torch.tensor([-1.0, -2.0, -0.5, -3.0])
    draft = torch.tensor([-1.5, -1.0, -0.5, -1.0])
    a = acceptance_probability(current, draft, 0.0)
    assert a.tolist() == pytest.approx([1.0, math.exp(-1.0), 1.0, math.exp(-2.0)])
    lenient = acceptance_probability(current, draft, 0.5)
    assert lenient.tolist() == pytest.approx([1.0, math.exp(-0.5), 1.0, math.exp(-1.5)])
    assert bool((lenient >= a).all())  # more lenience never accepts less
    assert first_rejection(a, torch.tensor([0.9, 0.3, 0.99, 0.1], dtype=torch.float64)) == 4  # all accepted
    assert first_rejection(a, torch.tensor([0.9, 0.5, 0.0, 0.0], dtype=torch.float64)) == 1  # u_1 > e^-1
    assert first_rejection(a, torch.tensor([0.9, 0.3, 0.99, 0.2], dtype=torch.float64)) == 3


def test_budget_buckets_are_powers_of_two_capped_by_the_budget():
    assert [budget_bucket(r, 16) for r in (1, 2, 3, 4, 5, 9, 16)] == [1, 2, 4, 4, 8, 16, 16]
    assert budget_bucket(7, 6) == 6


# ---------------------------------------------------------------- the law, by enumeration


def tiny_lm(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16)
    model = LlamaForCausalLM(config).double().eval()
    for p in model.parameters():  # peaked enough that the two policies differ visibly
        p.data.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(seed))
    return model


def conditionals(model) -> dict[tuple[int, ...], torch.Tensor]:
    """p(. | prompt + prefix) for every prefix shorter than LENGTH (prompt = token 0)."""
    out = {}
    with torch.no_grad():
        for k in range(LENGTH):
            for prefix in itertools.product(range(VOCAB), repeat=k):
                logits = model(input_ids=torch.tensor([[0, *prefix]])).logits[0, -1]
                out[prefix] = torch.softmax(logits, -1)
    return out


def sequence_law(cond) -> dict[tuple[int, ...], float]:
    return {y: math.prod(float(cond[y[:t]][y[t]]) for t in range(LENGTH)) for y in itertools.product(range(VOCAB), repeat=LENGTH)}


def procedure_law(p, q, lenience: float) -> dict[tuple[int, ...], float]:
    """The output law of SPEC-RL's procedure, enumerated: a draft d ~ q; token t is accepted with the
    module's acceptance_probability (p and q scores of d); the first rejected position c and all after
    it are sampled from p given d[:c]."""
    law = {y: 0.0 for y in itertools.product(range(VOCAB), repeat=LENGTH)}
    q_law = sequence_law(q)
    for d, q_d in q_law.items():
        current = torch.tensor([math.log(p[d[:t]][d[t]]) for t in range(LENGTH)])
        old = torch.tensor([math.log(q[d[:t]][d[t]]) for t in range(LENGTH)])
        a = acceptance_probability(current, old, lenience).tolist()
        law[d] += q_d * math.prod(a)  # the whole draft kept
        for c in range(LENGTH):  # rejected at c: tokens c.. from p after d[:c]
            p_cut = q_d * math.prod(a[:c]) * (1.0 - a[c])
            for tail in itertools.product(range(VOCAB), repeat=LENGTH - c):
                y = d[:c] + tail
                law[y] += p_cut * math.prod(float(p[y[:t]][y[t]]) for t in range(c, LENGTH))
    return law


def first_token(law) -> torch.Tensor:
    out = torch.zeros(VOCAB, dtype=torch.float64)
    for y, mass in law.items():
        out[y[0]] += mass
    return out


def closed_form(p: torch.Tensor, q: torch.Tensor, lenience: float) -> torch.Tensor:
    """o_b(x) = min(q(x), e^b p(x)) + (1 - sum_y min(q(y), e^b p(y))) p(x) (module docstring)."""
    kept = torch.minimum(q, math.exp(lenience) * p)
    return kept + (1.0 - kept.sum()) * p


@pytest.fixture(scope="module")
def policies():
    return conditionals(tiny_lm(1)), conditionals(tiny_lm(2))  # current p, draft policy q


def test_with_the_draft_policy_equal_to_the_current_one_the_output_is_the_current_policy_exactly(policies):
    p, _ = policies
    target = sequence_law(p)
    for lenience in (0.0, 0.5):
        law = procedure_law(p, p, lenience)
        assert sum(law.values()) == pytest.approx(1.0, abs=1e-12)
        assert max(abs(law[y] - target[y]) for y in target) < 1e-12


def test_b0_law_is_the_closed_form_and_no_further_from_the_current_policy_than_the_draft_policy(policies):
    p, q = policies
    law = procedure_law(p, q, 0.0)
    assert sum(law.values()) == pytest.approx(1.0, abs=1e-12)
    o = first_token(law)
    assert torch.allclose(o, closed_form(p[()], q[()], 0.0), atol=1e-12)
    tv_out = 0.5 * float((o - p[()]).abs().sum())
    tv_draft = 0.5 * float((q[()] - p[()]).abs().sum())
    assert tv_out <= tv_draft + 1e-12
    # the paper resamples the rejected token from p, not from the residual max(0, p - q): the law is not p
    target = sequence_law(p)
    assert tv_draft > 0.05 and max(abs(law[y] - target[y]) for y in target) > 1e-3
    # along the draft the same law holds at every position: at prefix (x,), given the draft kept x
    x = int(torch.argmax(q[()] * torch.minimum(torch.ones(VOCAB, dtype=torch.float64), p[()] / q[()])))
    kept = float(q[()][x] * min(1.0, float(p[()][x] / q[()][x])))
    rejected = 1.0 - float(torch.minimum(q[()], p[()]).sum())
    second = torch.zeros(VOCAB, dtype=torch.float64)
    for y, mass in law.items():
        if y[0] == x:
            second[y[1]] += mass
    expected = kept * closed_form(p[(x,)], q[(x,)], 0.0) + rejected * float(p[()][x]) * p[(x,)]
    assert torch.allclose(second, expected, atol=1e-12)


def test_lenience_moves_the_law_towards_the_draft_policy_as_the_formula_says(policies):
    p, q = policies
    for lenience in (0.5, 1.0, -0.5):
        assert torch.allclose(first_token(procedure_law(p, q, lenience)), closed_form(p[()], q[()], lenience), atol=1e-12)
    draft_law, current_law = sequence_law(q), sequence_law(p)
    keep_all, keep_none = procedure_law(p, q, 60.0), procedure_law(p, q, -60.0)
    assert max(abs(keep_all[y] - draft_law[y]) for y in draft_law) < 1e-12  # b -> inf: every draft kept
    assert max(abs(keep_none[y] - current_law[y]) for y in current_law) < 1e-12  # b -> -inf: plain sampling
    distances = [0.5 * float((first_token(procedure_law(p, q, b)) - q[()]).abs().sum()) for b in (0.0, 0.5, 1.0, 2.0)]
    assert distances == sorted(distances, reverse=True)  # towards q as b grows


# ---------------------------------------------------------------- the strategy


def problems(*uids):
    return [Problem(uid, f"question {uid}", "0") for uid in uids]


@pytest.fixture(scope="module")
def tiny():
    return load_policy(model_preset("tiny"), seed=0)


def hf_setup(tiny, n=3, max_new_tokens=6, seed=0):
    model, tokenizer = tiny
    engine = HFGenerateEngine(model, tokenizer, batch_size=16, progress=False)
    sampler = GroupSampler(engine, EvenTokenReward(), tokenizer, {"user": "{problem}"}, lambda r, _: r)
    return RolloutSetup(sampler, n, SamplingParams(1.0, 1.0, max_new_tokens), torch.Generator().manual_seed(seed))


def test_first_epoch_falls_back_to_sampling_and_says_so(tiny, caplog):
    setup = hf_setup(tiny)
    strategy = SpeculativeRollout(setup, SpeculativeOptions(0.0))
    with caplog.at_level(logging.INFO, logger="rlbench.rollout.strategies.speculative"):
        groups, metrics = strategy.rollout(problems("a", "b"))
    assert "2 of 2 prompts have no draft yet" in caplog.text
    assert metrics["speculative_fallback_prompts"] == 2 and metrics["speculative_draft_tokens"] == 0
    cost = setup.sampler.cost.take()
    assert cost["reused_tokens"] == 0 and cost["generated_tokens"] == sum(len(c.response_ids) for g in groups.groups for c in g)
    assert [len(g) for g in groups.groups] == [3, 3] and all(c.behaviour == "policy" for g in groups.groups for c in g)
    assert sorted(strategy.drafts) == ["a", "b"] and all(len(d) == 3 for d in strategy.drafts.values())


def test_unchanged_policy_keeps_every_draft_whole(tiny):
    setup = hf_setup(tiny)
    strategy = SpeculativeRollout(setup, SpeculativeOptions(0.0))
    first, _ = strategy.rollout(problems("a", "b"))
    setup.sampler.cost.take()
    second, metrics = strategy.rollout(problems("a", "b"))
    cost = setup.sampler.cost.take()
    assert [[c.response_ids for c in g] for g in second.groups] == [[c.response_ids for c in g] for g in first.groups]
    total = sum(len(c.response_ids) for g in second.groups for c in g)
    assert metrics["speculative_accept_rate"] == 1.0 and metrics["speculative_fallback_prompts"] == 0
    assert cost["generated_tokens"] == 0 and cost["reused_tokens"] == total and cost["generated_responses"] == 6
    assert all(c.behaviour == "draft" and c.off_policy is None for g in second.groups for c in g)
    # the reused responses carry the current policy's scores (pi_old is the current policy's)
    for g1, g2 in zip(first.groups, second.groups):
        for c1, c2 in zip(g1, g2):
            assert c2.logprobs == pytest.approx(c1.logprobs, abs=1e-4)


def test_rejecting_everything_samples_from_scratch(tiny):
    setup = hf_setup(tiny)
    strategy = SpeculativeRollout(setup, SpeculativeOptions(-1e4))
    strategy.rollout(problems("a"))
    setup.sampler.cost.take()
    groups, metrics = strategy.rollout(problems("a"))
    cost = setup.sampler.cost.take()
    assert metrics["speculative_accept_rate"] == 0.0 and cost["reused_tokens"] == 0
    assert all(c.prefix_len == 0 and c.behaviour == "policy" for c in groups.groups[0])


class ScriptedScoringEngine:
    """score_prefixes returns log(0.5) for every draft token; generate returns the prefix followed by
    budget-many copies of token 4; both record their calls."""

    def __init__(self):
        self.scored, self.calls = [], []

    def score_prefixes(self, items, params):
        self.scored.append(list(items))
        return [[math.log(0.5)] * len(prefix) for _, prefix in items]

    def generate(self, requests, params, generator=None):
        self.calls.append((params.max_new_tokens, [(r.prefix_ids, r.n) for r in requests]))
        return [[Completion(i, r.prompt_ids, [*r.prefix_ids, *[4] * params.max_new_tokens], [0.0] * (len(r.prefix_ids) + params.max_new_tokens),
                            False, prefix_len=len(r.prefix_ids)) for _ in range(r.n)] for i, r in enumerate(requests)]


class Tokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def scripted_setup(n=2, budget=8, seed=3):
    class Sampler(GroupSampler):
        def encode(self, problems):
            return [(int(p.uid),) for p in problems]

    sampler = Sampler(ScriptedScoringEngine(), EvenTokenReward(), Tokenizer(), {}, lambda r, _: r)
    return RolloutSetup(sampler, n, SamplingParams(1.0, 1.0, budget), torch.Generator().manual_seed(seed))


def test_regeneration_continues_each_draft_from_its_first_rejection_with_the_rest_of_the_budget():
    setup = scripted_setup()
    strategy = SpeculativeRollout(setup, SpeculativeOptions(0.0))
    # drafts sampled with p_old = 0.8 (log 0.8 > log 0.5 = current): each token kept with probability 0.625
    drafts = [Draft([1, 3, 5, 7, 9], [math.log(0.8)] * 5, True), Draft([2, 2, 2], [math.log(0.8)] * 3, True)]
    strategy.load_state_dict({"drafts": {"7": [d.as_state() for d in drafts]}})
    expected_generator = torch.Generator().manual_seed(3)
    cuts = []
    for d in drafts:
        u = torch.rand(len(d.response_ids), generator=expected_generator, dtype=torch.float64)
        cuts.append(first_rejection(torch.full((len(d.response_ids),), 0.625, dtype=torch.float64), u))
    groups, metrics = strategy.rollout(problems("7"))
    engine = setup.sampler.engine
    assert engine.scored == [[((7,), (1, 3, 5, 7, 9)), ((7,), (2, 2, 2))]]
    requested = {prefix: budget for budget, calls in engine.calls for prefix, _ in calls}
    for d, cut in zip(drafts, cuts):
        if cut < len(d.response_ids):
            assert requested[tuple(d.response_ids[:cut])] == budget_bucket(8 - cut, 8)
    assert metrics["speculative_accept_rate"] == pytest.approx(sum(cuts) / 8)
    for c, d, cut in zip(groups.groups[0], drafts, cuts):
        if cut == len(d.response_ids):  # kept whole: finished drafts are reused as they are
            assert c.response_ids == d.response_ids and c.finished
        else:  # continued to the budget, never past it
            assert c.response_ids[:cut] == d.response_ids[:cut] and len(c.response_ids) == 8 and not c.finished
        assert c.behaviour == ("draft" if cut else "policy")
    # the drafts of the next epoch are this epoch's responses, with their scores
    assert [d.response_ids for d in strategy.drafts["7"]] == [c.response_ids for c in groups.groups[0]]


def test_state_round_trip_gives_the_same_rollout():
    a, b = SpeculativeRollout(scripted_setup(), SpeculativeOptions(0.2)), SpeculativeRollout(scripted_setup(), SpeculativeOptions(0.2))
    a.rollout(problems("1", "2"))
    b.load_state_dict(a.state_dict())
    assert b.drafts == a.drafts
    ga, _ = a.rollout(problems("2", "1"))
    gb, _ = b.rollout(problems("2", "1"))
    assert [[c.response_ids for c in g] for g in ga.groups] == [[c.response_ids for c in g] for g in gb.groups]


def test_settings_are_checked_before_the_model_loads(make_cfg):
    cfg = rollout_config(make_cfg("rollout=speculative", "rollout.speculative.lenience=0.0").rollout)
    validate_strategy(cfg, "grpo")
    assert isinstance(make_strategy(cfg, scripted_setup()), SpeculativeRollout)
    with pytest.raises(ConfigError, match=r"rollout.speculative has no key\(s\) \['bias'\]"):
        validate_strategy(rollout_config({"strategy": "speculative", "n": 2, "speculative": {"bias": 1}}), "grpo")
    with pytest.raises(ConfigError, match="finite number"):
        validate_strategy(rollout_config({"strategy": "speculative", "n": 2, "speculative": {"lenience": float("inf")}}), "grpo")
    validate_strategy(rollout_config({"strategy": "speculative", "engine": "vllm", "n": 2}), "grpo")  # both engines score


@pytest.mark.slow
def test_cli_run_reuses_drafts_once_prompts_recur(tmp_path):
    """`rlbench experiment=smoke rollout=speculative` with 2 training prompts: step 1 has no draft (it
    says so in its metrics), step 2 verifies step 1's responses and reuses what it accepts."""
    first, second = smoke_cli_steps(
        tmp_path / "run", "rollout=speculative", "rollout.speculative.lenience=2.0", "dataset.arith.train_size=2"
    )
    assert first["speculative_fallback_prompts"] == 2 and first["reused_tokens"] == 0
    assert second["speculative_fallback_prompts"] == 0 and second["speculative_draft_tokens"] == 2 * 2 * 8
    assert second["reused_tokens"] == second["speculative_accept_rate"] * second["speculative_draft_tokens"] > 0
    # the tiny model never stops early; a regeneration may sample past its budget (power-of-two buckets) and is cut
    assert second["generated_tokens"] + second["reused_tokens"] >= 2 * 2 * 8
