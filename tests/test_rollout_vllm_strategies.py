"""The strategies that read the policy's distribution (speculative, lookahead, entropy_branch) or change it
while decoding (adaptive_temperature) on the vLLM engine, against the HF engine on the same prompts
(GPU, marker ``gpu``; skipped without CUDA or vLLM). The CPU checks of the same code paths are in the
strategies' own test files and in tests/test_rollout_sampling_transforms.py (the logits processor)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlbench.dataset.base import Problem
from rlbench.model import load_policy
from rlbench.reward.toy import EvenTokenReward
from rlbench.rollout import GroupSampler, HFGenerateEngine, RolloutSetup, SamplingParams
from rlbench.rollout.strategies.adaptive_temperature import AdaptiveTemperatureRollout, entropy_at, temperature_factors
from rlbench.rollout.strategies.entropy_branch import EntropyBranchOptions, EntropyBranchRollout
from rlbench.rollout.strategies.lookahead import LookaheadOptions, LookaheadRollout
from rlbench.rollout.strategies.speculative import SpeculativeOptions, SpeculativeRollout

from conftest import has_vllm_gpu, model_preset

ROOT = Path(__file__).resolve().parents[1]
BUDGET = 16
PROBLEMS = [Problem(uid="p0", prompt="1 + 2", answer="3"), Problem(uid="p1", prompt="3 + 4", answer="7")]


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not has_vllm_gpu(), reason="needs CUDA and vLLM")]


@pytest.fixture(scope="module")
def engines():
    """``{"hf": ..., "vllm": ...}`` on one SmolLM2 policy (the vLLM engine scores on that same model)."""
    from rlbench.rollout.engines.vllm import VLLMEngine

    model, tokenizer = load_policy(model_preset("smollm2_135m"), device="cuda")
    vllm_engine = VLLMEngine(model, tokenizer, gpu_memory_utilization=0.2, enforce_eager=True)
    assert vllm_engine.logits_transforms
    return {"hf": HFGenerateEngine(model, tokenizer, progress=False), "vllm": vllm_engine}


def _setup(engine, n=4, temperature=1.0, seed=0) -> RolloutSetup:
    sampler = GroupSampler(engine, EvenTokenReward(), engine.tokenizer, {"system": None, "user": "{problem}"}, lambda r, i: r)
    return RolloutSetup(sampler, n, SamplingParams(temperature, 1.0, BUDGET), torch.Generator().manual_seed(seed))


def _completions(graded):
    return [c for g in graded.groups for c in g]


@pytest.mark.parametrize("name", ["hf", "vllm"])
def test_speculative_on_both_engines(engines, name):
    """Drafts sampled by the engine and verified by its score_prefixes at unchanged weights are accepted
    (b = 0.5 dwarfs the bf16 gap between vLLM's log-probs and the HF scorer's); both engines score the
    same drafts identically (the vLLM engine scores on the same HF model)."""
    strategy = SpeculativeRollout(_setup(engines[name]), SpeculativeOptions(lenience=0.5))
    first, metrics = strategy.rollout(PROBLEMS)
    assert metrics["speculative_fallback_prompts"] == 2
    second, metrics = strategy.rollout(PROBLEMS)
    assert metrics["speculative_fallback_prompts"] == 0 and metrics["speculative_draft_tokens"] > 0
    assert metrics["speculative_accept_rate"] >= 0.9
    assert [len(g) for g in second.groups] == [4, 4]
    assert all(len(c.response_ids) <= BUDGET and c.behaviour == "draft" for c in _completions(second) if c.prefix_len)
    items = [(c.prompt_ids, tuple(c.response_ids)) for c in _completions(first)]
    params = SamplingParams(1.0, 1.0, BUDGET)
    assert engines["vllm"].score_prefixes(items, params) == engines["hf"].score_prefixes(items, params)


@pytest.mark.parametrize("name", ["hf", "vllm"])
def test_lookahead_on_both_engines(engines, name):
    """Every trunk position a branch point and no pruning: each trunk gets n - 1 branches that share it up
    to their branch token, the top-two token (by the engine's position_stats) the trunk did not take; the
    vLLM engine's statistics are the HF engine's."""
    engine = engines[name]
    setup = _setup(engine)
    options = LookaheadOptions(abs_threshold=0.0, rel_threshold=1.0, checkpoints=(4,), rouge_l_threshold=1.0, mode="resample")
    graded, metrics = LookaheadRollout(setup, options).rollout(PROBLEMS)
    assert [len(g) for g in graded.groups] == [4, 4]
    trunks = [g[0] for g in graded.groups]
    items = [(t.prompt_ids, tuple(t.response_ids)) for t in trunks]
    stats = engine.position_stats(items, setup.params)
    other = engines["hf" if name == "vllm" else "vllm"].position_stats(items, setup.params)
    assert all(torch.equal(a.top_tokens, b.top_tokens) and torch.equal(a.entropy, b.entropy) for a, b in zip(stats, other))
    for trunk, s, group in zip(trunks, stats, graded.groups):
        for branch in group[1:]:
            if branch.behaviour != "branch":
                continue  # a short trunk's group filled with i.i.d. responses
            t = next(i for i, (a, b) in enumerate(zip(branch.response_ids, trunk.response_ids)) if a != b)
            top = [int(x) for x in s.top_tokens[t]]
            assert branch.response_ids[t] in top and trunk.response_ids[t] != branch.response_ids[t]
            assert len(branch.response_ids) <= BUDGET


@pytest.mark.parametrize("name", ["hf", "vllm"])
def test_entropy_branch_on_both_engines(engines, name):
    """beta 0 and threshold 0: m = floor(n / 2) + 1 = 3 global samples per prompt and one branch, which
    continues a global sample from a segment boundary."""
    options = EntropyBranchOptions(segment_tokens=4, beta=0.0, branch_threshold=0.0)
    graded, metrics = EntropyBranchRollout(_setup(engines[name]), options).rollout(PROBLEMS)
    assert metrics["entropy_branch_global"] == 6
    assert metrics["entropy_branch_branches"] + metrics["entropy_branch_filled"] == 2
    for group in graded.groups:
        assert len(group) == 4
        globals_ = [c for c in group if c.behaviour != "branch"]
        for branch in (c for c in group if c.behaviour == "branch"):
            assert branch.prefix_len % 4 == 0 and len(branch.response_ids) <= BUDGET
            assert any(g.response_ids[: branch.prefix_len] == branch.response_ids[: branch.prefix_len] for g in globals_)


@pytest.mark.parametrize("name", ["hf", "vllm"])
def test_adaptive_temperature_on_both_engines(engines, name):
    """Once the entropy statistics exist, the recorded log-probs are those of T (1 + tau h) per token,
    recomputed here from the HF model's logits: closer to them than to the plain temperature T's (vLLM's
    bf16 kernels and the cached decoding steps round differently from one full forward)."""
    T, tau = 0.8, 0.5
    engine = engines[name]
    strategy = AdaptiveTemperatureRollout(_setup(engine, temperature=T), tau=tau, entropy_pivot=0.8)
    strategy.rollout(PROBLEMS)
    assert strategy.scale is not None
    graded, metrics = strategy.rollout(PROBLEMS)
    assert T * (1 - tau) - 1e-5 <= metrics["adaptive_temperature_min"] < metrics["adaptive_temperature_max"] <= T * (1 + tau) + 1e-5
    model = engines["hf"].model
    adaptive_gap, plain_gap = [], []
    for c in _completions(graded):
        ids = torch.tensor([list(c.prompt_ids) + c.response_ids], device="cuda")
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(c.prompt_ids) - 1 : -1].float()
        targets = ids[0, len(c.prompt_ids) :, None]
        factors = temperature_factors(entropy_at(logits, T), strategy.scale, tau)
        adaptive = torch.log_softmax(logits / (T * factors[:, None]), -1).gather(-1, targets).squeeze(-1).cpu()
        plain = torch.log_softmax(logits / T, -1).gather(-1, targets).squeeze(-1).cpu()
        recorded = torch.tensor(c.logprobs)
        adaptive_gap.append((recorded - adaptive).abs())
        plain_gap.append((recorded - plain).abs())
    adaptive_gap, plain_gap = torch.cat(adaptive_gap), torch.cat(plain_gap)
    assert float(adaptive_gap.mean()) < 5e-2 and float(adaptive_gap.mean()) < float(plain_gap.mean())
