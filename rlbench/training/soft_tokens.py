"""The training forward of a batch with soft thinking steps (SofT-GRPO, arXiv:2511.06411, section 3;
the math in rlbench/algorithm/soft_thinking.py, the rollout in rlbench/rollout/strategies/soft_thinking.py).

A response of ``rollout=soft_thinking`` carries, per token, the step inputs ``soft_ids``,
``soft_noisy_logp`` and ``soft_weights`` (``[B, T, K]``; the weights all 0 on a discrete token). The
forward (rlbench.training.forward.token_outputs) then

- feeds each soft step's input as the mixture ``sum_v w_v E_v`` of the current embedding matrix (the
  discrete tokens keep their own embedding), through ``inputs_embeds``, and
- replaces the log-prob of each soft step by its reparameterised log-likelihood under the current
  weights, the Gumbel log-density of ``y - log pi_k,theta`` summed over the K tokens; the discrete
  answer tokens keep ``log pi(o_t)``.

Every log-prob of the step (the sampling pass, the reference, the update) goes through it, so the PPO
ratio of a soft step compares the same density under theta and theta_old.
"""

from __future__ import annotations

import torch

from rlbench.algorithm.soft_thinking import SOFT_IDS, SOFT_NOISY_LOGP, SOFT_WEIGHTS, soft_token_log_prob, top_k_log_probs


def soft_step_mask(batch) -> torch.Tensor | None:
    """[B, T] bool: the soft thinking steps of ``batch`` (a TrainBatch); None when it carries none."""
    weights = batch.extras.get(SOFT_WEIGHTS.name)
    if weights is None:
        return None
    soft = weights.sum(-1) > 0
    return soft if bool(soft.any()) else None


def soft_input_embeddings(embedding: torch.nn.Module, batch, soft: torch.Tensor) -> torch.Tensor:
    """[B, P+T, H]: the token embeddings of ``batch.input_ids`` with each soft step's input (``soft``
    [B, T]) replaced by the mixture of its top-k embeddings under the stored weights."""
    embeds = embedding(batch.input_ids)
    P, T = batch.prompt_width, soft.shape[1]
    ids, weights = batch.extras[SOFT_IDS.name][:, :T], batch.extras[SOFT_WEIGHTS.name][:, :T]
    mixture = (weights.to(embeds.dtype).unsqueeze(-1) * embedding(ids)).sum(-2)  # [B, T, H]
    response = torch.where(soft.unsqueeze(-1), mixture, embeds[:, P : P + T])
    return torch.cat([embeds[:, :P], response, embeds[:, P + T :]], dim=1)


def with_soft_log_probs(
    logp: torch.Tensor, logits: torch.Tensor, batch, soft: torch.Tensor, temperature: float
) -> torch.Tensor:
    """``logp`` [B, T] with each soft step's entry replaced by its reparameterised log-likelihood,
    computed from ``logits`` [B, T, V] (the logits that predict each response position) at the sampling
    ``temperature``."""
    scaled = logits.float() / temperature if temperature and temperature > 0 else logits.float()
    T = logp.shape[1]
    log_pk = top_k_log_probs(scaled, batch.extras[SOFT_IDS.name][:, :T])
    soft_logp = soft_token_log_prob(log_pk, batch.extras[SOFT_NOISY_LOGP.name][:, :T].float())
    return torch.where(soft, soft_logp, logp)
