"""Per-position statistics of the policy's next-token distribution along given responses, for
strategies that decide where to branch (lookahead, entropy_branch): the two most likely tokens with
their probabilities, and the entropy, under the run's sampling distribution (temperature and top-p,
as the engine samples). One forward pass per batch of rows through the HF engine's model (the engine
itself is not changed; its ``score_prefixes`` gives only the chosen tokens' log-probs)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from rlbench.errors import ConfigError
from rlbench.rollout.base import SamplingParams
from rlbench.rollout.hf_engine import _warpers, left_pad


@dataclass
class PositionStats:
    """For each position t of a response: the distribution that sampled token t (given the prompt
    and tokens < t). ``top_tokens`` / ``top_probs`` [L, 2]: the most and second most likely tokens
    and their probabilities; ``entropy`` [L] in nats; ``vocab_size``: the distribution's support
    (``entropy / log(vocab_size)`` is the normalised entropy in [0, 1])."""

    top_tokens: torch.Tensor
    top_probs: torch.Tensor
    entropy: torch.Tensor
    vocab_size: int


def needs_hf_engine(strategy: str, rollout_cfg: Any, reason: str) -> None:
    """ConfigError unless ``rollout.engine`` is hf; ``reason``: what the strategy needs from it."""
    if rollout_cfg.get("engine", "hf") != "hf":
        raise ConfigError(f"rollout={strategy} {reason}, which only rollout.engine=hf provides; set rollout.engine=hf")


def position_stats(
    engine: Any, items: Sequence[tuple[tuple[int, ...], tuple[int, ...]]], params: SamplingParams
) -> list[PositionStats]:
    """:class:`PositionStats` of each ``response`` given its ``prompt`` (``items`` = pairs) under
    ``engine.model``, warped like the engine's sampling (greedy scores at temperature 1)."""
    warpers = _warpers(params)
    results: list[PositionStats] = []
    model = engine.model
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            for start in range(0, len(items), engine.batch_size):
                chunk = items[start : start + engine.batch_size]
                input_ids, mask = left_pad([tuple(p) + tuple(r) for p, r in chunk], engine.pad_id, engine.device)
                keep = max(len(r) for _, r in chunk) + 1
                logits = model(
                    input_ids=input_ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                    logits_to_keep=keep,
                ).logits[:, -keep:]
                for row, (_, response) in enumerate(chunk):
                    length = len(response)
                    scores = logits[row, keep - length - 1 : keep - 1].float()
                    targets = input_ids[row, input_ids.shape[1] - length :]
                    for w in warpers:
                        scores = w(targets[None], scores)
                    logp = torch.log_softmax(scores, dim=-1)
                    probs = logp.exp()
                    top = probs.topk(2, dim=-1)
                    entropy = -(probs * logp.nan_to_num(neginf=0.0)).sum(-1)
                    results.append(PositionStats(top.indices.cpu(), top.values.double().cpu(), entropy.double().cpu(), probs.shape[-1]))
    finally:
        model.train(was_training)
    return results
