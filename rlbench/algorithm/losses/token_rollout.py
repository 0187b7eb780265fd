"""One-token rollouts (OTR; Ming et al. 2025, "One-Token Rollout: Guiding Supervised Fine-Tuning of LLMs
with Policy Gradient", arXiv:2509.26313): supervised data as a token-level policy gradient. At every
position t of a reference response y*, K tokens a_1..a_K are sampled from the current policy given the
reference prefix, pi_theta(. | x, y*_<t) (the forward pass over the reference already holds that
distribution: no generation), each rewarded r_k = 1 when it equals y*_t (``mismatch_reward`` otherwise),
and the policy gradient of those one-step trajectories replaces SFT's cross-entropy:

    L_t = -(1/K) sum_k (r_k - b_t) log pi_theta(a_k | x, y*_<t),   b_t = mean_k r_k (``baseline``) or 0

Its expectation with b = 0 is -pi(y*_t) grad log pi(y*_t): SFT's gradient weighted by the policy's own
probability of the reference token; the leave-in mean baseline scales that by (K - 1) / K (its own sample
is part of the mean). The samples are drawn from a generator seeded by ``seed``, the training progress and
the micro-batch's tokens, so a run is repeatable without drawing on any other random stream.
"""

from __future__ import annotations

import torch

from rlbench.algorithm.losses.common import masked_mean
from rlbench.algorithm.registry import POLICY_LOSSES


def token_rollout_generator(response_ids: torch.Tensor, progress: float, seed: int) -> torch.Generator:
    """The samples' stream: a function of ``seed``, the progress and the micro-batch's token ids."""
    ids = response_ids.detach().to("cpu", torch.int64).flatten()
    weights = torch.arange(1, ids.numel() + 1, dtype=torch.int64)
    key = (int((ids * weights).sum().item()) * 1_000_003 + int(round(progress * 1e9)) + seed * 7_919) % (2**63 - 1)
    return torch.Generator(device=response_ids.device).manual_seed(key)


@POLICY_LOSSES.register("otr", on_policy="its one-token rollouts are sampled from the current policy inside the loss")
def otr_loss(
    log_probs: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    progress: float = 0.0,
    samples: int = 8,
    baseline: bool = True,
    mismatch_reward: float = 0.0,
    seed: int = 0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The OTR loss matrix [B,T] (module docstring): ``samples`` = K one-token rollouts per position,
    reward 1 for the reference token and ``mismatch_reward`` for any other, leave-in mean ``baseline``.
    Metrics: ``token_rollout_match`` (share of sampled tokens equal to the reference token) and
    ``reference_prob_mean`` (pi_theta(y*_t), the weight OTR puts on SFT's gradient in expectation)."""
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    B, T, V = log_probs.shape
    mask = response_mask.to(log_probs.dtype)
    probs = log_probs.detach().exp().reshape(B * T, V)
    draws = torch.multinomial(probs, samples, replacement=True, generator=token_rollout_generator(response_ids, progress, seed))
    draws = draws.reshape(B, T, samples)
    sampled_logp = log_probs.gather(-1, draws)  # [B,T,K], with gradient
    match = (draws == response_ids.unsqueeze(-1)).to(log_probs.dtype)
    rewards = match + (1.0 - match) * mismatch_reward
    base = rewards.mean(-1, keepdim=True) if baseline else torch.zeros_like(rewards[..., :1])
    loss = -((rewards - base) * sampled_logp).mean(-1)
    with torch.no_grad():
        reference_prob = log_probs.detach().gather(-1, response_ids.unsqueeze(-1)).squeeze(-1).exp()
        metrics = {
            "token_rollout_match": masked_mean(match.mean(-1), mask).item(),
            "reference_prob_mean": masked_mean(reference_prob, mask).item(),
        }
    return loss * mask, metrics
