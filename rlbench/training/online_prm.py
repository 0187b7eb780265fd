"""OPRL's implicit process reward model, trained online beside the policy (``algorithm.online_prm``; Liu et al.
2025, arXiv:2509.19199, section 3): the run's side of rlbench/algorithm/advantages/oprl.py.

pi_phi starts as a copy of the initial policy and is trained alternately with the policy, as the paper's loop reads:
each step, after the rollout and before the advantage,

    1. PRM update: the pairs (tau+, tau-) of a group with R(tau+) > R(tau-) (the step's outcome rewards), and
       ``updates`` AdamW steps (its own optimizer, ``lr``) on L_phi = -log sigma(R_phi(tau+) - R_phi(tau-)),
       R_phi(tau) = sum_k r_phi(s_k, a_k) = beta (log pi_phi(tau) - log pi_base(tau)) over the action tokens;
    2. step rewards: r_phi(s_k, a_k) = beta sum_{t in a_k} (log pi_phi - log pi_base) of every step k (turn) with the
       updated PRM, the ``step_process_rewards`` the oprl advantage normalises within the group;
    3. the policy update (rlbench/training/step.py).

pi_base (``baseline``) is the frozen reference pi_ref (``reference``: its log-probs are the batch's ``ref_logp``), or
the policy that sampled the step, pi_theta_old, the paper's (``policy``: one no-grad pass of the policy before its
update, or the batch's ``old_logp`` when the step computed them).

A step is a turn of rollout=multi_turn (``steps: turns``, the episodes' ``step_index``), or, for single-turn
responses (``steps: paragraphs``), a paragraph: the response cut at its blank lines, the paper's reasoning steps
for math (:func:`paragraph_steps`; the step input ``step_index`` of such a batch is computed here, from the tokens'
text).

The PRM's weights and its optimizer's state change every step: both are checkpointed (:meth:`OnlinePRM.state_dict`,
through its step-input source in rlbench/training/advantage_inputs.py), so a resumed run is the uninterrupted one.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from dataclasses import dataclass
from typing import Any

import torch

from rlbench.algorithm.advantages.oprl import (
    implicit_dpo_loss,
    outcome_pairs,
    step_implicit_rewards,
    trajectory_implicit_rewards,
)
from rlbench.config.schema import OnlinePRMConfig
from rlbench.training.batch import TrainBatch, whole_group_chunks
from rlbench.training.distributed import unwrap
from rlbench.training.forward import batch_outputs, token_outputs


PARAGRAPH_BREAK = re.compile(r"\n[ \t]*\n\s*(?=\S)")  # a blank line (or several) before more text


def paragraph_steps(pieces: list[str]) -> list[int]:
    """The step (0, 1, ...) of each token of a single-turn response whose tokens read ``pieces``: the response's text
    is cut after every blank line that more text follows (OPRL's reasoning steps, arXiv:2509.19199 section 3), and a
    token belongs to the step its first character is in (a token that holds a break and the next text is the earlier
    step's). Blank lines at the end start no step."""
    starts, offset = [], 0
    for piece in pieces:
        starts.append(offset)
        offset += len(piece)
    breaks = [m.end() for m in PARAGRAPH_BREAK.finditer("".join(pieces))]
    steps, k = [], 0
    for start in starts:
        while k < len(breaks) and breaks[k] <= start:
            k += 1
        steps.append(k)
    return steps


def paragraph_step_index(responses: list[list[int]], tokenizer: Any, like: torch.Tensor) -> torch.Tensor:
    """[B,T] long ``step_index`` of single-turn ``responses`` (token ids, in batch order) by :func:`paragraph_steps`,
    -1 past each response's end; ``like``: the batch's [B,T] response mask (its shape and device)."""
    index = torch.full(like.shape, -1, dtype=torch.long)
    for row, ids in enumerate(responses):
        steps = paragraph_steps([tokenizer.decode([t], skip_special_tokens=False) for t in ids])
        index[row, : len(steps)] = torch.tensor(steps[: like.shape[1]], dtype=torch.long)
    return index.to(like.device)


@dataclass
class OnlinePRM:
    """pi_phi, its optimizer and its settings (module docstring). ``temperature``: the one the policy's and the
    reference's log-probs are computed at; ``policy``: the policy pi_base is with ``baseline: policy``."""

    settings: OnlinePRMConfig
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    micro_batch_size: int
    temperature: float
    policy: torch.nn.Module | None = None

    @classmethod
    def from_reference(cls, settings: OnlinePRMConfig, initial: torch.nn.Module, micro_batch_size: int,
                       temperature: float, policy: torch.nn.Module | None = None) -> OnlinePRM:
        """A trainable copy of ``initial`` (the initial policy: the frozen reference, or the policy before its first
        step) with a fresh AdamW (no weight decay)."""
        model = copy.deepcopy(unwrap(initial)).requires_grad_(True)
        model.eval()  # no dropout: the PRM's log-probs are those of the model, as the reference's are
        optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=0.0)
        return cls(settings, model, optimizer, micro_batch_size, temperature, policy)

    def scored(self, batch: TrainBatch) -> TrainBatch:
        """The batch with log pi_base in its ``ref_logp`` (what the implicit reward is taken against)."""
        if self.settings.baseline == "reference":
            return batch
        old = batch.old_logp if batch.old_logp is not None else batch_outputs(
            self.policy, batch, self.micro_batch_size, self.temperature).logp
        return dataclasses.replace(batch, ref_logp=old)

    def update(self, batch: TrainBatch) -> dict[str, float]:
        """Step 1: ``updates`` optimizer steps of the trajectory DPO loss on the batch's outcome-ranked pairs (none
        when every group's rewards are equal); ``batch``: :meth:`scored`'s. Returns the loss of the first pass and
        the number of pairs."""
        pairs = outcome_pairs(batch.rewards, batch.group_index)
        metrics = {"prm_pairs": float(len(pairs))}
        if not pairs:
            return metrics
        in_pairs = sorted({row for pair in pairs for row in pair})
        rows = torch.tensor(in_pairs, device=batch.group_index.device)
        chunks = whole_group_chunks(rows, batch.group_index, self.micro_batch_size)
        for update in range(self.settings.updates):
            self.optimizer.zero_grad(set_to_none=True)
            total = 0.0
            for chunk in chunks:
                sub = batch.select(chunk)
                local = {row: k for k, row in enumerate(chunk.tolist())}
                chunk_pairs = [(local[w], local[lo]) for w, lo in pairs if w in local]
                logp = token_outputs(self.model, sub, self.temperature).logp
                rewards = trajectory_implicit_rewards(logp, sub.ref_logp, sub.extras["step_index"], sub.response_mask,
                                                      self.settings.beta)
                loss = implicit_dpo_loss(rewards, chunk_pairs, normaliser=len(pairs))
                loss.backward()
                total += float(loss.detach())
            self.optimizer.step()
            if update == 0:
                metrics["prm_loss"] = total
        self.optimizer.zero_grad(set_to_none=True)
        return metrics

    def step_rewards(self, batch: TrainBatch) -> tuple[torch.Tensor, dict[str, float]]:
        """Step 2 (``batch``: :meth:`scored`'s): [B,T] float64 r_phi of every token's step under the current PRM (no gradient), and its numbers:
        the DPO loss and the share of pairs ranked right after the update, the mean and std of the step rewards."""
        steps = batch.extras["step_index"]
        logp = batch_outputs(self.model, batch, self.micro_batch_size, self.temperature).logp
        rewards = step_implicit_rewards(logp, batch.ref_logp, steps, batch.response_mask, self.settings.beta)
        metrics = {}
        pairs = outcome_pairs(batch.rewards, batch.group_index)
        if pairs:
            trajectory = trajectory_implicit_rewards(logp, batch.ref_logp, steps, batch.response_mask, self.settings.beta)
            metrics["prm_loss_after"] = float(implicit_dpo_loss(trajectory, pairs))
            metrics["prm_pair_accuracy"] = sum(float(trajectory[w] > trajectory[lo]) for w, lo in pairs) / len(pairs)
        per_step = rewards[(batch.response_mask > 0) & (steps >= 0)]
        if per_step.numel():
            metrics["prm_step_reward_mean"] = float(per_step.mean())
            metrics["prm_step_reward_abs_max"] = float(per_step.abs().max())
        return rewards, metrics

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
