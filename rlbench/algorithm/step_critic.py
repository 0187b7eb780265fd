"""Direct Advantage Policy Optimization's critic: a model of its own that values partial solutions, trained
apart from the actor by regression on Monte-Carlo values (Liu et al. 2024, arXiv:2412.18279, section 3; the
run's side is rlbench/training/step_critic.py).

The critic is a causal language model (a copy of pi_ref's weights) with a value head on its final hidden state
(``ValueHead`` of rlbench/algorithm/critic.py, the head PPO puts on the policy):

    V_phi(s) = w . h_phi(s)[last token] + b

A state s_k is the prompt and the response's first ``start_k`` tokens, so its value is read at the position of
its last token, ``len(prompt) + start_k - 1`` (:func:`state_positions`): one forward over prompt + response
values every step boundary of a response. The critic is fitted by

    L(phi) = mean over the data set's states (V_phi(s) - V^(s))^2

where V^(s) is the mean reward of K continuations sampled from s (vine's estimate, rlbench/rollout/strategies/
vine.py), for ``epochs`` passes in shuffled mini-batches of responses (:func:`fit_step_critic`). The actor then
reads A(s_k, a_k) = V_phi(s_{k+1}) - V_phi(s_k) (the last step: R - V_phi(s_{L-1}); the ``vine`` advantage
piece) in its step regression (rlbench/algorithm/losses/step_advantage.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rlbench.algorithm.critic import ValueHead


@dataclass(frozen=True)
class ValuedSequence:
    """One response of the critic's data set: prompt + response token ids, the positions whose hidden states
    value its states (:func:`state_positions`) and, to fit on, the states' Monte-Carlo values."""

    token_ids: tuple[int, ...]
    positions: tuple[int, ...]
    targets: tuple[float, ...] = ()


def state_positions(prompt_length: int, starts: Sequence[int]) -> tuple[int, ...]:
    """The position of the last token of each state s_k = prompt + response[:start_k] in prompt + response."""
    if prompt_length < 1:
        raise ValueError("a state needs a prompt of at least one token")
    return tuple(prompt_length + start - 1 for start in starts)


class StepValueModel(torch.nn.Module):
    """V_phi: a causal LM's final hidden state through a zero-initialised value head (module docstring)."""

    def __init__(self, backbone: torch.nn.Module):
        super().__init__()
        self.backbone = backbone
        self.head = ValueHead(int(backbone.config.hidden_size)).to(next(backbone.parameters()).device)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """[B, T] values of every prefix ending at each position."""
        out = self.backbone(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
        return self.head(out.hidden_states[-1])


def padded(sequences: Sequence[ValuedSequence], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(input ids [B, T], attention mask [B, T]) of the sequences, right-padded."""
    width = max(len(s.token_ids) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, sequence in enumerate(sequences):
        ids[row, : len(sequence.token_ids)] = torch.tensor(sequence.token_ids, dtype=torch.long)
        mask[row, : len(sequence.token_ids)] = 1
    return ids.to(device), mask.to(device)


def state_values(model: StepValueModel, sequences: Sequence[ValuedSequence], pad_id: int) -> list[torch.Tensor]:
    """Each sequence's V_phi at its positions (with the graph, for the fit; wrap in no_grad to predict)."""
    device = next(model.parameters()).device
    values = model(*padded(sequences, pad_id, device))
    return [values[row, list(s.positions)] for row, s in enumerate(sequences)]


def predict_state_values(model: StepValueModel, sequences: Sequence[ValuedSequence], pad_id: int,
                         batch_size: int) -> list[list[float]]:
    """V_phi at every sequence's positions, without gradient, ``batch_size`` sequences a forward."""
    model.eval()
    out: list[list[float]] = []
    with torch.no_grad():
        for start in range(0, len(sequences), batch_size):
            out += [row.double().tolist() for row in state_values(model, sequences[start:start + batch_size], pad_id)]
    return out


def critic_loss(model: StepValueModel, sequences: Sequence[ValuedSequence], pad_id: int) -> torch.Tensor:
    """The mean squared error of V_phi against the Monte-Carlo targets over the sequences' states."""
    predicted = torch.cat(state_values(model, sequences, pad_id))
    targets = torch.tensor([t for s in sequences for t in s.targets], dtype=predicted.dtype, device=predicted.device)
    return ((predicted - targets) ** 2).mean()


def fit_step_critic(model: StepValueModel, sequences: Sequence[ValuedSequence], pad_id: int, epochs: int, lr: float,
                    batch_size: int, generator: torch.Generator) -> list[float]:
    """Fits V_phi to the targets by AdamW (``lr``) over ``epochs`` passes, each in a fresh order drawn from
    ``generator`` in mini-batches of ``batch_size`` sequences. Returns the mean squared error over the whole
    data set before the fit and after each epoch (no gradient)."""
    sequences = [s for s in sequences if s.positions]
    if any(len(s.positions) != len(s.targets) for s in sequences):
        raise ValueError("every state of the critic's data set needs its Monte-Carlo value")

    def whole_set_error() -> float:
        model.eval()
        with torch.no_grad():
            total = sum(float(critic_loss(model, sequences[i:i + batch_size], pad_id)) * sum(
                len(s.positions) for s in sequences[i:i + batch_size]) for i in range(0, len(sequences), batch_size))
        return total / max(sum(len(s.positions) for s in sequences), 1)

    errors = [whole_set_error()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    for _ in range(epochs):
        model.train()
        order = torch.randperm(len(sequences), generator=generator).tolist()
        for start in range(0, len(order), batch_size):
            optimizer.zero_grad(set_to_none=True)
            critic_loss(model, [sequences[i] for i in order[start:start + batch_size]], pad_id).backward()
            optimizer.step()
        errors.append(whole_set_error())
    model.eval()
    return errors
