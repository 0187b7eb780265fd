"""The engine's sampling hook (rlbench.rollout.engines.base.LogitsTransform) and the two strategies built on it:
rollout=adaptive_temperature (HAPO, arXiv:2509.16591) and rollout=masked (NLPO, arXiv:2210.01241).

Closed forms on hand-made entropies and distributions; on the tiny model, the sampled tokens and their
recorded log-probs are checked against the model's own logits recomputed here, and the training forward's
masked log-probs against the sampling ones."""

from __future__ import annotations

import enum
import math
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch

from rlbench.config.typed import rollout_config
from rlbench.algorithm.losses.ratio_clipped import EntropyScale
from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError
from rlbench.model import load_policy
from rlbench.reward.toy import EvenTokenReward
from rlbench.rollout import GroupSampler, HFGenerateEngine, RolloutSetup, validate_strategy
from rlbench.rollout.strategies.adaptive_temperature import (
    AdaptiveTemperatureRollout,
    AdaptiveTemperatureTransform,
    entropy_at,
    temperature_factors,
)
from rlbench.rollout.engines import vllm_logits
from rlbench.rollout.engines.base import GenerationRequest, SamplingParams
from rlbench.rollout.strategies.iid import IIDSampling
from rlbench.rollout.strategies.masked import MaskedRollout, MaskedSampling, apply_mask, top_p_mask
from rlbench.training.batch import collate
from rlbench.training.forward import token_outputs, training_logits_transform

from conftest import smoke_cli_steps, model_preset

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny():
    return load_policy(model_preset("tiny"), seed=0)


def hf_setup(model, tokenizer, n=4, max_new_tokens=6, seed=0, temperature=1.0):
    engine = HFGenerateEngine(model, tokenizer, batch_size=16, progress=False)
    sampler = GroupSampler(engine, EvenTokenReward(), tokenizer, {"user": "{problem}"}, lambda r, _: r)
    return RolloutSetup(sampler, n, SamplingParams(temperature, 1.0, max_new_tokens), torch.Generator().manual_seed(seed))


def problems(*uids):
    return [Problem(uid, f"question {uid}", "0") for uid in uids]


def responses(groups):
    return [[(c.response_ids, c.logprobs) for c in g] for g in groups.groups]


def position_logits(model, completion) -> torch.Tensor:
    """The model's raw logits that predict each response token of ``completion`` ([L, V], no padding)."""
    ids = torch.tensor([list(completion.prompt_ids) + completion.response_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    P = len(completion.prompt_ids)
    return logits[P - 1 : P - 1 + len(completion.response_ids)]


# ---------------------------------------------------------------- the engine hook


def test_a_transform_sees_every_running_rows_context_and_changes_what_is_sampled(tiny):
    model, tokenizer = tiny
    engine = HFGenerateEngine(model, tokenizer, batch_size=8, progress=False)
    prompt = (5, 6, 7)
    seen = []

    def only_token_9(logits, contexts):
        seen.append([tuple(c) for c in contexts])
        return apply_mask(logits, torch.arange(logits.shape[-1]) == 9)

    params = SamplingParams(1.0, 1.0, 3, logits_transform=only_token_9)
    [group] = engine.generate([GenerationRequest(prompt, n=2)], params, torch.Generator().manual_seed(0))
    assert [c.response_ids for c in group] == [[9, 9, 9], [9, 9, 9]]
    assert [c.logprobs for c in group] == [[0.0] * 3, [0.0] * 3]  # the only allowed token: log 1
    assert seen == [[prompt, prompt], [prompt + (9,)] * 2, [prompt + (9, 9)] * 2]
    with pytest.raises(ValueError, match="cannot score prefix_ids"):
        engine.generate([GenerationRequest(prompt, n=1, prefix_ids=(1,))], params, torch.Generator().manual_seed(0))


# ---------------------------------------------------------------- HAPO adaptive temperature


def test_temperature_factor_closed_form_on_hand_made_entropies():
    # log-entropies -2, -1, 0, 1, 3: median (pivot 0.5) 0, above = 3, below = 2
    scale = EntropyScale.fit(torch.exp(torch.tensor([-2.0, -1.0, 0.0, 1.0, 3.0])), torch.ones(5), 0.5)
    assert (scale.pivot, scale.above, scale.below) == pytest.approx((0.0, 3.0, 2.0), abs=1e-6)
    entropies = torch.exp(torch.tensor([1.5, -1.0, 6.0, -5.0, 0.0]))
    h = scale(entropies)
    assert h.tolist() == pytest.approx([0.5, -0.5, 1.0, -1.0, 0.0], abs=1e-6)  # clamped to [-1, 1]
    factors = temperature_factors(entropies, scale, 0.05)
    assert factors.tolist() == pytest.approx([1.025, 0.975, 1.05, 0.95, 1.0], abs=1e-6)
    assert torch.equal(temperature_factors(entropies, scale, 0.0), torch.ones(5))
    assert torch.equal(temperature_factors(entropies, None, 0.05), torch.ones(5))  # no statistics yet


def test_transform_divides_each_row_by_its_factor():
    # a uniform row over V tokens has entropy log V; a peaked row far less
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [8.0, 0.0, 0.0, 0.0]])
    entropy = entropy_at(logits, 1.0)
    assert entropy[0].item() == pytest.approx(math.log(4))
    scale = EntropyScale(pivot=float(torch.log(entropy).mean()), above=1.0, below=1.0)
    transform = AdaptiveTemperatureTransform(scale, 0.1, 1.0)
    out = transform(logits, [(1,), (2,)])
    expected = temperature_factors(entropy, scale, 0.1)
    assert expected[0] > 1 > expected[1]  # the uncertain row hotter, the confident one colder
    assert torch.allclose(out, logits / expected[:, None])
    assert torch.equal(transform.entropies[0], entropy)


def test_tau_zero_samples_exactly_what_iid_samples(tiny):
    model, tokenizer = tiny
    adaptive = AdaptiveTemperatureRollout(hf_setup(model, tokenizer, seed=3), tau=0.0, entropy_pivot=0.8)
    adaptive.load_state_dict({"scale": {"pivot": 0.5, "above": 0.7, "below": 1.3}})  # statistics present
    iid = IIDSampling(hf_setup(model, tokenizer, seed=3))
    for _ in range(2):
        a, metrics = adaptive.rollout(problems("1", "2"))
        b, _ = iid.rollout(problems("1", "2"))
        assert responses(a) == responses(b)
        assert metrics["adaptive_temperature_active"] == 1.0
        assert metrics["adaptive_temperature_min"] == metrics["adaptive_temperature_max"] == 1.0


def test_adaptive_samples_log_probs_are_those_of_the_per_token_temperature(tiny):
    model, tokenizer = tiny
    T, tau = 0.8, 0.5
    strategy = AdaptiveTemperatureRollout(hf_setup(model, tokenizer, temperature=T), tau=tau, entropy_pivot=0.8)
    first, metrics = strategy.rollout(problems("1", "2"))
    assert metrics == {"adaptive_temperature_active": 0.0}  # the first step samples at T
    scale = strategy.scale
    # fitted on the first step's sampled tokens: their entropies at T
    entropies = torch.cat([entropy_at(position_logits(model, c), T) for g in first.groups for c in g])
    expected = EntropyScale.fit(entropies, torch.ones_like(entropies), 0.8)
    assert (scale.pivot, scale.above, scale.below) == pytest.approx((expected.pivot, expected.above, expected.below), abs=1e-4)
    second, metrics = strategy.rollout(problems("1", "2"))
    assert T * (1 - tau) - 1e-6 <= metrics["adaptive_temperature_min"] < metrics["adaptive_temperature_max"] <= T * (1 + tau) + 1e-6
    assert adaptive_log_probs_match(model, second, scale, T, tau) > 0.1


def adaptive_log_probs_match(model, graded, scale, T, tau) -> float:
    """Assert that every recorded log-prob is that of T (1 + tau h) per token, recomputed from the model's
    logits; returns the largest gap to the plain temperature T's log-prob (how far the adaptation moved).
    The factor depends on the entropy, which a full forward and a decoding step's forward round
    differently: hence a tolerance of 1e-2, far below the 0.1+ nats the adaptation moves a log-prob."""
    moved = 0.0
    for c in (c for g in graded.groups for c in g):
        logits, targets = position_logits(model, c), torch.tensor(c.response_ids)[:, None]
        factors = temperature_factors(entropy_at(logits, T), scale, tau)
        logp = torch.log_softmax(logits / (T * factors[:, None]), dim=-1).gather(-1, targets).squeeze(-1)
        assert c.logprobs == pytest.approx(logp.tolist(), abs=1e-2)
        fixed = torch.log_softmax(logits / T, dim=-1).gather(-1, targets).squeeze(-1)
        moved = max(moved, float((fixed - torch.tensor(c.logprobs)).abs().max()))
    return moved


def test_adaptive_state_round_trip_gives_the_same_rollout(tiny):
    model, tokenizer = tiny
    a = AdaptiveTemperatureRollout(hf_setup(model, tokenizer, seed=1), tau=0.3, entropy_pivot=0.8)
    a.rollout(problems("1"))
    b = AdaptiveTemperatureRollout(hf_setup(model, tokenizer, seed=1), tau=0.3, entropy_pivot=0.8)
    b.load_state_dict(a.state_dict())
    b.setup.generator.set_state(a.setup.generator.get_state())
    assert responses(a.rollout(problems("2"))[0]) == responses(b.rollout(problems("2"))[0])


def test_adaptive_settings_are_checked_before_the_model_loads(make_cfg):
    validate_strategy(rollout_config(make_cfg("rollout=adaptive_temperature").rollout), "grpo")

    def cfg(**overrides):
        base = {"strategy": "adaptive_temperature", "n": 2, "temperature": 1.0, "adaptive_temperature": {}}
        for key, value in overrides.items():
            if key in ("tau", "entropy_pivot", "beta"):
                base["adaptive_temperature"][key] = value
            else:
                base[key] = value
        return rollout_config(base)

    for tau in (-0.1, 1.0):
        with pytest.raises(ConfigError, match=r"tau must be in \[0, 1\)"):
            validate_strategy(cfg(tau=tau), "grpo")
    with pytest.raises(ConfigError, match=r"rollout.adaptive_temperature.tau=nan is not a finite number"):
        validate_strategy(cfg(tau=float("nan")), "grpo")
    with pytest.raises(ConfigError, match="entropy_pivot is a quantile"):
        validate_strategy(cfg(entropy_pivot=1.5), "grpo")
    with pytest.raises(ConfigError, match="rollout.temperature > 0"):
        validate_strategy(cfg(temperature=0.0), "grpo")
    validate_strategy(cfg(engine="vllm"), "grpo")  # the vLLM engine runs the transform as a logits processor
    with pytest.raises(ConfigError, match=r"has no key\(s\) \['beta'\]"):
        validate_strategy(cfg(beta=1), "grpo")


# ---------------------------------------------------------------- NLPO mask


def test_top_p_mask_and_renormalisation_on_a_hand_made_distribution():
    probs = torch.tensor([0.15, 0.5, 0.05, 0.3])
    logits = probs.log()
    assert top_p_mask(logits, 0.9).tolist() == [True, True, False, True]
    assert top_p_mask(logits, 0.8).tolist() == [False, True, False, True]  # 0.5 + 0.3 reaches 0.8
    assert top_p_mask(logits, 0.5).tolist() == [False, True, False, False]
    assert top_p_mask(logits, 0.01).tolist() == [False, True, False, False]  # the top token always
    assert top_p_mask(logits, 1.0).all()
    allowed = top_p_mask(logits, 0.9)
    renormalised = torch.log_softmax(apply_mask(logits, allowed), dim=-1)
    assert renormalised.exp().tolist() == pytest.approx([0.15 / 0.95, 0.5 / 0.95, 0.0, 0.3 / 0.95])
    assert float(renormalised.exp()[allowed].sum()) == pytest.approx(1.0)


def test_top_p_mask_equals_the_sorted_definition_for_peaked_and_flat_rows():
    """The growing top-k of top_p_mask gives the set a full sort gives, whether the set is a few tokens or
    thousands (k grows past its start of 64)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.cat([torch.randn(3, 5000, generator=g) * 8, torch.randn(3, 5000, generator=g) * 0.1])
    for p in (0.3, 0.9, 0.999):
        probs = torch.softmax(logits, dim=-1)
        ordered, order = probs.sort(dim=-1, descending=True)
        expected = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, (ordered.cumsum(-1) - ordered) < p)
        mask = top_p_mask(logits, p)
        assert torch.equal(mask, expected)
        assert int(mask[3:].sum(-1).min()) > 64  # the flat rows needed more than the first top-k
    assert top_p_mask(logits.reshape(2, 3, 5000), 0.9).shape == (2, 3, 5000)


def masked_setup(tiny, seed=0, n=4, top_p=0.5, interval=1, temperature=1.0):
    model, tokenizer = tiny
    return MaskedRollout(hf_setup(model, tokenizer, n=n, seed=seed, temperature=temperature), top_p=top_p, update_interval=interval)


def test_masked_samples_lie_in_the_mask_and_their_log_probs_are_renormalised_on_it(tiny):
    model, _ = tiny
    T = 0.9
    strategy = masked_setup(tiny, top_p=0.5, temperature=T)
    groups, metrics = strategy.rollout(problems("1", "2", "3"))
    vocab = model.config.vocab_size
    assert 1 <= metrics["masked_allowed_tokens"] < vocab and metrics["masked_policy_age"] == 0
    completions = [c for g in groups.groups for c in g]
    for c in completions:
        logits = position_logits(model, c)  # the masking policy is the policy at its first rollout
        allowed = top_p_mask(logits, 0.5)
        targets = torch.tensor(c.response_ids)
        assert bool(allowed.gather(-1, targets[:, None]).all())  # no sampled token outside the mask
        masked = torch.log_softmax(apply_mask(logits / T, allowed), dim=-1)
        assert torch.allclose(masked.exp().sum(-1), torch.ones(len(targets)), atol=1e-5)
        assert float(masked.exp()[~allowed].sum()) == 0.0
        assert c.logprobs == pytest.approx(masked.gather(-1, targets[:, None]).squeeze(-1).tolist(), rel=2e-4, abs=1e-4)
    # the training forward renormalises on the same mask: pi_old of the loss is what was sampled
    batch = collate(groups.groups, strategy.setup.sampler.engine.pad_id)
    plain = token_outputs(model, batch, T).logp
    with training_logits_transform(strategy.training_logits_transform()):
        out = token_outputs(model, batch, T, with_entropy=True, with_log_probs=True)
    mask = batch.response_mask.bool()
    sampled = torch.zeros_like(out.logp)
    for row, c in enumerate(completions):
        sampled[row, : len(c.logprobs)] = torch.tensor(c.logprobs)
    assert torch.allclose(out.logp[mask], sampled[mask], atol=1e-4)
    assert bool((out.logp[mask] >= plain[mask] - 1e-6).all()) and bool((out.logp[mask] > plain[mask] + 1e-3).any())
    assert torch.allclose(out.log_probs.exp().sum(-1)[mask], torch.ones(int(mask.sum())), atol=1e-5)
    assert bool(torch.isfinite(out.entropy).all())


def test_the_masking_policys_own_cache_gives_the_masks_of_a_full_forward(tiny):
    model, _ = tiny
    vocab = model.config.vocab_size
    cached = MaskedSampling(model, 0.5, pad_id=0)
    contexts = [(5, 6, 7), (5, 6, 7), (8, 9)]
    g = torch.Generator().manual_seed(0)
    widths = []  # the input width of each forward of the masking policy
    hook = model.register_forward_pre_hook(lambda m, args, kwargs: widths.append(kwargs["input_ids"].shape[1]), with_kwargs=True)
    try:
        for step in range(4):
            logits = torch.zeros(len(contexts), vocab)
            with_cache, full = cached(logits, contexts), MaskedSampling(model, 0.5, pad_id=0)(logits, contexts)
            assert torch.equal(with_cache.isfinite(), full.isfinite())
            contexts = [c + (int(torch.randint(vocab, (1,), generator=g)),) for c in contexts]
            if step == 1:
                contexts = contexts[1:]  # a row finished and left the batch
    finally:
        hook.remove()
    assert widths[0::2] == [3, 1, 1, 1] and widths[1::2] == [3, 4, 5, 6]  # one token per step on its cache


def test_top_p_one_samples_exactly_what_iid_samples(tiny):
    model, tokenizer = tiny
    masked = masked_setup(tiny, seed=5, top_p=1.0)
    iid = IIDSampling(hf_setup(model, tokenizer, seed=5))
    assert responses(masked.rollout(problems("1", "2"))[0]) == responses(iid.rollout(problems("1", "2"))[0])


def test_the_masking_policy_is_a_copy_refreshed_every_mu_rollouts_and_saved_with_the_state(tiny):
    import copy

    model, tokenizer = tiny
    policy = copy.deepcopy(model)
    strategy = MaskedRollout(hf_setup(policy, tokenizer), top_p=0.5, update_interval=2)
    name, weight = next(iter(policy.state_dict().items()))
    original = weight.clone()

    def psi_weight():
        return strategy.masking_policy.state_dict()[name]

    strategy.rollout(problems("1"))  # rollout 0: pi_psi <- pi_theta
    assert torch.equal(psi_weight(), original) and strategy.masking_policy is not policy
    with torch.no_grad():
        weight.add_(1.0)  # an update of the policy
    _, metrics = strategy.rollout(problems("1"))  # rollout 1: pi_psi is one rollout old
    assert torch.equal(psi_weight(), original) and metrics["masked_policy_age"] == 1
    state = strategy.state_dict()
    _, metrics = strategy.rollout(problems("1"))  # rollout 2: refreshed
    assert torch.equal(psi_weight(), original + 1.0) and metrics["masked_policy_age"] == 0
    resumed = MaskedRollout(hf_setup(policy, tokenizer), top_p=0.5, update_interval=2)
    resumed.load_state_dict(state)
    assert resumed.rollouts == 2 and torch.equal(resumed.masking_policy.state_dict()[name], original)
    resumed.rollout(problems("1"))
    assert torch.equal(resumed.masking_policy.state_dict()[name], original + 1.0)


def test_masked_settings_are_checked_before_the_model_loads(make_cfg):
    cfg = rollout_config(make_cfg("rollout=masked").rollout)
    validate_strategy(cfg, "grpo")

    def block(**values):
        return rollout_config({"strategy": "masked", "n": 2, "temperature": 1.0, "masked": values})

    for p in (0.0, 1.5):
        with pytest.raises(ConfigError, match=r"top_p is the mask's probability mass, in \(0, 1\]"):
            validate_strategy(block(top_p=p), "grpo")
    with pytest.raises(ConfigError, match=r"rollout.masked.top_p=nan is not a finite number"):
        validate_strategy(block(top_p=float("nan")), "grpo")
    with pytest.raises(ConfigError, match="update_interval .* must be an integer >= 1"):
        validate_strategy(block(update_interval=0), "grpo")
    for mu in (1.5, True):
        with pytest.raises(ConfigError, match=f"rollout.masked.update_interval={mu} is not an integer"):
            validate_strategy(block(update_interval=mu), "grpo")
    with pytest.raises(ConfigError, match="rollout.engine=hf"):
        validate_strategy(rollout_config({"strategy": "masked", "engine": "vllm", "n": 2}), "grpo")


def test_masked_is_refused_with_stale_batches_and_with_trpo(make_cfg):
    from rlbench.validation import validate_config

    validate_config(make_cfg("rollout=masked", "trainer.max_staleness=0"))
    with pytest.raises(ConfigError, match="rollout=masked trains a batch with the mask of the policy copy that sampled it"):
        validate_config(make_cfg("rollout=masked", "trainer.max_staleness=1"))
    with pytest.raises(ConfigError, match="trpo schedule's KL over the whole vocabulary is undefined"):
        validate_config(make_cfg("rollout=masked", "algorithm=trpo"))


# ---------------------------------------------------------------- the transform inside vLLM (rlbench/rollout/engines/vllm_logits.py)


class _Direction(enum.Enum):
    UNIDIRECTIONAL = 1
    SWAP = 2


def _update(removed=(), added=(), moved=(), size=0):
    return SimpleNamespace(batch_size=size, removed=list(removed), added=list(added), moved=list(moved))


def _tagged(key):
    return SimpleNamespace(extra_args={vllm_logits.EXTRA_ARG: key})


def test_transform_rows_follow_the_batch_and_apply_the_hf_transform_per_row():
    """The pure part of the vLLM logits processor: the rows tagged with a registered transform get exactly
    what the HF engine's hook returns for the same logits; untagged rows are untouched; removals, one-way
    moves and swaps of vLLM's persistent batch carry each row's transform and context along."""
    torch.manual_seed(0)
    logits = torch.randn(5, 11) * 3
    scale = EntropyScale(pivot=0.5, above=0.7, below=1.3)
    seen = []

    def recording(rows, contexts):
        seen.append([tuple(c) for c in contexts])
        return AdaptiveTemperatureTransform(scale, 0.5, 0.8)(rows, contexts)

    rows = vllm_logits.TransformRows({7: recording}.__getitem__)
    outputs = [[] for _ in range(5)]
    # rows 0, 1, 3, 4 tagged (row 3 through a vLLM that passes no prompt ids), row 2 not
    rows.update(_update(added=[(0, _tagged(7), [1, 2], outputs[0]), (1, _tagged(7), [3], outputs[1]),
                               (2, SimpleNamespace(), [4], outputs[2]), (3, _tagged(7), outputs[3]),
                               (4, _tagged(7), [5], outputs[4])], size=5))
    outputs[0].append(9)  # the live output list: the context grows with it
    out = rows.apply(logits.clone())
    hf = AdaptiveTemperatureTransform(scale, 0.5, 0.8)(logits[[0, 1, 3, 4]], [])
    assert torch.equal(out[[0, 1, 3, 4]], hf) and torch.equal(out[2], logits[2])
    assert seen[-1] == [(1, 2, 9), (3,), (), (5,)]
    # row 1 leaves, row 4 moves into its place, rows 0 and 2 swap; an untagged request replaces row 3
    rows.update(_update(removed=[1], moved=[(4, 1, _Direction.UNIDIRECTIONAL), (0, 2, _Direction.SWAP)], size=4))
    rows.update(_update(added=[(3, SimpleNamespace(extra_args=None), [6], [])], size=4))
    out = rows.apply(logits[:4].clone())
    hf = AdaptiveTemperatureTransform(scale, 0.5, 0.8)(logits[[1, 2]], [])
    assert torch.equal(out[[1, 2]], hf) and torch.equal(out[[0, 3]], logits[[0, 3]])
    assert seen[-1] == [(5,), (1, 2, 9)]
    with pytest.raises(RuntimeError, match="VLLM_ENABLE_V1_MULTIPROCESSING=0"):
        vllm_logits.registered_transform(-1)


class _FakeVLLMSampler:
    """A stand-in ``vllm.LLM`` whose ``generate`` decodes on the HF model the way vLLM's V1 sampler does:
    the registered logits processor (built from a fake ``vllm.v1.sample.logits_processor``) follows the
    batch and transforms the raw float32 logits, then temperature, then the processed log-probs. After
    the first step the first row finishes and vLLM's condense moves the last row into its slot."""

    def __init__(self, model, processor_cls):
        self.model, self.processor = model, processor_cls(None, torch.device("cpu"), False)

    def generate(self, prompts, sps, use_tqdm=False):
        outputs = [[] for _ in prompts]
        logprobs = [[] for _ in prompts]
        self.processor.update_state(_update(added=[(j, sp, p["prompt_token_ids"], outputs[j]) for j, (p, sp) in enumerate(zip(prompts, sps))], size=len(prompts)))
        generators = [torch.Generator().manual_seed(sp.seed) for sp in sps]
        slots = list(range(len(prompts)))
        for step in range(sps[0].max_tokens):
            if step == 1 and len(slots) > 2:
                last = len(slots) - 1
                self.processor.update_state(_update(removed=[0], moved=[(last, 0, _Direction.UNIDIRECTIONAL)], size=last))
                slots = [slots[last]] + slots[1:last]
            with torch.no_grad():
                logits = torch.stack([self.model(input_ids=torch.tensor([prompts[j]["prompt_token_ids"] + outputs[j]])).logits[0, -1].float() for j in slots])
            logits = self.processor.apply(logits)
            logp = torch.log_softmax(logits / torch.tensor([[sps[j].temperature] for j in slots]), dim=-1)
            for row, j in enumerate(slots):
                token = int(torch.multinomial(logp[row].exp(), 1, generator=generators[j]))
                outputs[j].append(token)
                logprobs[j].append({token: SimpleNamespace(logprob=float(logp[row, token]))})
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=o, logprobs=lp, finish_reason="length", text="")])
                for o, lp in zip(outputs, logprobs)]


@pytest.fixture
def fake_vllm(monkeypatch):
    """``vllm.v1.sample.logits_processor`` with the base class the engine's processor subclasses."""
    module = ModuleType("vllm.v1.sample.logits_processor")
    module.LogitsProcessor = type("LogitsProcessor", (), {})
    for name in ("vllm", "vllm.v1", "vllm.v1.sample"):
        monkeypatch.setitem(sys.modules, name, ModuleType(name))
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(vllm_logits, "_PROCESSOR", None)
    yield vllm_logits.processor_class()


def test_adaptive_temperature_through_the_vllm_logits_processor(tiny, fake_vllm):
    """rollout=adaptive_temperature on the vLLM engine (the sampler a stand-in that decodes like vLLM's):
    the log-probs of the sampled tokens are those of T (1 + tau h) per token, recomputed here from the
    model's logits, and the entropies recorded for the next step's scale are the sampled steps'."""
    from rlbench.rollout.engines.vllm import VLLMEngine

    model, tokenizer = tiny
    processor = fake_vllm
    assert not processor(None, "cpu", False).is_argmax_invariant()  # raw logits, before temperature
    T, tau = 0.8, 0.5
    llm = _FakeVLLMSampler(model, processor)
    engine = VLLMEngine(model, tokenizer, llm=llm, sampling_params_factory=SimpleNamespace, logits_transforms=True)
    sampler = GroupSampler(engine, EvenTokenReward(), tokenizer, {"user": "{problem}"}, lambda r, _: r)
    setup = RolloutSetup(sampler, 3, SamplingParams(T, 1.0, 4), torch.Generator().manual_seed(0))
    strategy = AdaptiveTemperatureRollout(setup, tau=tau, entropy_pivot=0.8)
    first, metrics = strategy.rollout(problems("1", "2"))
    assert metrics == {"adaptive_temperature_active": 0.0}
    entropies = torch.cat([entropy_at(position_logits(model, c), T) for g in first.groups for c in g])
    expected = EntropyScale.fit(entropies, torch.ones_like(entropies), 0.8)
    scale = strategy.scale
    assert (scale.pivot, scale.above, scale.below) == pytest.approx((expected.pivot, expected.above, expected.below), abs=1e-4)
    second, metrics = strategy.rollout(problems("1", "2"))
    assert metrics["adaptive_temperature_min"] < metrics["adaptive_temperature_max"]
    assert adaptive_log_probs_match(model, second, scale, T, tau) > 0.05
    assert vllm_logits._TRANSFORMS == {}  # released after each call
    with pytest.raises(ValueError, match="cannot score prefix_ids"):
        engine.generate([GenerationRequest((1, 2), prefix_ids=(3,))], SamplingParams(logits_transform=lambda lg, ctx: lg))


def test_a_vllm_engine_without_the_processor_refuses_a_transform(tiny):
    from rlbench.rollout.engines.vllm import VLLMEngine

    model, tokenizer = tiny
    engine = VLLMEngine(model, tokenizer, llm=object(), sampling_params_factory=dict)
    with pytest.raises(ValueError, match="use vLLM >= 0.10.2 or rollout.engine=hf"):
        engine.generate([GenerationRequest((1,))], SamplingParams(logits_transform=lambda logits, contexts: logits))


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["adaptive_temperature", "masked"])
def test_cli_run(tmp_path, strategy):
    """`rlbench experiment=smoke rollout=<strategy>`: two steps, the strategy's metrics logged."""
    first, second = smoke_cli_steps(tmp_path / "run", f"rollout={strategy}")
    if strategy == "adaptive_temperature":
        assert first["adaptive_temperature_active"] == 0.0 and second["adaptive_temperature_active"] == 1.0
        assert 0.95 - 1e-6 <= second["adaptive_temperature_min"] <= second["adaptive_temperature_max"] <= 1.05 + 1e-6  # T = 1, tau 0.05
    else:
        assert first["masked_policy_age"] == 0.0 and second["masked_policy_age"] == 1.0
        assert second["masked_allowed_tokens"] >= 1
    assert second["generated_tokens"] > 0
