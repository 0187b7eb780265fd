"""Imitation of the batch's good responses: supervised fine-tuning as a policy loss.

Offline (``rollout=offline``) it is the natural baseline of the preference objectives: SFT on the correct
responses of the same file. Online it is rejection-sampling fine-tuning (RFT; Yuan et al. 2023,
arXiv:2308.01825, section 3.3): sample, keep the responses the grader accepts, maximise their likelihood.
"""

from __future__ import annotations

import torch

from rlbench.algorithm.registry import POLICY_LOSSES


@POLICY_LOSSES.register("sft")
def sft_loss(
    logp: torch.Tensor, response_mask: torch.Tensor, rewards: torch.Tensor, min_reward: float = 1.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """l_it = -[r_i >= min_reward] log pi_theta(o_it | q, o_<t): the negative log-likelihood of the responses
    whose reward reaches ``min_reward`` (1: the correct ones under a 0/1 grader); the others contribute 0.
    With ``token_mean`` aggregation the kept tokens' mean NLL (the rejected responses' tokens still count in
    N_tok, as a masked-out response does under DAPO's filter: set min_reward below every reward for plain SFT)."""
    keep = (rewards >= min_reward).to(logp.dtype)[:, None]
    matrix = -logp * keep * response_mask
    kept_tokens = (keep * response_mask).sum()
    return matrix, {
        "sft_kept_fraction": float(keep.mean().item()),
        "sft_nll": float((matrix.sum() / kept_tokens.clamp(min=1)).item()),
    }
