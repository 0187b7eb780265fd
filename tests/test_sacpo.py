"""SACPO (algorithm=sacpo; Wachi et al. 2024, arXiv:2404.11049) and P-SACPO's weight interpolation: the stage
losses in closed form, the paper's identity on a tabular two-objective toy (stage 1 then stage 2 reach the
Lagrangian optimum pi_ref exp((r + lambda g) / beta)), the stage switch through the runner (stage 2's reference is
the policy at the switch, exact weights, saved and restored on resume), and the interpolation's endpoints."""

import json
import math
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import compose_config

from rlbench.algorithm.losses.preference import dpo_loss
from rlbench.algorithm.losses.stepwise import (
    brevity_preferences,
    sacpo_loss,
    stage_beta,
)
from rlbench.errors import ConfigError
from rlbench.training.weight_interpolation import interpolate_weights, parse_weights
from rlbench.validation import validate_config

BETA, LAM = 0.5, 2.0


# ------------------------------------------------------------------------------------- the stage losses


def test_stage_beta_is_beta_then_beta_over_lambda():
    assert stage_beta(BETA, LAM, 1) == BETA
    assert stage_beta(BETA, LAM, 2) == BETA / LAM
    with pytest.raises(ValueError, match="lambda"):
        stage_beta(BETA, 0.0, 2)
    with pytest.raises(ValueError, match="stages 1 and 2"):
        stage_beta(BETA, LAM, 3)


def one_group(lengths, rewards, seed=0):
    """One group of responses with the given lengths: random log-probs under the policy and the reference."""
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    mask = torch.tensor([[1.0] * n + [0.0] * (T - n) for n in lengths])
    logp = (-torch.rand(len(lengths), T, generator=g)).requires_grad_(True)
    ref = -torch.rand(len(lengths), T, generator=g)
    return logp, ref, mask, torch.tensor(rewards), torch.zeros(len(lengths), dtype=torch.long)


def test_stage_one_is_dpo_on_the_pairs_by_reward():
    logp, ref, mask, rewards, groups = one_group([3, 5, 2, 5], [1.0, 0.0, 1.0, 0.0])
    matrix, metrics = sacpo_loss(logp, ref, mask, rewards, groups, reference_stage=1, beta=BETA, lam=LAM)
    expected, _ = dpo_loss(logp, ref, mask, rewards, groups, beta=BETA, pairing="all")
    assert torch.equal(matrix, expected) and metrics["sacpo_stage"] == 1.0


def test_stage_two_pairs_correct_responses_by_brevity_with_beta_over_lambda():
    # rows 0, 1, 3 correct (lengths 3, 5, 5), row 2 incorrect and the shortest: pairs (0 > 1) and (0 > 3) only
    logp, ref, mask, rewards, groups = one_group([3, 5, 2, 5], [1.0, 1.0, 0.0, 1.0])
    matrix, metrics = sacpo_loss(logp, ref, mask, rewards, groups, reference_stage=2, beta=BETA, lam=LAM)
    delta = ((logp - ref) * mask).sum(-1)
    expected = (-F.logsigmoid(BETA / LAM * (delta[0] - delta[1])) - F.logsigmoid(BETA / LAM * (delta[0] - delta[3]))) / 2
    assert matrix.sum().item() == pytest.approx(expected.item(), rel=1e-6)
    assert metrics["sacpo_stage"] == 2.0 and metrics["preference_accuracy"] in (0.0, 0.5, 1.0)
    matrix.sum().backward()
    assert logp.grad[2].abs().sum() == 0  # the incorrect response is in no pair
    assert logp.grad[0][:3].sum() < 0  # descending the loss raises the shorter correct response


def test_brevity_ranks_only_within_the_correct_responses_of_a_group():
    mask = torch.tensor([[1.0, 1, 0], [1, 0, 0], [1, 1, 1], [1, 0, 0]])
    values, groups = brevity_preferences(torch.tensor([1.0, 0.0, 1.0, 1.0]), mask, torch.tensor([0, 0, 1, 1]), 1.0)
    assert values.tolist() == [-2.0, -1.0, -3.0, -1.0]
    assert groups[0] == 0 and groups[2] == groups[3] == 1 and groups[1] not in (0, 1)  # row 1 is alone


# ------------------------------------------------------------------------ the paper's identity, tabular


def soft_label_loss(theta, ref_logp, utility, reference_stage):
    """The expected SACPO loss of a tabular policy (logits ``theta`` over K one-token responses) when a pair
    (i, j) is labelled i > j with the Bradley-Terry probability sigma(u_i - u_j) of the stage's utility u.
    Each ordered pair is a group of two rows whose labels the stage's loss reads: stage 1 from the reward
    (winner 1, loser 0), stage 2 from brevity among correct responses (winner one token, loser two; the second
    token has log-prob 0 under both policies, so it leaves Delta unchanged and only carries the label)."""
    logp_k = torch.log_softmax(theta, -1)
    K = theta.shape[0]
    total = 0.0
    for i in range(K):
        for j in range(K):
            if i == j:
                continue
            logp = torch.stack([logp_k[i], logp_k[j]])[:, None] * torch.tensor([[1.0, 0.0], [1.0, 0.0]], dtype=theta.dtype)
            ref = torch.stack([ref_logp[i], ref_logp[j]])[:, None] * torch.tensor([[1.0, 0.0], [1.0, 0.0]], dtype=theta.dtype)
            if reference_stage == 1:
                mask, rewards = torch.tensor([[1.0, 0.0], [1.0, 0.0]]), torch.tensor([1.0, 0.0])
            else:
                mask, rewards = torch.tensor([[1.0, 0.0], [1.0, 1.0]]), torch.tensor([1.0, 1.0])
            matrix, _ = sacpo_loss(logp, ref, mask.to(theta.dtype), rewards.to(theta.dtype), torch.tensor([0, 0]),
                                   reference_stage=reference_stage, beta=BETA, lam=LAM)
            total = total + torch.sigmoid(utility[i] - utility[j]) * matrix.sum()
    return total


def minimise(loss_fn, K):
    theta = torch.zeros(K, dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.LBFGS([theta], lr=1.0, max_iter=500, tolerance_grad=1e-12, tolerance_change=1e-15,
                                  line_search_fn="strong_wolfe")

    def closure():
        optimizer.zero_grad()
        loss = loss_fn(theta)
        loss.backward()
        return loss

    for _ in range(5):
        optimizer.step(closure)
    return torch.log_softmax(theta.detach(), -1)


def test_two_stages_reach_the_lagrangian_optimum_of_both_objectives():
    """Stage 1 (DPO, beta, reference pi_ref, labels by r) then stage 2 (DPO, beta / lambda, reference = stage 1's
    result, labels by g) give pi* ∝ pi_ref exp((r + lambda g) / beta) (arXiv:2404.11049, section 4)."""
    ref_logp = torch.log_softmax(torch.tensor([0.3, -0.2, 0.5, -1.0], dtype=torch.float64), -1)
    r = torch.tensor([1.0, 0.2, -0.4, 0.6], dtype=torch.float64)
    g = torch.tensor([-0.3, 0.8, 0.1, -0.5], dtype=torch.float64)
    stage1 = minimise(lambda theta: soft_label_loss(theta, ref_logp, r, 1), 4)
    assert torch.allclose(stage1, torch.log_softmax(ref_logp + r / BETA, -1), atol=1e-6)  # pi_r
    stage2 = minimise(lambda theta: soft_label_loss(theta, stage1, g, 2), 4)
    optimum = torch.log_softmax(ref_logp + (r + LAM * g) / BETA, -1)
    assert torch.allclose(stage2, optimum, atol=1e-6)
    # without the rescaling (beta in stage 2 too) the result is the optimum of r + g, not r + lambda g
    assert not torch.allclose(stage2, torch.log_softmax(ref_logp + (r + g) / BETA, -1), atol=1e-2)


# ------------------------------------------------------------------------------------ P-SACPO


def test_interpolation_endpoints_are_the_stage_models_and_the_middle_is_linear():
    g = torch.Generator().manual_seed(1)
    first = {"a": torch.randn(3, 4, generator=g), "b": torch.randn(5, generator=g)}
    second = {"a": torch.randn(3, 4, generator=g), "b": torch.randn(5, generator=g)}
    assert all(torch.equal(interpolate_weights(first, second, 0.0)[k], first[k]) for k in first)
    assert all(torch.equal(interpolate_weights(first, second, 1.0)[k], second[k]) for k in first)
    middle = interpolate_weights(first, second, 0.25)
    assert all(torch.allclose(middle[k], 0.75 * first[k] + 0.25 * second[k], atol=1e-6) for k in first)
    with pytest.raises(ValueError, match="shape"):
        interpolate_weights(first, {"a": torch.zeros(4, 3), "b": second["b"]}, 0.5)


def test_weights_are_checked():
    assert parse_weights("0, 0.5,1") == [0.0, 0.5, 1.0]
    for bad in ("", "0,2", "a,b", "0.5,0.5"):
        with pytest.raises(ConfigError, match="weights"):
            parse_weights(bad)


# ------------------------------------------------------------------------------------ configuration


def test_sacpo_needs_its_stage_switch_and_refuses_lora(tmp_path):
    cfg = compose_config(["algorithm=sacpo", "experiment=smoke", "trainer.steps=8"], tmp_path / "a")
    assert cfg.algorithm.reincarnate_at == 5  # halfway
    with pytest.raises(ConfigError, match="reincarnate_at"):
        validate_config(compose_config(["algorithm=sacpo", "experiment=smoke", "algorithm.reincarnate_at=null"], tmp_path / "b"))
    with pytest.raises(ConfigError, match="LoRA"):
        validate_config(compose_config(["algorithm=sacpo", "experiment=smoke", "model/lora=default"], tmp_path / "c"))


# ------------------------------------------------------------------ the stage switch, through the runner


@pytest.fixture(scope="module")
def traces_of_several_lengths(tmp_path_factory):
    """4 graded responses for each of the first 4 toy problems, cut to 2..5 tokens (the toy's model never ends
    early, so without the cut every response has the same length and stage 2 has no brevity pair)."""
    from rlbench.runner import run

    root = tmp_path_factory.mktemp("sacpo")
    generated = root / "generated.jsonl"
    run(compose_config(["model=tiny", "model.tiny.vocab_size=512", "reward=even_tokens", "rollout.max_new_tokens=6",
                        "logger=files", "mode=generate", "dataset.limit=4", "rollout.n=4", "guidance.keep_incorrect=true",
                        f"out={generated}"], root / "gen"))
    records = [json.loads(line) for line in generated.read_text().splitlines()]
    for k, record in enumerate(records):
        record["response_ids"] = record["response_ids"][: 2 + k % 4]
        record.pop("text")
    out = root / "traces.jsonl"
    out.write_text("".join(json.dumps(record) + "\n" for record in records))
    return out


def sacpo_offline_run(run_dir, traces, *extra):
    from rlbench.runner import run

    overrides = ["experiment=toy_learning/sacpo", "rollout=offline", "guidance=jsonl", f"guidance.path={traces}",
                 "guidance.keep_incorrect=true", "rollout.n=4", "dataset.arith.train_size=4", "trainer.prompts_per_step=2",
                 "trainer.steps=3", "algorithm.reincarnate_at=2", "algorithm.loss.min_reward=0", "trainer.checkpoint_every=1",
                 "trainer.keep_checkpoints=3", "trainer.save_model=true", *extra]
    return run(compose_config(overrides, run_dir))


@pytest.mark.slow
def test_stage_two_trains_against_the_policy_at_the_switch_saved_and_restored(tmp_path, traces_of_several_lengths):
    from test_resume import assert_same_results

    from rlbench.training.checkpoint import MODEL_FILE, OPTIMIZER_FILE, STATE_FILE

    run_dir = tmp_path / "run"
    sacpo_offline_run(run_dir, traces_of_several_lengths)
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s["sacpo_stage"] for s in steps] == [1.0, 2.0, 2.0]
    assert all("preference_accuracy" in s for s in steps[1:])  # stage 2 trains on brevity pairs
    # stage 2's first loss: pi_theta = its new reference, so every pair is at log 2 (a stale reference would not be)
    assert steps[1]["policy_loss"] == pytest.approx(math.log(2), abs=1e-6)
    policy_after_stage_1 = torch.load(run_dir / "checkpoints/step_000001" / MODEL_FILE)
    for step in ("step_000002", "step_000003"):
        reference = torch.load(run_dir / "checkpoints" / step / STATE_FILE, weights_only=False)["context"]["reference"]
        assert reference.keys() == policy_after_stage_1.keys()
        assert all(torch.equal(reference[k], policy_after_stage_1[k]) for k in reference)  # exact weights
    # Adam's moments start again with stage 2: one optimizer step per training step, counted afresh from the switch
    adam_steps = [{float(p["step"]) for p in torch.load(run_dir / "checkpoints" / step / OPTIMIZER_FILE)["state"].values()}
                  for step in ("step_000001", "step_000002", "step_000003")]
    assert adam_steps == [{1.0}, {1.0}, {2.0}]
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(str(run_dir / "reference")).state_dict()  # <run>/reference/
    assert all(torch.equal(saved[k], policy_after_stage_1[k]) for k in saved if k in policy_after_stage_1)
    # resumed from step 2's checkpoint (stage 2 under way): step 3 trains against the restored reference
    resumed = tmp_path / "resumed"
    shutil.copytree(run_dir, resumed, ignore=shutil.ignore_patterns("step_000003"))
    summary = sacpo_offline_run(resumed, traces_of_several_lengths, f"resume={resumed}")
    assert summary["resumed_from_step"] == 2
    assert_same_results(run_dir, resumed)


@pytest.mark.slow
def test_p_sacpo_writes_the_interpolated_models_of_a_run(tmp_path, traces_of_several_lengths):
    import subprocess

    from conftest import ROOT
    from transformers import AutoModelForCausalLM

    run_dir = tmp_path / "run"
    sacpo_offline_run(run_dir, traces_of_several_lengths, "trainer.checkpoint_every=null")
    out = tmp_path / "merged"
    proc = subprocess.run([sys.executable, "-m", "rlbench.training.weight_interpolation", str(run_dir / "reference"),
                           str(run_dir / "policy"), "--weights", "0,0.5,1", f"--out={out}"],
                          check=False, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]

    def load(path):
        return dict(AutoModelForCausalLM.from_pretrained(str(path)).named_parameters())

    first, second = load(run_dir / "reference"), load(run_dir / "policy")
    assert any(not torch.equal(first[k], second[k]) for k in first)  # stage 2 moved the policy
    assert all(torch.equal(load(out / "w_0")[k], first[k]) for k in first)
    assert all(torch.equal(load(out / "w_1")[k], second[k]) for k in first)
    middle = load(out / "w_0.5")
    assert all(torch.allclose(middle[k], (first[k] + second[k]) / 2, atol=1e-6) for k in first)
    assert (out / "w_0.5" / "tokenizer_config.json").is_file()
