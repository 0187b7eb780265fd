"""SofT-GRPO's soft tokens and their reparameterised likelihood (Zheng et al. 2025, "SofT-GRPO: Surpassing
Discrete-Token LLM Reinforcement Learning via Gumbel-Reparameterized Soft-Thinking Policy Optimization",
arXiv:2511.06411, section 3: the Gumbel-Softmax rollout and the Gumbel-reparameterised policy loss).

A soft thinking step does not commit to one token. Over the top-k tokens ``v`` of the next-token
distribution, renormalised to ``pi_k(v)``, Gumbel noise ``g_v ~ Gumbel(0, 1)`` perturbs the log-probs,

    y_v = log pi_k(v) + g_v,                 w = softmax(y / tau_g),        e = sum_v w_v E_v,

and the next input is the mixture ``e`` of the token embeddings ``E_v`` (Gumbel-Softmax with temperature
``tau_g``: the weights are >= 0 and sum to 1, so ``e`` stays in the convex hull of the top-k embeddings,
inside the pre-trained embedding space). The action of the step is the noise: given the stored ``y``, the
noise a policy ``theta`` would have needed is ``g_v(theta) = y_v - log pi_k,theta(v)``, and the step's
log-likelihood under ``theta`` is the Gumbel log-density of that noise,

    log p_theta(y) = sum_v [ -g_v(theta) - exp(-g_v(theta)) ],

so the PPO ratio of a soft step is ``exp(log p_theta - log p_old)`` and its gradient reaches the logits
of the top-k tokens through ``log pi_k,theta``.

This module holds the math; the step inputs a soft-thinking rollout stores per response token are declared in
rlbench/algorithm/step_inputs.py and read by the training forward (rlbench/training/soft_tokens.py); the
rollout is rlbench/rollout/strategies/soft_thinking.py.
"""

from __future__ import annotations

import torch

from rlbench.algorithm.step_inputs import STEP_INPUTS

# The step inputs a soft-thinking rollout stores per response token, declared in rlbench/algorithm/step_inputs.py.
SOFT_IDS, SOFT_NOISY_LOGP, SOFT_WEIGHTS = STEP_INPUTS["soft_ids"], STEP_INPUTS["soft_noisy_logp"], STEP_INPUTS["soft_weights"]
SOFT_INPUT_NAMES = (SOFT_IDS.name, SOFT_NOISY_LOGP.name, SOFT_WEIGHTS.name)


def gumbel_log_density(g: torch.Tensor) -> torch.Tensor:
    """log of the standard Gumbel density at ``g``: ``-g - exp(-g)`` (elementwise)."""
    return -g - torch.exp(-g)


def top_k_log_probs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``log pi_k(v)`` for the ids ``ids`` ``[..., K]`` of ``logits`` ``[..., V]``: the distribution of
    ``logits`` restricted to those ids and renormalised over them."""
    chosen = logits.gather(-1, ids)
    return chosen - torch.logsumexp(chosen, dim=-1, keepdim=True)


def soft_token_log_prob(top_k_logp: torch.Tensor, noisy_logp: torch.Tensor) -> torch.Tensor:
    """The reparameterised log-likelihood of soft steps ``[...]``: the Gumbel log-density of the noise
    ``g = noisy_logp - top_k_logp`` summed over the K tokens (both ``[..., K]``)."""
    return gumbel_log_density(noisy_logp - top_k_logp).sum(-1)


def gumbel_softmax_weights(noisy_logp: torch.Tensor, tau: float) -> torch.Tensor:
    """The Gumbel-Softmax mixture weights ``softmax(y / tau)`` over the last dimension."""
    return torch.softmax(noisy_logp / tau, dim=-1)


def sample_gumbel(shape: torch.Size | tuple[int, ...], generator: torch.Generator | None, device) -> torch.Tensor:
    """``Gumbel(0, 1)`` noise, ``-log(-log u)`` with ``u`` uniform in (0, 1) drawn from ``generator``."""
    u = torch.rand(shape, generator=generator, device=device, dtype=torch.float64)
    tiny = torch.finfo(torch.float64).tiny
    return (-torch.log(-torch.log(u.clamp(min=tiny, max=1.0 - 1e-16)))).float()
