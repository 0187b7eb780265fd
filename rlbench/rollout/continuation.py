"""Continuing responses from prefixes with a budget per request (speculative regeneration, lookahead
branches). :class:`SamplingParams` carries one ``max_new_tokens`` per engine call, so requests are
grouped into power-of-two budgets (one call each, at most log2(max_new_tokens) + 1 calls) and each
completion is cut to its own budget: the first b tokens of a longer sample are a sample with budget
b. Tokens sampled past a cut count as generated (the engine did sample them)."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from rlbench.rollout.engines.base import Completion, GenerationRequest, SamplingParams


def budget_bucket(remaining: int, max_new_tokens: int) -> int:
    """The engine budget for a request with ``remaining`` new tokens: the next power of two, at most
    ``max_new_tokens``."""
    return min(max_new_tokens, 1 << max(remaining - 1, 0).bit_length())


def cut_to_length(completion: Completion, length: int, tokenizer: Any) -> Completion:
    """The completion cut to ``length`` response tokens (unchanged when it is not longer); a cut
    response did not end with EOS."""
    if len(completion.response_ids) <= length:
        return completion
    ids = completion.response_ids[:length]
    completion.response_ids, completion.logprobs = ids, completion.logprobs[:length]
    completion.finished = False
    completion.text = tokenizer.decode(ids, skip_special_tokens=True)
    return completion


def continue_with_budgets(
    sampler: Any,
    requests: Sequence[tuple[GenerationRequest, int]],
    params: SamplingParams,
    generator: torch.Generator | None,
) -> list[list[Completion]]:
    """For each ``(request, new_tokens)``, the request's completions with at most ``new_tokens``
    tokens after its prefix, in order; engine calls go through ``sampler.generate`` (counted)."""
    buckets: dict[int, list[int]] = {}
    for index, (_, new_tokens) in enumerate(requests):
        buckets.setdefault(budget_bucket(new_tokens, params.max_new_tokens), []).append(index)
    out: list[list[Completion]] = [[] for _ in requests]
    for bucket in sorted(buckets):
        indices = buckets[bucket]
        call = SamplingParams(params.temperature, params.top_p, bucket)
        for index, completions in zip(indices, sampler.generate([requests[i][0] for i in indices], call, generator)):
            request, new_tokens = requests[index]
            out[index] = [cut_to_length(c, len(request.prefix_ids) + new_tokens, sampler.tokenizer) for c in completions]
    return out
