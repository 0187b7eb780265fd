"""RTO's token reward (arXiv:2404.18922 sec. 4): closed-form sums, the beta_dpo = 0 reduction to
PPO's sparse reward, and the DPO checkpoint refusals."""

from __future__ import annotations

import json

import pytest
import torch

from rlbench import runner
from rlbench.algorithm.advantages.value_based import gae_advantage, gae_returns
from rlbench.algorithm.critic import value_targets
from rlbench.algorithm.rto import check_dpo_checkpoint, dpo_token_rewards, rto_rewards
from rlbench.errors import ConfigError


def _batch(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 0, 1, 1, 1], [0, 0, 0, 0, 0]], dtype=torch.float32)
    dpo_logp = -torch.rand(3, 5, generator=generator, dtype=torch.float64) * 3
    ref_logp = -torch.rand(3, 5, generator=generator, dtype=torch.float64) * 3
    values = torch.randn(3, 5, generator=generator, dtype=torch.float64)
    rewards = torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64)
    return rewards, mask, dpo_logp, ref_logp, values


def test_dense_terms_sum_to_the_sequence_dpo_reward():
    rewards, mask, dpo_logp, ref_logp, _ = _batch()
    beta = 0.3
    dense = dpo_token_rewards(dpo_logp, ref_logp, mask, beta)
    sequence = beta * ((dpo_logp * mask).sum(-1) - (ref_logp * mask).sum(-1))
    torch.testing.assert_close(dense.sum(-1), sequence)
    assert (dense[mask == 0] == 0).all()
    total, token_rewards = rto_rewards(rewards, mask, dpo_logp, ref_logp, beta)
    # the sparse reward sits on the last valid token; the empty response keeps no reward
    torch.testing.assert_close(total, sequence + torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64))
    assert token_rewards[0, 3] == pytest.approx(dense[0, 3].item() + 1.0)


def test_kl_penalty_enters_per_token():
    rewards, mask, dpo_logp, ref_logp, _ = _batch(1)
    kl = torch.rand(3, 5, dtype=torch.float64)
    plain = rto_rewards(rewards, mask, dpo_logp, ref_logp, 0.5)[1]
    penalised = rto_rewards(rewards, mask, dpo_logp, ref_logp, 0.5, kl_matrix=kl, kl_coef=0.1)[1]
    torch.testing.assert_close(plain - penalised, 0.1 * kl * mask.to(torch.float64))


def test_zero_beta_is_ppo_with_a_sparse_reward():
    rewards, mask, dpo_logp, ref_logp, values = _batch(2)
    _, token_rewards = rto_rewards(rewards, mask, dpo_logp, ref_logp, 0.0)
    ppo = gae_advantage(rewards, values, mask)
    rto = gae_advantage(rewards, values, mask, token_rewards=token_rewards)
    assert torch.equal(ppo, rto)
    assert torch.equal(gae_returns(rewards, values, mask), gae_returns(rewards, values, mask, token_rewards))


def test_dense_reward_changes_the_advantages():
    rewards, mask, dpo_logp, ref_logp, values = _batch(3)
    _, token_rewards = rto_rewards(rewards, mask, dpo_logp, ref_logp, 1.0)
    ppo = gae_advantage(rewards, values, mask, whiten=False, lam=1.0)
    rto = gae_advantage(rewards, values, mask, token_rewards=token_rewards, whiten=False, lam=1.0)
    # gamma = lam = 1: A_t = sum_{s>=t} r_s - V_t, so the difference is the dense return-to-go
    dense = dpo_token_rewards(dpo_logp, ref_logp, mask, 1.0)
    to_go = dense.flip(-1).cumsum(-1).flip(-1) * mask
    torch.testing.assert_close(rto - ppo, to_go.to(rto.dtype), atol=1e-5, rtol=1e-5)


def test_value_targets_read_the_token_rewards():
    """The critic regresses on the lambda-returns of the same token rewards as the advantages:
    with gamma = lam = 1, R_t = sum_{s>=t} r_s (the dense return-to-go plus the sparse reward)."""
    rewards, mask, dpo_logp, ref_logp, values = _batch(4)
    _, token_rewards = rto_rewards(rewards, mask, dpo_logp, ref_logp, 1.0)
    targets = value_targets({"gamma": 1.0, "lam": 1.0}, rewards, values, mask, token_rewards)
    to_go = token_rewards.flip(-1).cumsum(-1).flip(-1) * mask
    torch.testing.assert_close(targets.to(torch.float64), to_go, atol=1e-5, rtol=1e-5)
    sparse = value_targets({"gamma": 1.0, "lam": 1.0}, rewards, values, mask)
    assert not torch.allclose(sparse.to(torch.float64), to_go, atol=1e-3)


def _model_dir(path, **config):
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def test_refusals(tmp_path):
    policy = _model_dir(tmp_path / "policy", model_type="gpt2", architectures=["GPT2LMHeadModel"], vocab_size=64)
    with pytest.raises(ConfigError, match="needs algorithm.rto.dpo_checkpoint"):
        check_dpo_checkpoint(None, policy)
    with pytest.raises(ConfigError, match="is not a folder"):
        check_dpo_checkpoint(str(tmp_path / "absent"), policy)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no config.json"):
        check_dpo_checkpoint(str(tmp_path / "empty"), policy)
    other = _model_dir(tmp_path / "other", model_type="gpt2", architectures=["GPT2LMHeadModel"], vocab_size=65)
    with pytest.raises(ConfigError, match="vocab_size"):
        check_dpo_checkpoint(other, policy)
    same = _model_dir(tmp_path / "same", model_type="gpt2", architectures=["GPT2LMHeadModel"], vocab_size=64)
    check_dpo_checkpoint(same, policy)
    (tmp_path / "same" / "tokenizer.json").write_text("{}")
    (tmp_path / "policy" / "tokenizer.json").write_text('{"x": 1}')
    with pytest.raises(ConfigError, match="another tokenizer"):
        check_dpo_checkpoint(same, policy)


def test_ppo_with_token_rewards_runs_through_the_runner(make_cfg, tmp_path):
    """The trainer hands the per-token rewards (here the KL placed in the reward) to the critic's targets."""

    cfg = make_cfg(
        "experiment=smoke", "logger=files", "trainer.save_model=false", "eval.before_training=false",
        "eval.limit=1", "eval.n=1", "eval.k=[1]", "reward=even_tokens", "algorithm=ppo",
        "algorithm.kl.coef=0.1", "algorithm.kl.placement=reward",
    )
    runner.run(cfg)
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 2 and all(torch.isfinite(torch.tensor(step["value_loss"])) for step in steps)
