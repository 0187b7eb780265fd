"""The rollout-engine interface.

An engine turns generation requests into completions with their sampling log-probabilities.
It is shaped for the strategies rlbench composes:

* ``n`` varies per request (adaptive rollouts);
* ``prefix_ids`` continues from given response tokens (hints, speculative reuse of earlier
  responses); the prefix is part of the returned response and its log-probs are scored too;
* many requests may share a prompt with different prefixes (tree / segment sampling).

The Hugging Face ``generate`` engine implements it on CPU and GPU; a vLLM engine implements
the same interface on GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. ``temperature == 0`` means greedy decoding."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64


@dataclass(frozen=True)
class GenerationRequest:
    """Sample ``n`` continuations of ``prompt_ids + prefix_ids``.

    ``seed``: the request's own random stream. Its k-th sample draws from a generator seeded with
    :func:`sample_seed` ``(seed, k)``, whatever else is in the call (the evaluation gives each
    problem one, so a benchmark's samples do not depend on the rest of the suite). None: the
    call's ``generator`` (the training rollouts). A call takes all requests with seeds or none.
    """

    prompt_ids: tuple[int, ...]
    n: int = 1
    prefix_ids: tuple[int, ...] = ()
    seed: int | None = None


def sample_seed(request_seed: int, k: int) -> int:
    """The seed of the k-th sample of a request with its own ``seed`` (31 bits, so that every
    engine, vLLM included, takes it)."""
    return (int(request_seed) * 1_000_003 + k) % (2**31 - 1)


def request_seeds(requests: Sequence[GenerationRequest]) -> bool:
    """True when every request carries its own seed, False when none does; a mix is refused."""
    seeded = [r.seed is not None for r in requests]
    if any(seeded) and not all(seeded):
        raise ValueError("either every generation request has its own seed or none has")
    return bool(seeded) and all(seeded)


@dataclass
class Completion:
    """One sampled response.

    response_ids: the prefix (if any) followed by the newly generated tokens, EOS included
                  when generation stopped at EOS, no padding.
    logprobs:     log pi_sample(token | context) for every token of ``response_ids`` under the
                  distribution actually sampled from (after temperature and top-p); prefix
                  tokens are scored under the same distribution.
    finished:     True when generation stopped at EOS, False when it hit ``max_new_tokens``.
    """

    request_index: int
    prompt_ids: tuple[int, ...]
    response_ids: list[int]
    logprobs: list[float]
    finished: bool
    text: str = ""
    prefix_len: int = 0


class RolloutEngine(Protocol):
    def generate(
        self,
        requests: Sequence[GenerationRequest],
        params: SamplingParams,
        generator: torch.Generator | None = None,
    ) -> list[list[Completion]]:
        """Return, for each request, its ``n`` completions in order."""
        ...

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Make the engine sample from ``model``'s current weights."""
        ...
