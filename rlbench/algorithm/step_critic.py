"""Direct Advantage Policy Optimization's critic: a model of its own that values partial solutions, trained
apart from the actor by regression on Monte-Carlo values (Liu et al. 2024, arXiv:2412.18279, section 3; the
run's side is rlbench/training/step_critic.py).

The critic is a :class:`~rlbench.algorithm.value_model.ValueModel` (a copy of pi_ref with a value head). A state
s_k is the prompt and the response's first ``start_k`` tokens, so its value is read at the position of its last
token, ``len(prompt) + start_k - 1`` (:func:`state_positions`): one forward over prompt + response values every
step boundary of a response. The critic is fitted by

    L(phi) = mean over the data set's states (V_phi(s) - V^(s))^2

where V^(s) is the mean reward of K continuations sampled from s (vine's estimate, rlbench/rollout/strategies/
vine.py), for ``epochs`` passes in shuffled mini-batches of responses (:func:`fit_step_critic`). The actor then
reads A(s_k, a_k) = V_phi(s_{k+1}) - V_phi(s_k) (the last step: R - V_phi(s_{L-1}); the ``vine`` advantage
piece) in its step regression (rlbench/algorithm/losses/step_advantage.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rlbench.algorithm.value_model import ValuedSequence, ValueModel, fit_value_model, values_at


def state_positions(prompt_length: int, starts: Sequence[int]) -> tuple[int, ...]:
    """The position of the last token of each state s_k = prompt + response[:start_k] in prompt + response."""
    if prompt_length < 1:
        raise ValueError("a state needs a prompt of at least one token")
    return tuple(prompt_length + start - 1 for start in starts)


def critic_loss(model: ValueModel, sequences: Sequence[ValuedSequence], pad_id: int) -> tuple[torch.Tensor, int]:
    """(the mean squared error of V_phi against the Monte-Carlo targets over the sequences' states, their count)."""
    predicted = torch.cat(values_at(model, sequences, pad_id))
    targets = torch.tensor([t for s in sequences for t in s.targets], dtype=predicted.dtype, device=predicted.device)
    return ((predicted - targets) ** 2).mean(), int(targets.numel())


def fit_step_critic(model: ValueModel, sequences: Sequence[ValuedSequence], pad_id: int, epochs: int, lr: float,
                    batch_size: int, generator: torch.Generator) -> list[float]:
    """Fits V_phi to the targets (module docstring; :func:`~rlbench.algorithm.value_model.fit_value_model`).
    Returns the mean squared error over the data set's states before the fit and after each epoch."""
    sequences = [s for s in sequences if s.positions]
    if any(len(s.positions) != len(s.targets) for s in sequences):
        raise ValueError("every state of the critic's data set needs its Monte-Carlo value")
    return fit_value_model(model, sequences, lambda batch: critic_loss(model, batch, pad_id), epochs, lr, batch_size,
                           generator)
