"""The HF engine's KV cache across calls (rlbench/rollout/engines/prefix_cache.py, ``rollout.prefix_cache_mb``):
the LRU itself, and the engine with it against the engine without it at the same seed."""

from __future__ import annotations

import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from rlbench.config.schema import RolloutConfig
from rlbench.model import build_tiny_model
from rlbench.rollout import GenerationRequest, HFGenerateEngine, SamplingParams, make_engine
from rlbench.rollout.engines.prefix_cache import PrefixKVCache, kv_bytes

from test_rollout import _prompt, eos_model, tiny  # noqa: F401  (fixtures: the tiny model, and one that ends at EOS often)

LOGPROB_TOLERANCE = 1e-5  # a forward over fewer, differently padded tokens: float rounding only


def _kv(length: int, layers: int = 2, value: float = 0.0):
    """Stand-in keys and values of ``length`` positions: 2 heads x 4 dims, float32 (32 bytes a position
    per tensor)."""
    return tuple((torch.full((2, length, 4), value), torch.full((2, length, 4), value)) for _ in range(layers))


# ---------------------------------------------------------------- the LRU


def test_longest_stored_prefix_within_the_limit():
    cache = PrefixKVCache(10**6)
    cache.put((1, 2), _kv(2, value=2))
    cache.put((1, 2, 3, 4), _kv(4, value=4))
    cache.put((9, 9, 9), _kv(3))
    length, kv = cache.longest_prefix((1, 2, 3, 4, 5), limit=4)
    assert length == 4 and kv[0][0][0, 0, 0] == 4
    assert cache.longest_prefix((1, 2, 3, 4, 5), limit=3)[0] == 2  # the longer one would leave too few tokens
    assert cache.longest_prefix((1, 2, 7), limit=2)[0] == 2
    assert cache.longest_prefix((1, 3, 3, 4), limit=9) == (0, None)  # exact token match only
    assert cache.longest_prefix((9, 9), limit=9) == (0, None)  # a stored sequence longer than the input is no prefix
    assert (cache.stats.hits, cache.stats.misses, cache.stats.reused_tokens) == (3, 2, 4 + 2 + 2)


def test_budget_evicts_least_recently_used():
    per_position = 2 * 2 * (2 * 4 * 4)  # layers x (keys, values) x heads x dims x float32 bytes
    assert kv_bytes(_kv(1)) == per_position
    cache = PrefixKVCache(10 * per_position)
    cache.put((1, 1, 1, 1), _kv(4))
    cache.put((2, 2, 2, 2), _kv(4))
    cache.longest_prefix((1, 1, 1, 1, 5), limit=4)  # (1,1,1,1) is now the most recently used
    cache.put((3, 3, 3, 3), _kv(4))  # 12 positions > 10: the least recently used goes
    assert set(cache.entries) == {(1, 1, 1, 1), (3, 3, 3, 3)} and cache.bytes == 8 * per_position
    assert cache.stats.evicted == 1
    cache.put((4,) * 11, _kv(11))  # larger than the whole budget: not stored, nothing evicted
    assert len(cache) == 2 and cache.stats.evicted == 1
    cache.put((3, 3, 3, 3), _kv(4))  # already there: no second copy
    assert cache.bytes == 8 * per_position


def test_zero_budget_stores_nothing_and_clear_forgets_everything():
    off = PrefixKVCache(0)
    off.put((1, 2), _kv(2))
    assert not off.enabled and len(off) == 0
    with pytest.raises(ValueError, match="budget_bytes"):
        PrefixKVCache(-1)
    cache = PrefixKVCache(10**6)
    cache.put((1, 2), _kv(2))
    cache.clear()
    assert len(cache) == 0 and cache.bytes == 0 and cache.lengths == {} and cache.stats.invalidations == 1
    assert cache.longest_prefix((1, 2, 3), limit=2) == (0, None)


# ---------------------------------------------------------------- the engine


def _rounds(engine, tokenizer, rounds=4, seed=3, temperature=1.0, top_p=1.0):
    """Tree-like calls: each round extends some of the last round's responses (as rollout=tree does),
    scoring the prefix in round 2; per round, every completion's (tokens, log-probs, finished)."""
    prompts = [_prompt(tokenizer, t) for t in ("The quick brown fox", "hi", "what is 2 + 3 ?")]
    generator = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=4)
    todo = [(p, ()) for p in prompts]
    seen = []
    for r in range(rounds):
        requests = [GenerationRequest(p, n=2, prefix_ids=x, score_prefix=r == 2) for p, x in todo]
        out = engine.generate(requests, params, generator)
        seen.append([[(c.response_ids, c.logprobs, c.finished) for c in cs] for cs in out])
        todo = [(req.prompt_ids, tuple(c.response_ids)) for req, cs in zip(requests, out) for c in cs if not c.finished][:5]
        todo = todo or [(p, ()) for p in prompts]
    return seen


def _assert_same(cached, uncached):
    """Same tokens and ends; log-probs equal up to float rounding (NaN where a prefix was not scored)."""
    assert [[[(t, f) for t, _, f in cs] for cs in r] for r in cached] == [[[(t, f) for t, _, f in cs] for cs in r] for r in uncached]
    for a, b in zip(cached, uncached):
        for ca, cb in zip(a, b):
            for (_, la, _), (_, lb, _) in zip(ca, cb):
                assert [math.isnan(x) for x in la] == [math.isnan(x) for x in lb]
                assert max((abs(x - y) for x, y in zip(la, lb) if not math.isnan(x)), default=0.0) <= LOGPROB_TOLERANCE


@pytest.mark.parametrize("which,batch_size,temperature,top_p", [("tiny", 5, 1.0, 1.0), ("eos_model", 3, 1.0, 0.95), ("tiny", 64, 1.0, 1.0)])
def test_cached_engine_samples_what_the_uncached_one_does(request, which, batch_size, temperature, top_p):
    """Same seed, same calls: the engine that reuses kept KV draws the same tokens, with the same
    log-probs up to float rounding, and it did reuse (hits, tokens not prefilled again)."""
    model, tokenizer = request.getfixturevalue(which)
    uncached = _rounds(HFGenerateEngine(model, tokenizer, batch_size=batch_size, progress=False), tokenizer,
                       temperature=temperature, top_p=top_p)
    engine = HFGenerateEngine(model, tokenizer, batch_size=batch_size, progress=False, prefix_cache_mb=16)
    cached = _rounds(engine, tokenizer, temperature=temperature, top_p=top_p)
    _assert_same(cached, uncached)
    stats = engine.prefix_cache.stats
    assert stats.hits > 0 and stats.reused_tokens > 0 and stats.stored > 0


def test_a_hit_prefills_only_the_new_tokens(tiny):
    """Extending a response kept from the last call runs its last sampled token only (its KV was
    never computed), not the prompt and the prefix again."""
    model, tokenizer = tiny
    engine = HFGenerateEngine(model, tokenizer, progress=False, prefix_cache_mb=16)
    prompt = _prompt(tokenizer, "Once upon a time")
    params = SamplingParams(max_new_tokens=5)
    (first,) = engine.generate([GenerationRequest(prompt, n=1)], params, torch.Generator().manual_seed(0))
    widths: list[int] = []
    hook = model.register_forward_pre_hook(lambda module, args, kwargs: widths.append(kwargs["input_ids"].shape[1]), with_kwargs=True)
    try:
        prefix = tuple(first[0].response_ids)
        engine.generate([GenerationRequest(prompt, n=2, prefix_ids=prefix, score_prefix=False)], params, torch.Generator().manual_seed(1))
    finally:
        hook.remove()
    assert widths[0] == 1  # the prefill: one token, not len(prompt) + 5
    assert engine.prefix_cache.stats.reused_tokens == len(prompt) + len(prefix) - 1


def test_new_weights_empty_the_cache(tiny):
    """sync_weights, and a parameter written in place (an optimizer step), drop the kept KV: the next
    call samples exactly what an engine without a cache samples from the new weights."""
    _, tokenizer = tiny
    model = build_tiny_model(tokenizer, None, seed=5)
    engine = HFGenerateEngine(model, tokenizer, batch_size=5, progress=False, prefix_cache_mb=16)
    _rounds(engine, tokenizer, rounds=2)
    assert len(engine.prefix_cache) > 0
    engine.sync_weights(model)
    assert len(engine.prefix_cache) == 0 and engine.prefix_cache.stats.invalidations == 1

    _rounds(engine, tokenizer, rounds=2)
    kept = len(engine.prefix_cache)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(1.5)  # in place, no sync_weights
    engine.generate([GenerationRequest((5, 6), n=1)], SamplingParams(max_new_tokens=1), torch.Generator().manual_seed(0))
    assert kept > 1 and engine.prefix_cache.stats.invalidations == 2
    assert list(engine.prefix_cache.entries) == [(5, 6)]  # the old entries went; this call's row stays

    fresh = HFGenerateEngine(model, tokenizer, batch_size=5, progress=False, prefix_cache_mb=16)
    engine.prefix_cache.clear()
    for _ in range(2):  # both hold (or lack) the same entries before each comparison
        a, b = _rounds(engine, tokenizer, rounds=3, seed=8), _rounds(fresh, tokenizer, rounds=3, seed=8)
        _assert_same(a, b)
        _assert_same(a, _rounds(HFGenerateEngine(model, tokenizer, batch_size=5, progress=False), tokenizer, rounds=3, seed=8))


def test_no_reuse_under_fsdp_or_when_off(tiny):
    """FSDP's collective forwards must match across ranks (synced_gpus): nothing is kept then; nor with
    a zero budget."""
    model, tokenizer = tiny
    synced = HFGenerateEngine(model, tokenizer, progress=False, prefix_cache_mb=16)
    synced.synced_gpus = True
    off = HFGenerateEngine(model, tokenizer, progress=False)
    for engine in (synced, off):
        _rounds(engine, tokenizer, rounds=2)
        assert len(engine.prefix_cache) == 0 and engine.prefix_cache.stats.hits == 0


def test_make_engine_reads_the_budget(tiny):
    model, tokenizer = tiny
    engine = make_engine(RolloutConfig(engine="hf", prefix_cache_mb=2.0), model, tokenizer)
    assert engine.prefix_cache.budget_bytes == 2 * 2**20
    assert not make_engine(RolloutConfig(engine="hf"), model, tokenizer).prefix_cache.enabled

