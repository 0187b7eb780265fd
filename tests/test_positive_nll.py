"""The NLL of the correct responses beside the policy loss (algorithm.positive_nll_coef; CE-GPPO's released
scripts, Kwai-Klear/CE-GPPO positive_loss_coeff=0.1): closed-form values and gradients on hand-made
log-probs, coef 0 equals the loss without it bit for bit, incorrect responses get no gradient from it, the
micro-batches of an optimizer batch add up to its value, and the batch counts the correct responses."""

from __future__ import annotations

import pytest
import torch

from rlbench.algorithm import Algorithm
from rlbench.algorithm.aggregation import token_mean
from rlbench.algorithm.losses import ppo_clip_loss
from rlbench.algorithm.losses.auxiliary_sft import ppo_clip_sft_loss, target_nll
from rlbench.config.typed import algorithm_settings
from rlbench.errors import ConfigError
from rlbench.training.batch import TrainBatch, batch_norms
from rlbench.training.update import BATCH_LOSS_INPUTS

# 3 responses of up to 3 tokens; responses 0 and 2 are correct.
# correct tokens: row 0's two (-log pi = 1, 2) and row 2's one (3): N_tok(C) = 3, N_seq(C) = 2
LOGP = [[-1.0, -2.0, 0.0], [-0.5, -0.5, -0.5], [-3.0, 0.0, 0.0]]
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
CORRECT = torch.tensor([True, False, True])
ADVANTAGES = torch.tensor([[1.0, 1.0, 0.0], [-1.0, -1.0, -1.0], [1.0, 0.0, 0.0]])
NORMS = {"batch_tokens": 6, "batch_sequences": 3, "batch_groups": 1, "norm_length": 3,
         "correct_batch_tokens": 3, "correct_batch_sequences": 2, "correct_batch_groups": 1}


def algorithm(coef: float, aggregation: str = "token_mean") -> Algorithm:
    return Algorithm.from_config(algorithm_settings({
        "advantage": {"name": "grpo"}, "loss": {"name": "ppo_clip", "clip_low": 0.2, "clip_high": 0.2},
        "aggregation": {"name": aggregation}, "positive_nll_coef": coef,
    }))


def loss_and_grad(algo: Algorithm, rows=slice(None), norms=NORMS, **extra) -> tuple[torch.Tensor, torch.Tensor, dict]:
    logp = torch.tensor(LOGP)[rows].clone().requires_grad_(True)
    # pi_old = pi_theta (one on-policy update): ratio 1, no clipping
    loss, metrics = algo.compute_loss(norms=norms, logp=logp, old_logp=logp.detach(), advantages=ADVANTAGES[rows],
                                      response_mask=MASK[rows], **extra)
    loss.backward()
    return loss.detach(), logp.grad, metrics


def test_token_mean_value_and_gradient_are_the_hand_computed_ones():
    with_term, grad, metrics = loss_and_grad(algorithm(0.1), correct=CORRECT)
    without, grad0, _ = loss_and_grad(algorithm(0.0), correct=CORRECT)
    # L_NLL = (1 + 2 + 3) / N_tok(C) = 6 / 3 = 2; the loss grows by 0.1 * 2
    assert metrics["positive_nll"] == pytest.approx(2.0)
    assert (with_term - without).item() == pytest.approx(0.2)
    # d(0.1 L_NLL) / d logp = -0.1 / 3 on each correct token; 0 on the incorrect response and on padding
    expected = torch.tensor([[-0.1 / 3, -0.1 / 3, 0.0], [0.0, 0.0, 0.0], [-0.1 / 3, 0.0, 0.0]])
    torch.testing.assert_close(grad - grad0, expected)
    assert torch.equal(grad[1], grad0[1])  # the incorrect response: the policy gradient's alone, bit for bit


def test_seq_mean_token_mean_averages_the_correct_responses():
    _, grad, metrics = loss_and_grad(algorithm(0.1, "seq_mean_token_mean"), correct=CORRECT)
    _, grad0, _ = loss_and_grad(algorithm(0.0, "seq_mean_token_mean"), correct=CORRECT)
    # row 0's token mean 1.5, row 2's 3; over N_seq(C) = 2 responses: 2.25
    assert metrics["positive_nll"] == pytest.approx(2.25)
    # row 0: 0.1 / (2 responses x 2 tokens) = 0.025 per token; row 2: 0.1 / (2 x 1) = 0.05
    torch.testing.assert_close(grad - grad0, torch.tensor([[-0.025, -0.025, 0.0], [0.0, 0.0, 0.0], [-0.05, 0.0, 0.0]]))


def test_coefficient_zero_is_the_loss_without_the_term_bit_for_bit():
    off, grad_off, metrics = loss_and_grad(algorithm(0.0), correct=CORRECT)
    plain, grad_plain, _ = loss_and_grad(algorithm(0.0))  # no verdicts at all
    logp = torch.tensor(LOGP).requires_grad_(True)
    matrix, _ = ppo_clip_loss(logp, logp.detach(), ADVANTAGES, MASK, 0.2, 0.2)
    reference = token_mean(matrix, MASK, NORMS["batch_tokens"])  # the policy loss, aggregated: the old objective
    reference.backward()
    assert torch.equal(off, plain) and torch.equal(off, reference.detach())
    assert torch.equal(grad_off, grad_plain) and torch.equal(grad_off, logp.grad)
    assert "positive_nll" not in metrics


def test_micro_batches_add_up_to_the_optimizer_batch():
    whole, grad, _ = loss_and_grad(algorithm(0.1), correct=CORRECT)
    parts = [loss_and_grad(algorithm(0.1), rows=rows, correct=CORRECT[rows]) for rows in (slice(0, 1), slice(1, 3))]
    assert sum(part[0] for part in parts).item() == pytest.approx(whole.item())
    torch.testing.assert_close(torch.cat([part[1] for part in parts]), grad)


def test_no_correct_response_adds_nothing():
    norms = {**NORMS, "correct_batch_tokens": 0, "correct_batch_sequences": 0, "correct_batch_groups": 0}
    with_term, grad, metrics = loss_and_grad(algorithm(0.1), norms=norms, correct=torch.zeros(3, dtype=torch.bool))
    without, grad0, _ = loss_and_grad(algorithm(0.0), norms=norms)
    assert metrics["positive_nll"] == 0.0 and torch.equal(with_term, without) and torch.equal(grad, grad0)


def test_the_term_and_ppo_clip_sft_share_one_nll():
    logp = torch.tensor(LOGP)
    target = CORRECT.float()[:, None] * MASK
    assert torch.equal(target_nll(logp, target), -logp * target)
    # ppo_clip_sft on the same targets: its SFT tokens carry sft_coef x target_nll instead of ppo_clip
    matrix, _ = ppo_clip_sft_loss(logp, logp, ADVANTAGES, MASK, target, sft_coef=0.1)
    assert torch.equal(matrix[0, :2], 0.1 * target_nll(logp, target)[0, :2])


def test_batch_norms_count_the_correct_responses():
    batch = TrainBatch(
        input_ids=torch.zeros(3, 4, dtype=torch.long), attention_mask=torch.ones(3, 4, dtype=torch.long),
        response_mask=MASK, prompt_width=1, group_index=torch.tensor([0, 0, 1]), correct=CORRECT,
    )
    norms = batch_norms(batch, torch.arange(3), norm_length=3)
    assert norms == NORMS | {"batch_groups": 2, "correct_batch_groups": 2}  # rows 0 and 2 sit in groups 0 and 1
    # a mini-batch of rows 1 and 2: one correct response of one token
    assert {k: v for k, v in batch_norms(batch, torch.tensor([1, 2]), 3).items() if k.startswith("correct_")} == {
        "correct_batch_tokens": 1, "correct_batch_sequences": 1, "correct_batch_groups": 1}
    assert "correct" in BATCH_LOSS_INPUTS  # the update hands the batch's verdicts to the loss


def test_bad_settings_are_refused():
    with pytest.raises(ConfigError, match="positive_nll_coef"):
        algorithm(-0.1)
    with pytest.raises(ValueError, match="verdicts"):
        loss_and_grad(algorithm(0.1))  # no correct input
    with pytest.raises(ConfigError, match="positive_nll_coef"):
        Algorithm.from_config(algorithm_settings({
            "advantage": {"name": "grpo"}, "loss": {"name": "dpo"}, "aggregation": {"name": "group_mean"},
            "positive_nll_coef": 0.1,
        }))


def test_the_update_hands_the_verdicts_to_the_term_and_micro_batches_add_up():
    """standard_update on a tiny model: the term changes the gradient only through the correct responses' tokens,
    and micro-batches of 2 give the whole batch's gradient (normalised by the optimizer batch's correct counts)."""
    from rlbench.training.batch import collate
    from rlbench.training.update import standard_update
    from test_trainer import RecordingOptimizer, completions, tiny_lm

    def gradient(coef: float, micro_batch_size: int, correct: torch.Tensor) -> torch.Tensor:
        algo = algorithm(coef)
        batch = collate(completions(0), pad_token_id=0)
        batch.rewards = correct.float()
        batch.correct = correct
        batch.advantages = algo.compute_advantages(batch.rewards, batch.group_index, batch.response_mask)
        model = tiny_lm(0)
        recorded = RecordingOptimizer(model)
        standard_update(model, recorded, batch, algo, micro_batch_size=micro_batch_size, max_grad_norm=None,
                        temperature=1.0, norm_length=6)
        return torch.cat([g.reshape(-1) for g in recorded.steps[0]])

    correct = torch.tensor([True, False, False, True] * 3)
    whole, split, off = gradient(0.1, 12, correct), gradient(0.1, 2, correct), gradient(0.0, 2, correct)
    torch.testing.assert_close(split, whole, atol=1e-6, rtol=1e-5)
    assert (whole - off).abs().max() > 1e-4  # the term acts
    # no correct response: the same gradient as without the term, bit for bit
    none = torch.zeros(12, dtype=torch.bool)
    assert torch.equal(gradient(0.1, 2, none), gradient(0.0, 2, none))
