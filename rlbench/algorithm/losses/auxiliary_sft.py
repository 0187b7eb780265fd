"""A policy loss with a supervised fine-tuning term on marked responses.

Cog-Rethinker (Sun et al. 2025, "Cog-Rethinker: Hierarchical Metacognitive Reinforcement Learning for LLM
Reasoning", arXiv:2510.15979, section 3): the correct responses of the decompose and refine stages are
trained by supervised fine-tuning under the direct template, beside GRPO on the direct groups:
L = L_GRPO + lambda * L_SFT with L_SFT = -log pi_theta(y_s | T_direct(x)). The strategy (``rollout=rethink``,
``successes: sft``) marks those responses' tokens in the step input ``sft_target``.

``target_nll`` is the supervised term itself, shared with the composition's NLL on the correct responses
(``algorithm.positive_nll_coef``, rlbench/algorithm/composition.py): there it is added beside the policy
gradient on every token of a correct response, here it replaces the policy gradient on the marked tokens.
"""

from __future__ import annotations

import torch

from rlbench.algorithm.losses.ratio_clipped import ppo_clip_loss
from rlbench.algorithm.registry import POLICY_LOSSES


def target_nll(logp: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The supervised (negative log-likelihood) term on the target tokens, 0 elsewhere:

        l_t = -t_t log pi_theta(o_t | q, o_<t),   t_t in {0, 1}

    Cog-Rethinker's L_SFT (arXiv:2510.15979, section 3) with t = sft_target, and CE-GPPO's NLL on the
    correct responses (the authors' release, Kwai-Klear/CE-GPPO: positive_loss_coeff) with t_t = 1 on every
    response token of a correct response. The gradient d l_t / d log pi = -t_t raises the target tokens'
    log-probabilities and leaves the others untouched."""
    return -logp * target


@POLICY_LOSSES.register("ppo_clip_sft")
def ppo_clip_sft_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    sft_target: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    sft_coef: float = 0.1,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO-clip on the policy's own tokens and lambda * cross-entropy on the SFT tokens (s_t = 1):

        l_t = (1 - s_t) * ppo_clip_t + sft_coef * s_t * (-log pi_theta(o_t | q, o_<t))

    The aggregation then averages l as it averages any loss matrix, so the two terms share its
    normalisation (under seq_mean_token_mean: each response's token mean, averaged over every response
    of the batch, SFT ones included). Metrics: ppo_clip's, ``sft_nll`` (the mean -log pi over SFT tokens)
    and ``sft_token_fraction`` (the share of trained tokens that are SFT tokens)."""
    ppo, metrics = ppo_clip_loss(logp, old_logp, advantages, response_mask, clip_low, clip_high)
    sft = sft_target.to(logp.dtype) * response_mask
    loss = ppo * (1 - sft) + sft_coef * target_nll(logp, sft)
    tokens = float(sft.sum().item())
    nll = float(target_nll(logp.detach(), sft).sum().item() / tokens) if tokens else 0.0
    return loss, {**metrics, "sft_nll": nll, "sft_token_fraction": tokens / max(float(response_mask.sum().item()), 1.0)}
