"""Per-role LoRA adapters (model.lora.per_role; AT-GRPO's per-role policies, arXiv:2510.11062, section 3): each role
of env=proposer_verifier samples its turns with its own adapter on the same frozen base (the engine switches per
request, with a KV cache per adapter) and trains its tokens under it alone; identical adapters are the shared
policy; the settings that cannot honour it are refused before the model loads."""

from __future__ import annotations

import math

import pytest
import torch
from omegaconf import OmegaConf
from test_env_multi_turn import ScriptedEngine, Tokens
from test_env_proposer_verifier import PROBLEM, factory
from test_trainer import algo, tiny_lm

from conftest import compose_config, model_preset
from rlbench.errors import ConfigError
from rlbench.model import build_tiny_model, load_policy
from rlbench.model.lora import active_adapter, apply_lora, role_adapters
from rlbench.reward.math import MathReward
from rlbench.rollout import GenerationRequest, GroupSampler, HFGenerateEngine, RolloutSetup, SamplingParams
from rlbench.rollout.engines.base import Completion
from rlbench.rollout.env.proposer_verifier import ProposerVerifier
from rlbench.rollout.strategies.multi_turn import MultiTurnRollout
from rlbench.training.batch import collate
from rlbench.training.update import standard_update
from rlbench.validation import validate_config

ROLES = ProposerVerifier.roles  # ("proposer", "verifier")
TARGETS = ["q_proj", "v_proj"]


def lora_cfg(**overrides):
    return OmegaConf.create({"r": 2, "alpha": 6.0, "dropout": 0.0, "target_modules": TARGETS, "merge_on_save": False,
                             "per_role": False, **overrides})


def role_params(model, role):
    return {name: p for name, p in model.named_parameters() if f".{role}." in name}


def set_b(model, adapters, seed=1, scale=0.3):
    """B != 0 (peft starts it at 0, where dL/dA vanishes): the same random B in every adapter of ``adapters``."""
    g = torch.Generator().manual_seed(seed)
    params = {a: {n.replace(f".{a}.", "."): p for n, p in model.named_parameters() if f".{a}." in n and "lora_B" in n}
              for a in adapters}
    with torch.no_grad():
        for key, p in params[adapters[0]].items():
            value = scale * torch.randn(p.shape, generator=g)
            for a in adapters:
                params[a][key].copy_(value)


def two_turn_batch(advantage_of_turn):
    """2 groups x 3 episodes: a proposer turn (turn 0), an observation (loss mask 0), a verifier turn (turn 1);
    every token of turn t gets advantage ``advantage_of_turn[t]`` times a per-episode sign."""
    g = torch.Generator().manual_seed(3)
    groups = []
    for i in range(2):
        prompt = tuple(torch.randint(3, 32, (3 + i,), generator=g).tolist())
        group = []
        for _ in range(3):
            turn0, obs, turn1 = (torch.randint(3, 32, (k,), generator=g).tolist() for k in (3, 2, 4))
            ids = turn0 + obs + turn1
            steps = [0] * 3 + [-1] * 2 + [1] * 4
            group.append(Completion(i, prompt, ids, [0.0] * len(ids), True, loss_mask=[1] * 3 + [0] * 2 + [1] * 4,
                                    extras={"step_index": steps}))
        groups.append(group)
    batch = collate(groups, pad_token_id=0)
    step = batch.extras["step_index"]
    signs = torch.tensor([1.0, -1.0, 0.5] * 2)[:, None]
    batch.advantages = signs * sum(torch.where(step == t, a, 0.0) for t, a in enumerate(advantage_of_turn)) * batch.response_mask
    batch.rewards = torch.zeros(batch.size)
    return batch


def update_once(model, batch, optimizer=None, max_grad_norm=1.0):
    optimizer = optimizer or torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.0)  # the trainer's default (trainer.weight_decay)
    return standard_update(model, optimizer, batch, algo("token_mean"), micro_batch_size=3, max_grad_norm=max_grad_norm,
                           temperature=1.0, norm_length=9)


@pytest.mark.parametrize("acting", [0, 1])
def test_one_update_changes_only_the_acting_roles_adapter(acting):
    """Only turn ``acting``'s tokens carry advantage: after one AdamW step its role's adapter moved and the other
    role's is bit-identical (its tokens are trained under it alone, with advantage 0: gradient 0), and so is the base."""
    model = apply_lora(tiny_lm(0), lora_cfg(), ROLES)
    set_b(model, ROLES)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    update_once(model, two_turn_batch([1.0 if t == acting else 0.0 for t in range(2)]))
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert moved and moved == set(role_params(model, ROLES[acting]))  # A and B of every adapted layer, that role's only


def test_identical_adapters_are_the_shared_policy():
    """Both adapters identical at init: the first step's loss equals the shared adapter's, and each role's adapter gets
    the shared adapter's gradient from that role's tokens alone (so the two add up to the shared gradient)."""
    def grads(model, batch):
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = RecordingOptimizer(params)
        metrics = update_once(model, batch, optimizer, max_grad_norm=None)
        return metrics, {n: g for (n, p), g in zip([(n, p) for n, p in model.named_parameters() if p.requires_grad],
                                                   optimizer.steps[0])}

    shared = apply_lora(tiny_lm(0), lora_cfg())
    set_b(shared, ("default",))
    roles = apply_lora(tiny_lm(0), lora_cfg(), ROLES)
    set_b(roles, ROLES)
    for a, b in zip(role_params(shared, "default").values(), role_params(roles, "verifier").values()):
        assert torch.equal(a, b)  # the same A (drawn alike, copied into every role) and B
    full = [1.0, -2.0]
    batch = two_turn_batch(full)
    shared_metrics, shared_grads = grads(shared, batch)
    role_metrics, role_grads = grads(roles, batch)
    assert role_metrics["policy_loss"] == pytest.approx(shared_metrics["policy_loss"], abs=1e-7)
    assert shared_metrics["policy_loss"] != 0
    for t, role in enumerate(ROLES):  # the shared gradient from turn t's tokens alone
        _, alone = grads(shared, two_turn_batch([a if s == t else 0.0 for s, a in enumerate(full)]))
        for name, g in alone.items():
            assert g.abs().max() > 0
            assert torch.allclose(role_grads[name.replace(".default.", f".{role}.")], g, atol=1e-6, rtol=1e-5), name


class RecordingOptimizer:
    """Records the gradient of each parameter at each step (None: zeros) and changes nothing."""

    def __init__(self, params):
        self.params, self.steps = list(params), []

    def step(self):
        self.steps.append([p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in self.params])

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None


@pytest.fixture(scope="module")
def tokenizer():
    return load_policy(model_preset("tiny"), seed=0)[1]


def role_engine(tokenizer, cache_mb=0.0):
    model = apply_lora(build_tiny_model(tokenizer, None, seed=3), lora_cfg(), ROLES)
    for k, role in enumerate(ROLES):  # adapters that differ
        set_b(model, (role,), seed=10 + k, scale=0.5)
    return model, HFGenerateEngine(model, tokenizer, batch_size=8, progress=False, prefix_cache_mb=cache_mb)


def recomputed(model, adapter, completion):
    """log pi_adapter of the completion's sampled tokens, one unpadded forward."""
    ids = torch.tensor([list(completion.prompt_ids) + completion.response_ids])
    with torch.no_grad(), active_adapter(model, adapter):
        logits = model(input_ids=ids).logits[0, len(completion.prompt_ids) - 1 : -1]
    return torch.log_softmax(logits.float(), -1).gather(-1, ids[0, len(completion.prompt_ids):, None]).squeeze(-1)


def test_a_roles_turn_is_sampled_with_its_adapter(tokenizer):
    """Each request is decoded with its role's adapter (its log-probs are that adapter's); perturbing one adapter
    changes only the samples of that role, the other role's tokens and log-probs stay bit-identical."""
    model, engine = role_engine(tokenizer)
    prompt = tuple(tokenizer("Once upon a time", add_special_tokens=False)["input_ids"])
    requests = [GenerationRequest(prompt, 2, seed=7, adapter=role) for role in ROLES]
    params = SamplingParams(max_new_tokens=6)

    def sample():
        return [[(c.response_ids, c.logprobs) for c in group] for group in engine.generate(requests, params)]

    first = sample()
    for group, role in zip(engine.generate(requests, params), ROLES):
        for c in group:
            assert torch.allclose(recomputed(model, role, c), torch.tensor(c.logprobs), atol=1e-5)
    assert model.active_adapter == ROLES[0] and all(p.requires_grad for n, p in model.named_parameters() if "lora_" in n)
    for k, role in enumerate(ROLES):
        with torch.no_grad():
            for name, p in role_params(model, role).items():
                if "lora_B" in name:
                    p.add_(0.5)
        now = sample()
        assert now[1 - k] == first[1 - k]  # the other role: the same tokens and log-probs, bit for bit
        assert all(a[1] != b[1] for a, b in zip(now[k], first[k]))  # this role's log-probs moved
        first = now


def test_the_kv_cache_is_kept_per_adapter(tokenizer):
    """A sequence sampled (and its KV kept) under the proposer's adapter, continued under the verifier's: the cached
    engine gives what an engine without a cache gives (the verifier's KV, not the proposer's)."""
    def episode(engine):
        gen = torch.Generator().manual_seed(0)
        (first,) = engine.generate([GenerationRequest(prompt, 1, adapter="proposer")], params, gen)
        (second,) = engine.generate([GenerationRequest(prompt, 1, prefix_ids=tuple(first[0].response_ids),
                                                       score_prefix=False, adapter="verifier")], params, gen)
        return first[0], second[0]

    prompt = tuple(tokenizer("Once upon a time", add_special_tokens=False)["input_ids"])
    params = SamplingParams(max_new_tokens=5)
    model, cached = role_engine(tokenizer, cache_mb=16)
    plain = HFGenerateEngine(model, tokenizer, batch_size=8, progress=False)
    for a, b in zip(episode(cached), episode(plain)):
        assert a.response_ids == b.response_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs) if not math.isnan(x)) < 1e-4
    assert cached._adapter_caches["proposer"].stats.stored > 0 and cached._adapter_caches["verifier"].stats.hits == 0
    with pytest.raises(ValueError, match="role adapters"):
        cached.generate([GenerationRequest(prompt, 1)], params)  # a per-role policy's request must name a role
    with pytest.raises(ValueError, match="not built"):
        cached.score_prefixes([(prompt, (5, 6))], params)


class RoleRecordingEngine(ScriptedEngine):
    """The scripted engine of a per-role policy: records each call's adapters."""

    def __init__(self, script):
        super().__init__(script)
        self.model, self.adapters = type("PerRole", (), {"role_adapters": ROLES})(), []

    def generate(self, requests, params, generator=None):
        self.adapters.append([r.adapter for r in requests])
        return super().generate(requests, params, generator)


def test_episode_turns_go_to_their_roles_adapters():
    """Turn t of an env=proposer_verifier episode is sampled with adapter ROLES[t mod 2], the environment's role."""
    script = [["\\boxed{41}"], ["REJECT"], ["\\boxed{42}"], ["ACCEPT"]]
    engine = RoleRecordingEngine(script)
    sampler = GroupSampler(engine, MathReward(), Tokens(), {"user": "{problem}"}, lambda r, _: r)
    groups, _ = MultiTurnRollout(RolloutSetup(sampler, 1, SamplingParams(1.0, 1.0, 64), None, env=factory(2))).rollout([PROBLEM])
    assert engine.adapters == [["proposer"], ["verifier"], ["proposer"], ["verifier"]]
    assert groups.outcome.tolist() == [3.0]  # 0 (wrong proposal) + 1 (rejected) + 1 (right proposal) + 1 (accepted)
    assert role_adapters(engine.model) == ROLES and role_adapters(tiny_lm(0)) == ()


BASE = ["algorithm=at_grpo", "env=proposer_verifier", "model/lora=per_role", "experiment=smoke"]


@pytest.mark.parametrize("overrides,match", [
    (["algorithm=at_grpo", "model/lora=per_role", "experiment=smoke"], "env=gridworld has one role"),
    (["model/lora=per_role", "experiment=smoke"], "no env= is set"),
    ([*BASE, "rollout.engine=vllm"], "cannot switch adapters"),
    ([*BASE, "model.lora.merge_on_save=true"], "do not merge"),
    ([*BASE, "trainer.parallelism=ddp"], "one forward per role"),
    ([*BASE, "rollout.multi_turn.branch=entropy_tool"], "scored without a role"),
    ([*BASE, "+reward/judge=default", "reward.judge.kind=policy"], "judges without a role"),
    ([*BASE, "algorithm.critic={model:separate}"], "critic.model=separate .*copies the policy"),
])
def test_refused_before_the_model_loads(tmp_path, overrides, match):
    with pytest.raises(ConfigError, match=match):
        validate_config(compose_config(overrides, tmp_path))


def test_the_per_role_run_validates(tmp_path):
    validate_config(compose_config(BASE, tmp_path))
