"""DRPO's learned preference model: a Bradley-Terry reward model fitted on the data set's labelled pairs before
the actor trains (Xu et al. 2025, "Doubly Robust Alignment for Large Language Models", arXiv:2506.01183,
section 4: the preference model g of the doubly robust estimate is a Bradley-Terry model or a general preference
model learned from the preference data; the run's side is rlbench/training/preference_model.py).

The model is a :class:`~rlbench.algorithm.value_model.ValueModel` (a copy of pi_ref with a value head) read at a
response's last token: the score r_phi(x, y). Its preference is

    g(y_a, y_b) = P_phi(y_a > y_b | x) = sigma(r_phi(x, y_a) - r_phi(x, y_b))        (g_ab + g_ba = 1)

fitted by the Bradley-Terry likelihood on every ordered pair (y_w, y_l) of a group whose labels differ (the
higher reward wins; a tie carries no Bradley-Terry label and is left out):

    L(phi) = mean over pairs -log sigma(r_phi(x, y_w) - r_phi(x, y_l))
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rlbench.algorithm.value_model import ValuedSequence, ValueModel, fit_value_model, values_at


@dataclass(frozen=True)
class LabelledPair:
    """A preferred and a dispreferred response to one prompt, each as prompt + response ids read at its last token."""

    winner: ValuedSequence
    loser: ValuedSequence


def scored_sequence(prompt_ids: Sequence[int], response_ids: Sequence[int]) -> ValuedSequence:
    """Prompt + response, read at the response's last token (the prompt's last for an empty response)."""
    ids = tuple(prompt_ids) + tuple(response_ids)
    return ValuedSequence(ids, (len(ids) - 1,))


def labelled_pairs(sequences: Sequence[ValuedSequence], rewards: Sequence[float], group_index: Sequence[int]) -> list[LabelledPair]:
    """Every ordered pair of one group's responses whose rewards differ, the higher reward the winner."""
    pairs = []
    for a, (seq_a, r_a, g_a) in enumerate(zip(sequences, rewards, group_index)):
        for seq_b, r_b, g_b in zip(sequences[a + 1:], rewards[a + 1:], group_index[a + 1:]):
            if g_a == g_b and r_a != r_b:
                pairs.append(LabelledPair(seq_a, seq_b) if r_a > r_b else LabelledPair(seq_b, seq_a))
    return pairs


def bradley_terry_loss(model: ValueModel, pairs: Sequence[LabelledPair], pad_id: int) -> tuple[torch.Tensor, int]:
    """(mean -log sigma(r_w - r_l) over the pairs, their count)."""
    scores = torch.cat(values_at(model, [p.winner for p in pairs] + [p.loser for p in pairs], pad_id))
    margin = scores[: len(pairs)] - scores[len(pairs):]
    return -torch.nn.functional.logsigmoid(margin).mean(), len(pairs)


def pair_accuracy(scores_winner: Sequence[float], scores_loser: Sequence[float]) -> float:
    """The share of pairs the model orders as labelled (a tie counts half)."""
    right = sum(1.0 if win > lose else 0.5 if win == lose else 0.0 for win, lose in zip(scores_winner, scores_loser))
    return right / max(len(scores_winner), 1)


def fit_preference_model(model: ValueModel, pairs: Sequence[LabelledPair], pad_id: int, epochs: int, lr: float,
                         batch_size: int, generator: torch.Generator) -> list[float]:
    """Fits r_phi by the Bradley-Terry likelihood (module docstring; ``fit_value_model``). Returns the mean loss over
    the pairs before the fit and after each epoch."""
    if not pairs:
        raise ValueError("the preference model's data set has no pair of responses with different labels")
    return fit_value_model(model, pairs, lambda batch: bradley_terry_loss(model, batch, pad_id), epochs, lr, batch_size,
                           generator)
