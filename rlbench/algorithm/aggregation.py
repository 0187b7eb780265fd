"""Loss aggregation: a [B,T] loss matrix -> a scalar.

Each mode is normalised by counts of the whole *optimizer batch* (passed in as ``batch_tokens``
and ``batch_sequences``), not of the micro-batch being processed. Summing the aggregated losses
of any micro-batch split therefore gives exactly the full-batch loss, and gradient accumulation
gives exactly the full-batch gradient (verl issue #5625 is the bug this avoids).

Inputs offered by the trainer:
    loss_matrix      [B,T]  per-token loss, zero on padding
    response_mask    [B,T]
    batch_tokens     number of response tokens in the optimizer batch (N_tok)
    batch_sequences  number of responses in the optimizer batch (N_seq)
    batch_groups     number of groups (prompts) in the optimizer batch (N_grp)
"""

from __future__ import annotations

import torch

from rlbench.algorithm.registry import AGGREGATIONS


@AGGREGATIONS.register("token_mean")
def token_mean(loss_matrix: torch.Tensor, response_mask: torch.Tensor, batch_tokens: int) -> torch.Tensor:
    """L = sum_i sum_t m_it l_it / N_tok  (DAPO, arXiv:2503.14476: every token weighs the same)."""
    return (loss_matrix * response_mask).sum() / max(batch_tokens, 1)


@AGGREGATIONS.register("token_sum")
def token_sum(loss_matrix: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """L = sum_i sum_t m_it l_it  (no normalisation; verl's ``token-sum``).

    The gradient grows with the number of tokens in the optimizer batch, so the learning rate has
    to absorb the batch's size. Summed over micro-batches it equals the full-batch sum."""
    return (loss_matrix * response_mask).sum()


@AGGREGATIONS.register("group_mean")
def group_mean(loss_matrix: torch.Tensor, response_mask: torch.Tensor, batch_groups: int) -> torch.Tensor:
    """L = (1/N_grp) sum_i sum_t m_it l_it: a mean over the optimizer batch's groups, for a loss whose matrix
    carries each group's loss (the pairwise preference losses: a group's mean pair loss, losses/preference.py)."""
    return (loss_matrix * response_mask).sum() / max(batch_groups, 1)


@AGGREGATIONS.register("seq_mean_token_mean")
def seq_mean_token_mean(
    loss_matrix: torch.Tensor, response_mask: torch.Tensor, batch_sequences: int
) -> torch.Tensor:
    """L = (1/N_seq) sum_i (1/|o_i|) sum_t m_it l_it  (original GRPO, arXiv:2402.03300 eq. 3).

    Zero-length responses contribute 0 (|o_i| is clamped to 1)."""
    per_sequence = (loss_matrix * response_mask).sum(-1) / response_mask.sum(-1).clamp(min=1)
    return per_sequence.sum() / max(batch_sequences, 1)


@AGGREGATIONS.register("seq_mean_token_sum")
def seq_mean_token_sum(
    loss_matrix: torch.Tensor, response_mask: torch.Tensor, batch_sequences: int
) -> torch.Tensor:
    """L = (1/N_seq) sum_i sum_t m_it l_it."""
    return (loss_matrix * response_mask).sum() / max(batch_sequences, 1)


@AGGREGATIONS.register("seq_mean_token_sum_norm")
def seq_mean_token_sum_norm(
    loss_matrix: torch.Tensor,
    response_mask: torch.Tensor,
    batch_sequences: int,
    norm_length: int,
) -> torch.Tensor:
    """L = (1/N_seq) sum_i sum_t m_it l_it / L_norm  (Dr.GRPO, arXiv:2503.20783).

    L_norm is a constant, by default the generation budget ``max_new_tokens``, so a response's
    weight does not depend on its length. This equals TRL's ``dr_grpo`` normalisation
    (sum / (B * max_completion_length)). Compared with verl's ``seq-mean-token-sum-norm``: verl
    v0.4's ``agg_loss`` computes sum_i sum_t m_it l_it / T (no 1/N_seq; T the padded response
    length), which is larger than this by the batch size; later verl versions also divide by the
    global batch size (and by ``loss_scale_factor``, default T), which equals this loss with
    L_norm = loss_scale_factor.
    """
    if norm_length <= 0:
        raise ValueError(f"norm_length must be positive, got {norm_length}")
    return (loss_matrix * response_mask).sum() / (max(batch_sequences, 1) * norm_length)
