"""RTO's token reward (arXiv:2404.18922 sec. 4): closed-form sums, the beta_dpo = 0 reduction to
PPO's sparse reward, and the DPO checkpoint refusals."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, compose_config

from rlbench import runner
from rlbench.algorithm import composition
from rlbench.algorithm.advantages.value_based import gae_advantage, gae_returns
from rlbench.algorithm.critic import value_targets
from rlbench.algorithm.rto import (
    RTOSettings,
    check_dpo_checkpoint,
    check_rto_run,
    dpo_token_rewards,
    rto_rewards,
)
from rlbench.config.typed import typed_config
from rlbench.errors import ConfigError
from rlbench.model import load_policy
from rlbench.validation import validate_config


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


def test_the_dense_reward_is_clamped_per_token():
    """dpo_clip c clamps each token's beta (log pi_dpo - log pi_ref) to [-c, c] (the release's --dpo_reward_clip)."""
    mask = torch.tensor([[1, 1, 1, 0]], dtype=torch.float32)
    dpo_logp = torch.tensor([[-1.0, -3.0, -2.0, -9.0]], dtype=torch.float64)
    ref_logp = torch.tensor([[-2.0, -2.0, -2.01, -1.0]], dtype=torch.float64)
    # beta 0.1: 0.1, -0.1, 0.001, (padding) -> clamped at 0.05: 0.05, -0.05, 0.001, 0
    clamped = dpo_token_rewards(dpo_logp, ref_logp, mask, 0.1, clip=0.05)
    torch.testing.assert_close(clamped, torch.tensor([[0.05, -0.05, 0.001, 0.0]], dtype=torch.float64))
    torch.testing.assert_close(dpo_token_rewards(dpo_logp, ref_logp, mask, 0.1),
                               torch.tensor([[0.1, -0.1, 0.001, 0.0]], dtype=torch.float64))
    total, _ = rto_rewards(torch.tensor([1.0], dtype=torch.float64), mask, dpo_logp, ref_logp, 0.1, dpo_clip=0.05)
    torch.testing.assert_close(total, torch.tensor([1.001], dtype=torch.float64))


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
    with pytest.raises(ConfigError, match="needs algorithm.rto.dpo_model"):
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


# ---------------------------------------------------------------------------------- algorithm=rto in the trainer

SMOKE = ("experiment=smoke", "logger=files", "eval.before_training=false", "eval.limit=1", "eval.n=1", "eval.k=[1]",
         "trainer.steps=1")


def _save_policy_copy(make_cfg, folder, noise: float = 0.0, **tiny):
    """The smoke run's initial tiny policy (seeded), saved as a Hugging Face folder; ``noise`` perturbs its weights
    (a pi_dpo that differs from pi_ref), ``tiny`` changes its shape (a checkpoint of another architecture)."""
    overrides = [f"model.tiny.{key}={value}" for key, value in tiny.items()]
    config = typed_config(make_cfg(*SMOKE, *overrides))
    model, tokenizer = load_policy(config.model, seed=config.seed)
    if noise:
        generator = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for param in model.parameters():
                param.add_(noise * torch.randn(param.shape, generator=generator, dtype=param.dtype))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def _run(make_cfg, tmp_path, name, *overrides):
    runner.run(compose_config([*SMOKE, *overrides], tmp_path / name))
    metrics = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return metrics, _weights(tmp_path / name / "policy")


def _weights(folder):
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


@pytest.fixture
def spy(monkeypatch):
    """The RTO reward terms the trainer's step computed: rto_rewards' inputs and outputs, call by call."""
    calls = []

    def recording(*args, **kwargs):
        result = rto_rewards(*args, **kwargs)
        calls.append((args, kwargs, result))
        return result

    monkeypatch.setattr(composition, "rto_rewards", recording)
    return calls


@pytest.mark.slow
def test_zero_dense_terms_equal_ppo_with_the_sparse_reward(make_cfg, tmp_path, spy):
    """beta_dpo = 0, beta_KL = 0, beta_2 = 1: the same losses and the same trained weights as algorithm=ppo with
    RTO's separate critic model."""
    dpo = _save_policy_copy(make_cfg, tmp_path / "dpo", noise=0.05)
    ppo_metrics, ppo_weights = _run(make_cfg, tmp_path, "ppo", "algorithm=ppo", "algorithm.critic.model=separate")
    rto_metrics, rto_weights = _run(make_cfg, tmp_path, "rto", "algorithm=rto", f"algorithm.rto.dpo_model={dpo}",
                                    "algorithm.rto.beta_dpo=0", "algorithm.rto.sparse_coef=1", "algorithm.kl.coef=0")
    assert len(spy) == 1  # the step went through RTO's reward
    for key in ("policy_loss", "value_loss", "grad_norm", "advantage_mean", "reward_mean"):
        assert rto_metrics[0][key] == ppo_metrics[0][key], key
    assert rto_metrics[0]["rto_dpo_log_ratio"] != 0  # pi_dpo differs from pi_ref; its weight is 0
    assert ppo_weights.keys() == rto_weights.keys()
    for name, value in ppo_weights.items():
        assert torch.equal(value, rto_weights[name]), name


@pytest.mark.slow
def test_step_token_rewards_sum_to_the_sequence_dpo_reward(make_cfg, tmp_path, spy):
    """The token rewards the step used sum to beta_1 log pi_dpo(y|x) / pi_ref(y|x) + beta_2 R, and log pi_dpo is the
    checkpoint's (it differs from pi_ref)."""
    dpo = _save_policy_copy(make_cfg, tmp_path / "dpo", noise=0.05)
    metrics, _ = _run(make_cfg, tmp_path, "rto", "algorithm=rto", f"algorithm.rto.dpo_model={dpo}",
                      "algorithm.rto.beta_dpo=0.5", "algorithm.rto.sparse_coef=2", "algorithm.kl.coef=0",
                      "algorithm.rto.dpo_clip=0")  # unclamped: the sum is the sequence's DPO reward
    (args, _, (total, token_rewards)), = spy
    rewards, mask, dpo_logp, ref_logp, beta, sparse = args[:6]
    assert beta == 0.5 and sparse == 2
    maskf = mask.to(torch.float64)
    log_ratio = ((dpo_logp.double() - ref_logp.double()) * maskf).sum(-1)
    assert log_ratio.abs().min() > 0
    torch.testing.assert_close(token_rewards.sum(-1), 0.5 * log_ratio + 2 * rewards.double())
    torch.testing.assert_close(total, token_rewards.sum(-1))
    assert metrics[0]["rto_dpo_log_ratio"] == pytest.approx(log_ratio.mean().item(), rel=1e-5)


@pytest.mark.slow
def test_dpo_model_equal_to_the_reference_gives_no_dense_reward(make_cfg, tmp_path, spy):
    dpo = _save_policy_copy(make_cfg, tmp_path / "dpo")
    metrics, _ = _run(make_cfg, tmp_path, "rto", "algorithm=rto", f"algorithm.rto.dpo_model={dpo}", "algorithm.kl.coef=0")
    (args, _, (_, token_rewards)), = spy
    mask, dpo_logp, ref_logp = args[1:4]
    assert torch.equal(dpo_logp, ref_logp)
    assert torch.equal(dpo_token_rewards(dpo_logp, ref_logp, mask, 0.1), torch.zeros_like(token_rewards))
    assert metrics[0]["rto_dpo_log_ratio"] == 0


def test_rto_bad_input_is_refused_before_loading(make_cfg, tmp_path):
    with pytest.raises(ConfigError, match="needs algorithm.rto.dpo_model"):
        validate_config(make_cfg(*SMOKE, "algorithm=rto"))
    with pytest.raises(ConfigError, match="is not a folder"):
        validate_config(make_cfg(*SMOKE, "algorithm=rto", f"algorithm.rto.dpo_model={tmp_path / 'absent'}"))
    folder = _model_dir(tmp_path / "dpo", model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=64)
    with pytest.raises(ConfigError, match="kl.placement=reward"):
        validate_config(make_cfg(*SMOKE, "algorithm=rto", f"algorithm.rto.dpo_model={folder}", "algorithm.kl.placement=loss"))
    with pytest.raises(ConfigError, match="per-token rewards"):
        validate_config(make_cfg(*SMOKE, "algorithm=grpo", f"++algorithm.rto.dpo_model={folder}"))
    with pytest.raises(ConfigError, match="beta_dpo"):
        validate_config(make_cfg(*SMOKE, "algorithm=rto", f"algorithm.rto.dpo_model={folder}", "algorithm.rto.beta_dpo=-1"))
    with pytest.raises(ConfigError, match="parallelism=ddp"):
        check_rto_run(RTOSettings(folder, 0.1, 1.0, 0.0), "", lora=False, parallelism="ddp")
    with pytest.raises(ConfigError, match="LoRA"):
        validate_config(make_cfg(*SMOKE, "algorithm=rto", f"algorithm.rto.dpo_model={folder}", "model/lora=default"))


@pytest.mark.slow
def test_dpo_checkpoint_of_another_architecture_is_refused(make_cfg, tmp_path):
    other = _save_policy_copy(make_cfg, tmp_path / "other", hidden_size=48)
    with pytest.raises(ConfigError, match="not a checkpoint of the policy's architecture"):
        runner.run(make_cfg(*SMOKE, "algorithm=rto", f"algorithm.rto.dpo_model={other}"))


@pytest.mark.slow
def test_dpo_run_then_rto_run_from_the_command_line(tmp_path):
    """The two stages as docs/preference.md gives them: a DPO run that saves its policy, then RTO on it."""
    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    env.pop("WANDB_API_KEY", None)
    common = ["experiment=smoke", "trainer.steps=1", "eval.before_training=false", "eval.limit=1", "eval.n=1", "eval.k=[1]",
              "logger=files"]

    def cli(*overrides):
        proc = subprocess.run([sys.executable, "-m", "rlbench.cli", *common, *overrides], cwd=ROOT, capture_output=True,
                              text=True, timeout=1800, env=env, check=False)
        assert proc.returncode == 0, proc.stderr[-3000:]

    cli("algorithm=dpo", "trainer.save_model=true", f"hydra.run.dir={tmp_path / 'dpo'}")
    cli("algorithm=rto", f"algorithm.rto.dpo_model={tmp_path / 'dpo' / 'policy'}", f"hydra.run.dir={tmp_path / 'rto'}")
    steps = [json.loads(line) for line in (tmp_path / "rto" / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 1 and steps[0]["rto_dpo_log_ratio"] != 0  # one DPO step moved pi_dpo away from pi_ref


# The toy of the learning tier (conf/experiment/toy_learning.yaml) with algorithm=rto at ppo's toy budget, the dense
# DPO reward alone (sparse_coef 0, no KL): toy_learning/ppo's micro-batch and lr per optimizer step.
TOY_RTO = ("experiment=toy_learning", "algorithm=rto", "trainer.micro_batch_size=16", "trainer.lr=0.00125",
           "algorithm.rto.sparse_coef=0", "algorithm.kl.coef=0", "algorithm.rto.beta_dpo=0.5", "seed=0")


def _window_rise(values: list[float], window: int = 4) -> float:
    return sum(values[-window:]) / window - sum(values[:window]) / window


@pytest.mark.slow
def test_dense_dpo_reward_alone_trains_the_policy_towards_pi_dpo(tmp_path):
    """Stage 1: toy_learning/dpo (16 steps, seed 0) saves pi_dpo; stage 2: RTO from the same initial policy with
    the dense reward only. PPO raises what it is rewarded for, the sequence log-ratio log pi_dpo(y|x) / pi_ref(y|x)
    of its samples (metric rto_dpo_log_ratio); the negative control (lr 1e-12) does not. Measured 2026-12-05 (1
    thread, beta_dpo 0.5, a DPO stage per seed): rise of the 4-step window means +49, +115, +123 on seeds 0-2,
    the control -6, +1, +2. The toy reward (share of even ids, which pi_dpo learnt to prefer) rose too, median peak rise +0.172 at
    beta_dpo 0.5 (+0.062 at 0.1) against +0.040 with pi_dpo = pi_ref on seeds 0-2: sensitive to beta_dpo, so it is not asserted (docs/preference.md, "RTO")."""
    torch.set_num_threads(1)
    runner.run(compose_config(["experiment=toy_learning/dpo", "trainer.save_model=true", "seed=0"], tmp_path / "dpo"))
    dpo = f"algorithm.rto.dpo_model={tmp_path / 'dpo' / 'policy'}"

    def log_ratios(name, *overrides):
        runner.run(compose_config([*TOY_RTO, dpo, *overrides], tmp_path / name))
        return [json.loads(line)["rto_dpo_log_ratio"] for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]

    trained, control = log_ratios("rto"), log_ratios("control", "trainer.lr=1e-12")
    assert _window_rise(trained) > 20, trained
    assert abs(_window_rise(control)) < 20, control
