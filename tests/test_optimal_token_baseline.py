"""verl's optimal token baseline as a selectable advantage (algorithm/advantage=optimal_token_baseline and
tir_optimal_token_baseline; rlbench/algorithm/advantages/verl_pieces.py): the registered estimators on
hand-computed batches, the step input ``sum_pi_squared`` of the sampling pass against softmax(logits)^2
summed directly, and a run that composes, validates and trains through the real runner."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import rlbench.runner as runner
import rlbench.training.step  # noqa: F401  (registers every piece)
from conftest import algorithm_from
from rlbench.algorithm.registry import ADVANTAGES
from rlbench.algorithm.step_inputs import STEP_INPUTS
from rlbench.errors import ConfigError
from rlbench.rollout.engines.base import Completion
from rlbench.training.batch import collate
from rlbench.training.forward import batch_outputs, token_outputs
from rlbench.training.token_log_probs import token_distribution_stats, token_log_probs
from rlbench.validation import validate_config

NAMES = ("optimal_token_baseline", "tir_optimal_token_baseline")


def otb_algorithm(name: str, **params):
    return algorithm_from({"advantage": {"name": name, **params}, "loss": {"name": "ppo_clip"},
                           "aggregation": {"name": "token_mean"}})


def _p(rows):
    return torch.tensor(rows, dtype=torch.float64)


# ------------------------------------------------------------------ closed form on hand-computed batches
# Six responses in three groups, outcome rewards only (G_i,t = r_i on every trained token). Per token
# ||s||^2 = 1 - 2 pi(o_t) + S_t with S_t = sum_v pi(v)^2, and W_t its running sum along the response:
#   group 0  row 0  r=1  len 2  pi [1/2, 1/2]  S [1/2, 1/2]    ||s||^2 [1/2, 1/2]   W [1/2, 1]
#            row 1  r=0  len 2  pi [1/4, 3/4]  S [1/2, 5/8]    ||s||^2 [1, 1/8]     W [1, 9/8]
#            row 2  r=2  len 1  pi [1/2]       S [1/4]         ||s||^2 [1/4]        W [1/4]
#     t=0: B = (1*1/2 + 0*1 + 2*1/4) / (1/2 + 1 + 1/4) = 1 / (7/4) = 4/7
#     t=1: B = (1*1 + 0*9/8) / (1 + 9/8) = 8/17      (two responses reach t=1: no unique tail)
#   group 1  row 3  r=1  len 2  pi [1/2, 1/4]  S [1/2, 1/2]    ||s||^2 [1/2, 1]     W [1/2, 3/2]
#            row 4  r=3  len 1  pi [1/4]       S [1/2]         ||s||^2 [1]          W [1]
#     t=0: B = (1*1/2 + 3*1) / (1/2 + 1) = 7/3
#     t=1: row 3 alone, the group's unique longest response: B = 0 (handle_zero_tail), A = G = 1
#   group 2  row 5  r=5  len 1: one response, no baseline: A = 0
REWARDS = torch.tensor([1.0, 0.0, 2.0, 1.0, 3.0, 5.0])
GROUPS = torch.tensor([0, 0, 0, 1, 1, 2])
MASK = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 0.0], [1.0, 0.0]])
PI = _p([[0.5, 0.5], [0.25, 0.75], [0.5, 0.9], [0.5, 0.25], [0.25, 0.9], [0.5, 0.9]])  # 0.9: padding, unread
SUM_PI_SQ = _p([[0.5, 0.5], [0.5, 0.625], [0.25, 0.9], [0.5, 0.5], [0.5, 0.9], [0.5, 0.9]])
EXPECTED = torch.tensor([
    [1 - 4 / 7, 1 - 8 / 17],
    [0 - 4 / 7, 0 - 8 / 17],
    [2 - 4 / 7, 0.0],
    [1 - 7 / 3, 1.0],
    [3 - 7 / 3, 0.0],
    [0.0, 0.0],
])


@pytest.mark.parametrize("name", NAMES)
def test_registered_advantage_matches_the_hand_computed_weighted_baseline(name):
    algorithm = otb_algorithm(name, epsilon=0.0)
    adv = algorithm.compute_advantages(REWARDS, GROUPS, MASK, old_logp=PI.log().float(), sum_pi_squared=SUM_PI_SQ.float())
    torch.testing.assert_close(adv, EXPECTED, atol=1e-6, rtol=1e-6)
    # without verl's zero-tail handling the lone tail token's baseline is itself: A = 0 there
    kept = otb_algorithm(name, epsilon=0.0, handle_zero_tail=False).compute_advantages(
        REWARDS, GROUPS, MASK, old_logp=PI.log(), sum_pi_squared=SUM_PI_SQ)
    expected_kept = EXPECTED.clone()
    expected_kept[3, 1] = 0.0
    torch.testing.assert_close(kept, expected_kept, atol=1e-6, rtol=1e-6)


def test_token_rewards_enter_as_the_reward_to_go():
    # one group of two, token rewards [[1, 2], [0, 0]]: G row 0 = [3, 2], row 1 = [0, 0]
    # pi 1/2 and S 1/2 everywhere: ||s||^2 = 1/2, W = [1/2, 1] in both rows: B = [3/2, 1]
    pi = torch.full((2, 2), 0.5)
    adv = otb_algorithm("optimal_token_baseline", epsilon=0.0).compute_advantages(
        torch.tensor([9.0, 9.0]), torch.tensor([0, 0]), torch.ones(2, 2), old_logp=pi.log(), sum_pi_squared=pi,
        token_rewards=torch.tensor([[1.0, 2.0], [0.0, 0.0]]))
    torch.testing.assert_close(adv, torch.tensor([[1.5, 1.0], [-1.5, -1.0]]))


def test_tool_integrated_variant_aligns_generated_tokens_across_observations():
    # row 0 trains columns 0 and 2 (column 1 is a tool observation), row 1 columns 0 and 1; rewards [1, 0]
    # trained positions: row 0 pi [1/2, 1/2], row 1 pi [1/4, 1/2], S = 1/2 everywhere
    #   ||s||^2: row 0 [1/2, 1/2] -> W [1/2, 1];  row 1 [1, 1/2] -> W [1, 3/2]
    #   position 0: B = 1/2 / (3/2) = 1/3;  position 1: B = 1 / (5/2) = 2/5
    mask = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 0.0]])
    pi = torch.tensor([[0.5, 0.1, 0.5], [0.25, 0.5, 0.1]])  # 0.1: observation / padding, unread
    inputs = dict(old_logp=pi.log(), sum_pi_squared=torch.full((2, 3), 0.5))
    rewards, groups = torch.tensor([1.0, 0.0]), torch.tensor([0, 0])
    tir = otb_algorithm("tir_optimal_token_baseline", epsilon=0.0).compute_advantages(rewards, groups, mask, **inputs)
    torch.testing.assert_close(tir, torch.tensor([[2 / 3, 0.0, 0.6], [-1 / 3, -0.4, 0.0]]))
    # by raw column instead, columns 1 and 2 each hold one response, whose baseline is itself (A = 0)
    column = otb_algorithm("optimal_token_baseline", epsilon=0.0).compute_advantages(rewards, groups, mask, **inputs)
    torch.testing.assert_close(column, torch.tensor([[2 / 3, 0.0, 0.0], [-1 / 3, 0.0, 0.0]]))


@pytest.mark.parametrize("name", NAMES)
def test_declared_at_registration_and_wired_to_the_sampling_pass(name):
    assert ADVANTAGES.needs(name).token_level_advantage
    assert {"old_logp", "sum_pi_squared"} <= ADVANTAGES.required_inputs(name, {})
    entry = STEP_INPUTS["sum_pi_squared"]
    assert entry.producer == "forward" and entry.readers == {"advantage"}
    algorithm = otb_algorithm(name)
    assert algorithm.needs_sampling_pass and algorithm.needs_sampling_sum_pi_squared
    grpo = otb_algorithm("grpo")
    assert not grpo.needs_sampling_sum_pi_squared  # nobody else pays for it
    with pytest.raises(ConfigError, match="epsilon must be >= 0"):
        otb_algorithm(name, epsilon=-1.0)


# ------------------------------------------------------------------ the step input sum_pi_squared
def tiny_lm(seed=0):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    return LlamaForCausalLM(config).float().eval()


def tiny_batch(seed=1, groups=2, n=3):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(groups):
        prompt = tuple(torch.randint(3, 32, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist())
        group = []
        for _ in range(n):
            length = int(torch.randint(1, 7, (1,), generator=g))
            group.append(Completion(i, prompt, torch.randint(3, 32, (length,), generator=g).tolist(), [0.0] * length, True))
        out.append(group)
    return collate(out, pad_token_id=0)


def direct_sum_pi_squared(model, batch, row: int, temperature: float) -> torch.Tensor:
    """sum_v softmax(logits / temperature)^2 at each response token of ``row``, from a forward of the row alone."""
    ids = batch.input_ids[row][batch.attention_mask[row].bool()]
    r = int(batch.response_mask[row].sum())
    with torch.no_grad():
        logits = model(ids[None]).logits[0].double() / temperature
    return torch.softmax(logits[-r - 1 : -1], -1).square().sum(-1)


def test_token_distribution_stats_sum_of_squared_probabilities():
    logits = torch.randn(3, 4, 50, dtype=torch.float64) * 3
    targets = torch.randint(0, 50, (3, 4))
    logp, entropy, sum_sq = token_distribution_stats(logits, targets, 0.7, with_entropy=True, with_sum_pi_squared=True)
    pi = torch.softmax(logits / 0.7, -1)
    torch.testing.assert_close(sum_sq, pi.square().sum(-1))
    plain_logp, plain_entropy = token_log_probs(logits, targets, 0.7, with_entropy=True)
    torch.testing.assert_close(logp, plain_logp)
    torch.testing.assert_close(entropy, plain_entropy)
    assert token_distribution_stats(logits, targets)[2] is None
    # logp keeps its gradient; the sum of squares has none
    leaf = logits.clone().requires_grad_()
    logp, _, sum_sq = token_distribution_stats(leaf, targets, with_sum_pi_squared=True)
    assert not sum_sq.requires_grad
    (grad,) = torch.autograd.grad(logp.sum(), leaf)
    torch.testing.assert_close(grad, torch.nn.functional.one_hot(targets, 50).double() - torch.softmax(logits, -1))


@pytest.mark.parametrize("share_prompts", [False, True])
@pytest.mark.parametrize("with_log_probs", [False, True])  # the sliced path and the whole log-softmax
def test_forward_sum_pi_squared_equals_softmax_squared_summed(share_prompts, with_log_probs):
    model, batch, temperature = tiny_lm(), tiny_batch(), 0.7
    out = token_outputs(model, batch, temperature, share_prompts=share_prompts, with_log_probs=with_log_probs,
                        with_sum_pi_squared=True)
    for row in range(batch.size):
        r = int(batch.response_mask[row].sum())
        torch.testing.assert_close(out.sum_pi_squared[row, :r].double(), direct_sum_pi_squared(model, batch, row, temperature),
                                   atol=1e-5, rtol=1e-5)
    assert token_outputs(model, batch, temperature).sum_pi_squared is None  # only on request


def test_sampling_pass_gives_sum_pi_squared_over_micro_batches():
    model, batch = tiny_lm(seed=3), tiny_batch(seed=4)
    before = batch_outputs(model, batch, micro_batch_size=2, temperature=1.0, with_sum_pi_squared=True)
    assert before.sum_pi_squared.shape == batch.response_mask.shape
    for row in range(batch.size):
        r = int(batch.response_mask[row].sum())
        torch.testing.assert_close(before.sum_pi_squared[row, :r].double(), direct_sum_pi_squared(model, batch, row, 1.0),
                                   atol=1e-5, rtol=1e-5)
        assert (before.sum_pi_squared[row, r:] == 0).all()
    assert batch_outputs(model, batch, 2, 1.0).sum_pi_squared is None


# ------------------------------------------------------------------ the command line and the runner
@pytest.mark.parametrize("name", NAMES)
def test_a_run_composes_and_validates_from_the_command_line(make_cfg, name):
    cfg = make_cfg("experiment=smoke", f"algorithm/advantage={name}")
    assert cfg.algorithm.advantage.name == name
    algorithm = validate_config(cfg)
    assert algorithm.advantage.name == name and algorithm.needs_sampling_sum_pi_squared
    with pytest.raises(ConfigError, match="epsilon must be >= 0"):
        validate_config(make_cfg("experiment=smoke", f"algorithm/advantage={name}", "algorithm.advantage.epsilon=-0.1"))


@pytest.fixture
def recorded_otb(monkeypatch):
    """The inputs the registered optimal_token_baseline receives, recorded call by call."""
    calls = []
    original = ADVANTAGES.get("optimal_token_baseline")

    @functools.wraps(original)
    def recording(**kwargs):
        advantage = original(**kwargs)
        calls.append({**kwargs, "advantage": advantage})
        return advantage

    monkeypatch.setitem(ADVANTAGES._functions, "optimal_token_baseline", recording)
    return calls


@pytest.mark.slow
def test_a_smoke_run_trains_with_the_optimal_token_baseline(make_cfg, tmp_path, recorded_otb):
    cfg = make_cfg("experiment=smoke", "algorithm/advantage=optimal_token_baseline", "logger=files",
                   "trainer.save_model=false", "eval.before_training=false", "eval.n=1", "eval.k=[1]",
                   "eval.limit=1", "trainer.steps=1")
    runner.run(cfg)
    (step,) = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert "advantage_std" in step
    (call,) = recorded_otb
    mask = call["response_mask"] > 0
    sum_sq, pi = call["sum_pi_squared"], call["old_logp"].exp()
    assert sum_sq.shape == mask.shape and torch.isfinite(call["advantage"]).all()
    # a probability vector's sum of squares lies in (0, 1] and is at least the sampled token's pi^2
    assert bool(((sum_sq > 0) & (sum_sq <= 1 + 1e-5))[mask].all())
    assert bool((sum_sq >= pi.square() - 1e-5)[mask].all())
    assert bool((call["advantage"][~mask] == 0).all())


@pytest.mark.slow
def test_the_tool_integrated_variant_trains_on_multi_turn_episodes(make_cfg, tmp_path):
    cfg = make_cfg("experiment=smoke", "rollout=multi_turn", "env=gridworld",
                   "algorithm/advantage=tir_optimal_token_baseline", "logger=files", "trainer.save_model=false",
                   "eval.before_training=false", "eval.n=1", "eval.k=[1]", "eval.limit=1", "trainer.steps=1")
    runner.run(cfg)
    (step,) = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert "advantage_std" in step
