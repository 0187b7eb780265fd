"""VinePPO's step advantage from Monte-Carlo values (rollout=vine, rlbench/rollout/strategies/vine.py).

Reads, per response token, the step it belongs to and the value estimate of the state where that
step starts (the step inputs rollout=vine puts in Completion.extras; rlbench/algorithm/step_inputs.py):

    step_index   [B,T] long   the step (0, 1, ...) of every response token, -1 on padding
    step_values  [B,T] float  V^(s_t) of the state before the token's step (the same on every token of a step)
"""

from __future__ import annotations

import torch

from rlbench.algorithm.advantages.common import _tokens, _valid, _whiten
from rlbench.algorithm.registry import ADVANTAGES
from rlbench.errors import ConfigError


def step_runs(step_index: list[int], valid: list[bool]) -> list[tuple[int, list[int]]]:
    """The steps along one row, in order: (step id, positions of its valid tokens); a step id must
    occupy one contiguous run."""
    runs: list[tuple[int, list[int]]] = []
    for position, (step, keep) in enumerate(zip(step_index, valid)):
        if not keep or step < 0:
            continue
        if runs and runs[-1][0] == step:
            runs[-1][1].append(position)
        elif any(step == seen for seen, _ in runs):
            raise ValueError(f"step {step} appears twice, apart, in one response: step_index is not a sequence of steps")
        else:
            runs.append((step, [position]))
    return runs


@ADVANTAGES.register("vine", advantage_level="token")
def vine_advantage(
    rewards: torch.Tensor,
    response_mask: torch.Tensor,
    step_index: torch.Tensor,
    step_values: torch.Tensor,
    gamma: float = 1.0,
    whiten: bool = False,
    epsilon: float = 1e-8,
) -> torch.Tensor:
    """VinePPO's advantage (Kazemnejad et al. 2024, "VinePPO: Unlocking RL Potential For LLM Reasoning
    Through Refined Credit Assignment", arXiv:2410.01679, section 4): the response is cut into steps
    s_0 -> s_1 -> ... -> s_L (the terminal state), V^(s_t) is the mean reward of K continuations sampled
    from s_t, and every token of step t gets

        A_t = r_t + gamma V^(s_{t+1}) - V^(s_t)

    with r_t = 0 before the last step, and for the last step r = R (the response's reward, ``rewards``)
    and V^(terminal) = 0:  A_{L-1} = R - V^(s_{L-1}). With gamma = 1 the advantages telescope:
    sum_t A_t = R - V^(s_0). A response of one step gets R - V^(s_0), the outcome advantage with the
    prompt's value as its baseline (Dr.GRPO's advantage when V^(s_0) is the group's mean reward).
    ``whiten``: then whitened over the valid tokens of the batch, (A - mean) / (std + epsilon), as the
    authors' PPO trainer does (``whiten_advantages: true`` in McGill-NLP/VinePPO configs/trainers/ppo_MATH.jsonnet).
    """
    if not 0.0 <= float(gamma) <= 1.0:
        raise ConfigError(f"algorithm.advantage.gamma must lie in [0, 1], got {gamma}")
    values = step_values.to(torch.float64)
    outcome = rewards.to(torch.float64)
    out = torch.zeros(response_mask.shape, dtype=torch.float64, device=response_mask.device)
    valid = _valid(response_mask).tolist()
    for row, (steps, keep) in enumerate(zip(step_index.tolist(), valid)):
        runs = step_runs(steps, keep)
        starts = [float(values[row, positions[0]]) for _, positions in runs]
        for k, (_, positions) in enumerate(runs):
            following = float(gamma) * starts[k + 1] if k + 1 < len(runs) else float(outcome[row])
            out[row, positions] = following - starts[k]
    if whiten:
        out = _whiten(out, _valid(response_mask), epsilon)
    return _tokens(out, response_mask)
