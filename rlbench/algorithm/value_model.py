"""A language model with a scalar head, fitted apart from the policy: the models an algorithm trains before its
actor (Direct Advantage PO's step critic, rlbench/algorithm/step_critic.py; DRPO's Bradley-Terry preference model,
rlbench/algorithm/preference_model.py).

The model is a causal language model (a copy of pi_ref's weights) with a value head on its final hidden state
(``ValueHead`` of rlbench/algorithm/critic.py, the head PPO puts on the policy):

    V_phi(prefix) = w . h_phi(prefix)[last token] + b

so one forward over a sequence values every prefix of it: a :class:`ValuedSequence` names the positions read.
:func:`fit_value_model` fits it by AdamW on a loss of mini-batches of sequences (the caller's), in a fresh order
each epoch drawn from the caller's generator, and measures that loss over the whole set before and after each
epoch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rlbench.algorithm.critic import ValueHead


@dataclass(frozen=True)
class ValuedSequence:
    """Token ids (prompt + response), the positions whose hidden states are valued, and the targets there (the
    step critic's Monte-Carlo values; empty where the loss needs none)."""

    token_ids: tuple[int, ...]
    positions: tuple[int, ...]
    targets: tuple[float, ...] = ()


class ValueModel(torch.nn.Module):
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


def values_at(model: ValueModel, sequences: Sequence[ValuedSequence], pad_id: int) -> list[torch.Tensor]:
    """Each sequence's V_phi at its positions (with the graph, for a fit; wrap in no_grad to predict)."""
    device = next(model.parameters()).device
    values = model(*padded(sequences, pad_id, device))
    return [values[row, list(s.positions)] for row, s in enumerate(sequences)]


def predict_values(model: ValueModel, sequences: Sequence[ValuedSequence], pad_id: int, batch_size: int) -> list[list[float]]:
    """V_phi at every sequence's positions, without gradient, ``batch_size`` sequences a forward."""
    model.eval()
    out: list[list[float]] = []
    with torch.no_grad():
        for start in range(0, len(sequences), batch_size):
            out += [row.double().tolist() for row in values_at(model, sequences[start:start + batch_size], pad_id)]
    return out


def fit_value_model(model: ValueModel, items: Sequence[Any], loss: Callable[[list[Any]], tuple[torch.Tensor, int]],
                    epochs: int, lr: float, batch_size: int, generator: torch.Generator) -> list[float]:
    """Fits the model by AdamW (``lr``, no weight decay) over ``epochs`` passes over ``items``, each in a fresh order
    drawn from ``generator``, in mini-batches of ``batch_size`` items; ``loss(batch)`` is (the batch's mean loss, the
    number of terms it averages). Returns the mean loss over the whole set before the fit and after each epoch
    (without gradient)."""

    def whole_set_loss() -> float:
        model.eval()
        total, count = 0.0, 0
        with torch.no_grad():
            for start in range(0, len(items), batch_size):
                value, terms = loss(list(items[start:start + batch_size]))
                total, count = total + float(value) * terms, count + terms
        return total / max(count, 1)

    losses = [whole_set_loss()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    for _ in range(epochs):
        model.train()
        order = torch.randperm(len(items), generator=generator).tolist()
        for start in range(0, len(order), batch_size):
            optimizer.zero_grad(set_to_none=True)
            loss([items[i] for i in order[start:start + batch_size]])[0].backward()
            optimizer.step()
        losses.append(whole_set_loss())
    model.eval()
    return losses
