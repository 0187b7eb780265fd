"""The training batch: graded groups stacked into padded tensors, and the views an update takes of it.

Layout: prompts are LEFT-padded to a common width P and responses RIGHT-padded to a common length
T, so every response starts at column P. The logits that predict response token t sit at column
P - 1 + t, and only the last T + 1 columns need the LM head (see rlbench.training.forward).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import torch

from rlbench.rollout.base import Completion


@dataclass
class TrainBatch:
    input_ids: torch.Tensor  # [B, P+T]
    attention_mask: torch.Tensor  # [B, P+T]
    response_mask: torch.Tensor  # [B, T] float
    prompt_width: int  # P
    group_index: torch.Tensor  # [B] long
    rewards: torch.Tensor | None = None  # [B]
    advantages: torch.Tensor | None = None  # [B, T]
    old_logp: torch.Tensor | None = None  # [B, T]
    ref_logp: torch.Tensor | None = None  # [B, T]
    token_weights: torch.Tensor | None = None  # [B, T] policy-loss token mask (e.g. top-entropy), None = all 1
    old_values: torch.Tensor | None = None  # [B, T] critic values of the sampling policy
    returns: torch.Tensor | None = None  # [B, T] critic regression targets
    sampling_logp: torch.Tensor | None = None  # [B, T] the rollout engine's log-probs (Completion.logprobs)

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    def select(self, rows: torch.Tensor) -> "TrainBatch":
        """The sub-batch of ``rows``, trimmed to the longest response it holds."""
        response_len = int(self.response_mask[rows].sum(-1).max().item()) if len(rows) else 0
        keep = max(response_len, 1)
        width = self.prompt_width + keep

        def take(t: torch.Tensor | None, token_level: bool) -> torch.Tensor | None:
            if t is None:
                return None
            t = t[rows]
            return t[:, :keep] if token_level else t

        return replace(
            self,
            input_ids=self.input_ids[rows, :width],
            attention_mask=self.attention_mask[rows, :width],
            response_mask=self.response_mask[rows, :keep],
            group_index=self.group_index[rows],
            rewards=take(self.rewards, False),
            advantages=take(self.advantages, True),
            old_logp=take(self.old_logp, True),
            ref_logp=take(self.ref_logp, True),
            token_weights=take(self.token_weights, True),
            old_values=take(self.old_values, True),
            returns=take(self.returns, True),
            sampling_logp=take(self.sampling_logp, True),
        )


def collate(groups: Sequence[Sequence[Completion]], pad_token_id: int, device: torch.device | str = "cpu") -> TrainBatch:
    """Stack completions (grouped per prompt) into a left/right padded batch."""
    flat = [(g, c) for g, group in enumerate(groups) for c in group]
    if not flat:
        raise ValueError("no completions to train on")
    prompt_width = max(len(c.prompt_ids) for _, c in flat)
    response_len = max(1, max(len(c.response_ids) for _, c in flat))
    B = len(flat)
    input_ids = torch.full((B, prompt_width + response_len), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    response_mask = torch.zeros(B, response_len)
    sampling_logp = torch.zeros(B, response_len)
    for row, (_, c) in enumerate(flat):
        p, r = len(c.prompt_ids), len(c.response_ids)
        input_ids[row, prompt_width - p : prompt_width] = torch.tensor(c.prompt_ids, dtype=torch.long)
        attention_mask[row, prompt_width - p : prompt_width] = 1
        if r:
            input_ids[row, prompt_width : prompt_width + r] = torch.tensor(c.response_ids, dtype=torch.long)
            attention_mask[row, prompt_width : prompt_width + r] = 1
            response_mask[row, :r] = 1
            sampling_logp[row, :r] = torch.tensor(c.logprobs, dtype=sampling_logp.dtype)
    group_index = torch.tensor([g for g, _ in flat], dtype=torch.long)
    return TrainBatch(
        input_ids=input_ids.to(device),
        attention_mask=attention_mask.to(device),
        response_mask=response_mask.to(device),
        prompt_width=prompt_width,
        group_index=group_index.to(device),
        sampling_logp=sampling_logp.to(device),
    )


def micro_batches(rows: torch.Tensor, micro_batch_size: int) -> list[torch.Tensor]:
    return [rows[i : i + micro_batch_size] for i in range(0, len(rows), micro_batch_size)]


def batch_norms(batch: TrainBatch, rows: torch.Tensor, norm_length: int) -> dict[str, int]:
    """The optimizer batch's counts every aggregation normalises by (see rlbench.algorithm.aggregation)."""
    return {
        "batch_tokens": int(batch.response_mask[rows].sum().item()),
        "batch_sequences": len(rows),
        "norm_length": norm_length,
    }


def mask_truncated(batch: TrainBatch, finished: torch.Tensor) -> TrainBatch:
    """DAPO's overlong filtering (Yu et al. 2025, arXiv:2503.14476, section 3.4): a response that
    hit the generation budget without EOS is masked out of the loss, m_it = 0 for all its tokens,
    so it adds neither to the policy loss, the KL and entropy terms nor to token_mean's token count.

    The advantages are computed before masking (the truncated response still counts in its group's
    statistics). Under the seq_mean_* aggregations a masked response still counts in N_seq.
    """
    keep = finished.to(batch.response_mask.device, batch.response_mask.dtype)[:, None]
    advantages = None if batch.advantages is None else batch.advantages * keep
    return replace(batch, response_mask=batch.response_mask * keep, advantages=advantages)


def trainable_tokens(batch: TrainBatch) -> int:
    """sum_i sum_t m_it w_it: the tokens the policy loss can move (response mask times the token
    mask, when the algorithm sets one). 0 means the step's gradient comes from no token at all."""
    mask = batch.response_mask if batch.token_weights is None else batch.response_mask * batch.token_weights
    return int((mask > 0).sum().item())
