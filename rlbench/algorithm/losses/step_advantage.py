"""Direct Advantage Policy Optimization (Liu et al. 2024, "Improving Multi-Step Reasoning Abilities of Large
Language Models with Direct Advantage Policy Optimization", arXiv:2412.18279, section 3; named
``direct_advantage_po`` so that it does not clash with DAPO, arXiv:2503.14476): a step-level regression of the
policy's log-ratio to pi_ref onto a critic's step advantages, the actor trained apart from the critic.

A response is cut into steps a_0, a_1, ... from the states s_0 (the prompt), s_1 = s_0 + a_0, ... (the steps of
rollout=vine: ``step_index``); the critic's advantage of a step is A(s_k, a_k) = V(s_{k+1}) - V(s_k) (the vine
advantage piece: V(s) is the mean reward of Monte-Carlo continuations from s, the value after the last step is
the response's reward). Each step contributes

    l_k = (beta h_k - A(s_k, a_k))^2,      h_k = sum_{t in step k} (log pi_theta(o_t | .) - log pi_ref(o_t | .))

the log-probabilities summed over the step's tokens. The regression's fixed point on data drawn by the policy
itself (the runner's samples) is pi(a | s) = pi_ref(a | s) exp(A(s, a) / beta) / Z(s): the residual
beta h - A is then the same constant -beta log Z(s) for every action of a state, and the gradient
2 beta pi(a) (e_a - E_pi e) vanishes (``tests/test_direct_advantage_po.py`` reaches it on a tabular chain with
a perfect critic). The matrix spreads l_k evenly over the step's tokens, so a row's sum is sum_k l_k.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from rlbench.algorithm.registry import POLICY_LOSSES
from rlbench.errors import ConfigError

STEP_SUM_WHY = ("the objective is a mean over responses of the sum of their steps' squared errors; a token mean would "
                "weigh a step by the response's length")


def step_sums(values: torch.Tensor, step_index: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sums [B*S+1], token counts [B*S+1], key [B,T]): every (row, step)'s sum of ``values`` over its valid tokens,
    key[b, t] = b S + step_index[b, t] (S = the widest step id + 1) and the spare slot B S for invalid tokens."""
    rows, _ = step_index.shape
    width = int(step_index.max().clamp(min=0)) + 1
    key = torch.arange(rows, device=step_index.device)[:, None] * width + step_index.clamp(min=0)
    key = torch.where(valid, key, torch.full_like(key, rows * width))
    flat = key.flatten()
    sums = values.new_zeros(rows * width + 1).index_add(0, flat, (values * valid).flatten())
    counts = values.new_zeros(rows * width + 1).index_add(0, flat, valid.to(values.dtype).flatten())
    return sums, counts, key


def check_direct_advantage_po(params: Mapping[str, Any]) -> None:
    """ConfigError on a beta <= 0 (the fixed point pi_ref exp(A / beta) / Z needs beta > 0)."""
    if params["beta"] <= 0:
        raise ConfigError(f"algorithm.loss.beta must be > 0, got {params['beta']}")


@POLICY_LOSSES.register("direct_advantage_po", aggregation="seq_mean_token_sum", conflicts=(STEP_SUM_WHY,),
                        check_params=check_direct_advantage_po)
def direct_advantage_po_loss(
    logp: torch.Tensor, ref_logp: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor,
    step_index: torch.Tensor | None, beta: float = 0.1,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Direct Advantage Policy Optimization's actor loss (arXiv:2412.18279, section 3; module docstring):
    l_k = (beta sum_{t in step k} log(pi_theta / pi_ref)(o_t) - A_k)^2 per step, spread over the step's tokens.
    A_k is the mean of ``advantages`` over the step's tokens (the vine piece gives every token of a step the
    same value). ``step_index``: rollout=vine's steps (required: a run whose rollout does not provide them is
    refused before the model loads)."""
    if step_index is None:
        raise ConfigError("loss direct_advantage_po reads the steps of rollout=vine (step_index): add rollout=vine")
    check_direct_advantage_po({"beta": beta})
    valid = (step_index >= 0) & (response_mask > 0)
    log_ratio, _, key = step_sums(logp - ref_logp, step_index, valid)
    advantage_sums, counts, _ = step_sums(advantages.to(logp.dtype), step_index, valid)
    steps = counts > 0
    residual = beta * log_ratio - advantage_sums / counts.clamp(min=1)
    step_loss = residual**2 * steps
    matrix = (step_loss / counts.clamp(min=1))[key] * valid
    found = residual.detach()[steps]
    metrics = {} if found.numel() == 0 else {
        "step_residual_abs": float(found.abs().mean()), "steps_per_response": float(steps.sum()) / max(int((valid.sum(-1) > 0).sum()), 1)
    }
    return matrix, metrics
