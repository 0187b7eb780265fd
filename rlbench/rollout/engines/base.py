"""The rollout-engine interface.

An engine turns generation requests into completions with their sampling log-probabilities.
It is shaped for the strategies rlbench composes:

* ``n`` varies per request (adaptive rollouts);
* ``prefix_ids`` continues from given response tokens (hints, speculative reuse of earlier
  responses); the prefix is part of the returned response and its log-probs are scored too;
* many requests may share a prompt with different prefixes (tree / segment sampling).

Besides generating, an engine reads the policy's sampling distribution along given responses
(:meth:`RolloutEngine.score_prefixes`, :meth:`RolloutEngine.position_stats`): the strategies that
verify drafts or decide where to branch (speculative, lookahead, entropy_branch) use only these, so
they run on either engine.

The Hugging Face ``generate`` engine implements it on CPU and GPU; a vLLM engine implements
the same interface on GPU (its scoring runs on the Hugging Face policy model it keeps in step).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import torch


class LogitsTransform(Protocol):
    """A per-step change of the next-token logits inside the engine's decoding loop (the one sampling
    hook; rollout=adaptive_temperature and rollout=masked use it). The vLLM engine runs it as a vLLM
    logits processor (rlbench/rollout/engines/vllm_logits.py), on the same raw logits at the same place.

    Called at every decoding step with ``logits`` ``[rows, V]`` (float32, the model's raw logits of the
    rows still running) and ``contexts`` (each row's tokens so far: prompt, prefix and the tokens
    sampled before this step); returns the logits to sample from, ``[rows, V]``; ``-inf`` excludes a
    token. The engine applies the temperature and top-p warpers after it and records the log-probs of
    the resulting distribution, so a completion's ``logprobs`` are those of what was sampled."""

    def __call__(self, logits: torch.Tensor, contexts: Sequence[Sequence[int]]) -> torch.Tensor: ...


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. ``temperature == 0`` means greedy decoding. ``logits_transform``: an optional
    :class:`LogitsTransform` applied before temperature and top-p at every decoding step (None: the
    plain distribution). ``on_budget``: an optional callback told, as decoding goes, how many token
    slots of the budget (``max_new_tokens`` per sample) were used up since its last call: every
    sampled token, and a finished sample's unused rest; over a call of ``generate`` the counts add
    up to ``max_new_tokens`` times the number of samples (engines that decode in one opaque call
    report it once at the end). Long evaluations show progress with it (rlbench.eval.evaluate)."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64
    logits_transform: LogitsTransform | None = field(default=None, compare=False)
    on_budget: Callable[[int], None] | None = field(default=None, compare=False)


def check_transform_requests(requests: Sequence["GenerationRequest"], params: SamplingParams) -> None:
    """ValueError when ``params`` carries a logits transform and a request asks for its prefix to be
    scored: the transform applies to sampled tokens only, so a scored prefix would not be scored
    under the distribution its continuation is sampled from."""
    if params.logits_transform is None:
        return
    for i, req in enumerate(requests):
        if req.prefix_ids and req.score_prefix:
            raise ValueError(
                f"request {i}: a logits transform applies to sampled tokens only; it cannot score prefix_ids "
                "(send score_prefix=False)"
            )


@dataclass
class PositionStats:
    """For each position t of a response: the distribution that sampled token t (given the prompt
    and tokens < t), under the run's sampling distribution (temperature and top-p). ``top_tokens`` /
    ``top_probs`` [L, 2]: the most and second most likely tokens and their probabilities; ``entropy``
    [L] in nats; ``vocab_size``: the distribution's support (``entropy / log(vocab_size)`` is the
    normalised entropy in [0, 1])."""

    top_tokens: torch.Tensor
    top_probs: torch.Tensor
    entropy: torch.Tensor
    vocab_size: int


@dataclass(frozen=True)
class GenerationRequest:
    """Sample ``n`` continuations of ``prompt_ids + prefix_ids``.

    ``seed``: the request's own random stream. Its k-th sample draws from a generator seeded with
    :func:`sample_seed` ``(seed, k)``, whatever else is in the call (the evaluation gives each
    problem one, so a benchmark's samples do not depend on the rest of the suite). None: the
    call's ``generator`` (the training rollouts). A call takes all requests with seeds or none.

    ``score_prefix``: False when the caller already holds the prefix's log-probs (a tree node's own
    tokens): the engine skips scoring it and the completion's prefix log-probs are NaN.

    ``adapter``: the role adapter of a per-role LoRA policy that samples it (rlbench.model.lora.role_adapters;
    the whole input, prefix included, runs through it); a per-role policy takes only such requests, any other
    model only None.
    """

    prompt_ids: tuple[int, ...]
    n: int = 1
    prefix_ids: tuple[int, ...] = ()
    seed: int | None = None
    score_prefix: bool = True
    adapter: str | None = None


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

    Behaviour-policy bookkeeping (which policy produced each token; the trainer must never treat a
    token it did not sample from pi_old as if it had, i.e. never a silent ratio 1):

    behaviour:          where the response came from: "policy" (sampled by the policy being trained),
                        or a label of its off-policy source ("teacher", "dataset", "hint", "prefix",
                        "edited", "replay", "draft", ...); logged as a count per label.
    off_policy:         per token of ``response_ids``: 1 where the token was not sampled by the policy
                        whose log-probs are pi_old at the step that trains on it (trace, replayed or
                        edited tokens), 0 where it was. None: decided by ``policy_version`` (a response
                        sampled by an older policy version is off-policy in every token), else all 0.
    behaviour_logprobs: log mu(token) under the policy that produced each token; None: ``logprobs``
                        (the engine's scores of the tokens it sampled). NaN where unknown (a teacher
                        trace without scores); an algorithm that trains on such tokens must say how
                        (rlbench.training.step.behaviour_old_logp refuses them otherwise).
    loss_mask:          per token: 0 for tokens that are context, not actions (tool output, a hint
                        given as a prefix); they are never trained on. None: every token is trained.
    policy_version:     the number of policy updates before the sampling policy's weights were taken;
                        None until the training step stamps it with its current version.

    Step inputs a rollout strategy provides (its ``provides``; rlbench/algorithm/step_inputs.py):

    extras:             input name -> one value per token of ``response_ids`` (a tree's node ids, VinePPO's
                        step index and step values); collate pads each to [B, T] with its entry's pad value
                        (TrainBatch.extras). Empty: the strategy provides none.
    """

    request_index: int
    prompt_ids: tuple[int, ...]
    response_ids: list[int]
    logprobs: list[float]
    finished: bool
    text: str = ""
    prefix_len: int = 0
    behaviour: str = "policy"
    off_policy: list[int] | None = None
    behaviour_logprobs: list[float] | None = None
    loss_mask: list[int] | None = None
    policy_version: int | None = None
    extras: dict[str, list] = field(default_factory=dict)


class RolloutEngine(Protocol):
    def generate(
        self,
        requests: Sequence[GenerationRequest],
        params: SamplingParams,
        generator: torch.Generator | None = None,
    ) -> list[list[Completion]]:
        """Return, for each request, its ``n`` completions in order."""
        ...

    def score_prefixes(
        self, items: Sequence[tuple[tuple[int, ...], tuple[int, ...]]], params: SamplingParams
    ) -> list[list[float]]:
        """Log-probs of each response given its prompt (``items`` = ``(prompt, response)`` pairs) under
        the current policy's sampling distribution of ``params`` (temperature and top-p; temperature 0
        scores at temperature 1). The logits transform, if any, is not applied."""
        ...

    def position_stats(
        self, items: Sequence[tuple[tuple[int, ...], tuple[int, ...]]], params: SamplingParams
    ) -> list[PositionStats]:
        """:class:`PositionStats` of each response given its prompt, under the same distribution as
        :meth:`score_prefixes`."""
        ...

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Make the engine sample (and score) from ``model``'s current weights."""
        ...
