"""NLPO's action mask (``rollout=masked``; Ramamurthy et al. 2023, "Is Reinforcement Learning (Not) for
Natural Language Processing: Benchmarks, Baselines, and Building Blocks for Natural Language Policy
Optimization", arXiv:2210.01241, section 4 and Algorithm 1).

A *masking policy* pi_psi, a delayed copy of the policy, restricts each step's vocabulary to its top-p
set

    V_t = the smallest set of most likely tokens under pi_psi(. | s_t) whose mass reaches p

and the policy samples from, and is trained on, its own distribution renormalised on V_t:

    pi_theta^mask(a | s_t) = pi_theta(a | s_t) / pi_theta(V_t | s_t)   for a in V_t, 0 outside.

pi_psi <- pi_theta every ``update_interval`` (mu) rollouts, the first before the first rollout; the copy
is the strategy's state (``state_dict``: its weights and the rollout count), so a resumed run
continues with the same masking policy.

Sampling: the HF engine's logits transform (rlbench/rollout/engines/base.py ``LogitsTransform``) sets the
logits outside V_t to -inf before temperature and top-p, so every sampled token lies in V_t and the
recorded log-probs are those of the masked distribution (the mask is applied after the temperature in
effect: -inf stays -inf). Training: the strategy's :meth:`MaskedRollout.training_logits_transform` is
applied to every forward of the step (rlbench.training.forward.training_logits_transform), with the
mask recomputed by one no-grad forward of pi_psi over the batch, so pi_old, pi_theta (and the
reference, when a KL term reads it) are the masked distributions and the ratio compares what was
sampled. The sampled token is always kept in the training mask: the batched forward can round a
token at the edge of V_t differently from the decoding step's forward, and a sampled token must
never get probability 0.

With ``top_p = 1`` the mask is every token and the strategy samples exactly what rollout=iid samples.

Cost: the decoding transform runs pi_psi alongside the policy, one token per row and step on a KV cache
of its own (:class:`MaskedSampling`); the training mask is one extra forward per micro-batch and pass. The copy holds a second set of weights.

Engines: only the HF engine runs it; rollout.engine=vllm is refused before the model loads. vLLM's
logits processors (rlbench/rollout/engines/vllm_logits.py) would call :class:`MaskedSampling` at each step, but
pi_psi's forward would then run inside vLLM's sampler on an HF KV cache that continues only when every
row of a call extends the previous call's rows by one token; vLLM's batch gains and loses requests at
most steps (continuous batching, chunked prefills), so pi_psi would re-prefill every running context
at those steps. What it would take is in docs/rollout-sampling.md ("NLPO on vLLM").

Configuration (conf/rollout/masked.yaml):

    strategy: masked
    masked:
      top_p: 0.9            # p of the mask
      update_interval: 5    # mu: rollouts between copies of the policy into the masking policy
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from rlbench.config.schema import RolloutConfig
from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError
from rlbench.rollout.engines.hf import _cache_argument, _returned_cache, left_pad
from rlbench.rollout.engines.scoring import needs_hf_engine
from rlbench.rollout.groups import GradedGroups
from rlbench.rollout.strategy import (
    RolloutSetup,
    RolloutStrategy,
    register_strategy,
    strategy_options,
)

TOP_K_START = 64  # the first k top_p_mask reads


@dataclass(frozen=True)
class MaskedOptions:
    """The ``rollout.masked`` block."""

    top_p: float = 0.9
    update_interval: int = 5


def top_p_mask(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Boolean ``[..., V]``: the smallest set of most likely tokens of ``softmax(logits)`` whose mass
    reaches ``top_p`` (a token is in it when the tokens more likely than it hold less than ``top_p``);
    every token when ``top_p >= 1``.

    The set is read off the ``k`` most likely tokens, ``k`` growing by 4x until every row's top ``k``
    hold ``top_p`` (a full sort of a 49k vocabulary per step costs ~100x more on CPU than a top-64)."""
    if top_p >= 1.0:
        return torch.ones_like(logits, dtype=torch.bool)
    probs = torch.softmax(logits.float(), dim=-1)
    rows = probs.reshape(-1, probs.shape[-1])
    vocab = rows.shape[-1]
    k = min(vocab, TOP_K_START)
    while True:
        top, order = rows.topk(k, dim=-1)  # sorted, most likely first
        cumulative = top.cumsum(-1)
        if k == vocab or bool((cumulative[:, -1] >= top_p).all()):  # every token past rank k is out
            break
        k = min(vocab, 4 * k)
    inside = (cumulative - top) < top_p  # the mass ranked above each token
    return torch.zeros_like(rows, dtype=torch.bool).scatter(-1, order, inside).reshape(probs.shape)


def apply_mask(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """``logits`` with the tokens outside ``allowed`` set to -inf (a log-softmax renormalises on the rest)."""
    return logits.masked_fill(~allowed, float("-inf"))


class MaskedSampling:
    """The engine's logits transform: pi_psi's top-p set of each running row's context, everything else
    -inf. Counts the allowed tokens per step.

    pi_psi keeps a KV cache of its own: when every context of a call is a context of the previous call
    plus one token (the decoding loop's next step, rows that finished dropped), pi_psi runs on the new
    tokens only, its cache rows gathered from the previous call's; otherwise (a new batch of the engine)
    it runs over the left-padded contexts."""

    def __init__(self, masking_policy: torch.nn.Module, top_p: float, pad_id: int):
        self.masking_policy, self.top_p, self.pad_id = masking_policy, top_p, pad_id
        self.allowed_counts: list[torch.Tensor] = []
        self._contexts: dict[tuple[int, ...], int] = {}  # the previous call's contexts -> their cache row
        self._cache, self._mask, self._position = None, None, None

    def _rows_continued(self, contexts: list[tuple[int, ...]]) -> list[int] | None:
        """For each context, the previous call's row it continues by one token; None if one does not."""
        rows = [self._contexts.get(c[:-1]) for c in contexts]
        return None if any(r is None for r in rows) else rows  # type: ignore[return-value]

    def _psi_logits(self, contexts: list[tuple[int, ...]], device) -> torch.Tensor:
        policy, cache_kw = self.masking_policy, _cache_argument(self.masking_policy)
        rows = self._rows_continued(contexts) if self._cache is not None else None
        if rows is None:
            input_ids, mask = left_pad(contexts, self.pad_id, device)
            position = (mask.cumsum(-1) - 1).clamp(min=0)
            out = policy(input_ids=input_ids, attention_mask=mask, position_ids=position, use_cache=True, logits_to_keep=1)
            position = position[:, -1]
        else:
            index = torch.tensor(rows, dtype=torch.long, device=device)
            self._cache.reorder_cache(index)
            mask = torch.cat([self._mask.index_select(0, index), self._mask.new_ones((len(rows), 1))], dim=-1)
            position = self._position.index_select(0, index) + 1
            last = torch.tensor([c[-1] for c in contexts], dtype=torch.long, device=device)
            out = policy(
                input_ids=last[:, None], attention_mask=mask, position_ids=position[:, None], use_cache=True,
                logits_to_keep=1, **{cache_kw: self._cache},
            )
        self._cache, self._mask, self._position = _returned_cache(out), mask, position
        self._contexts = {c: i for i, c in enumerate(contexts)}
        return out.logits[:, -1]

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, contexts: Sequence[Sequence[int]]) -> torch.Tensor:
        allowed = top_p_mask(self._psi_logits([tuple(c) for c in contexts], logits.device), self.top_p)
        self.allowed_counts.append(allowed.sum(-1).cpu())
        return apply_mask(logits, allowed)


@register_strategy("masked")
class MaskedRollout(RolloutStrategy):
    """i.i.d. groups sampled from the policy renormalised on the masking policy's top-p sets (module
    docstring)."""

    def __init__(self, setup: RolloutSetup, top_p: float, update_interval: int):
        self.setup, self.top_p, self.update_interval = setup, top_p, update_interval
        self.rollouts = 0  # rollouts so far; the copy is refreshed before rollout k when k % mu == 0
        self.masking_policy: torch.nn.Module | None = None

    @classmethod
    def config_options(cls, rollout: RolloutConfig) -> dict:
        options = strategy_options(rollout, "masked", MaskedOptions)
        top_p = float(options.top_p)
        if not (math.isfinite(top_p) and 0.0 < top_p <= 1.0):
            raise ConfigError(f"rollout.masked.top_p is the mask's probability mass, in (0, 1]; got {options.top_p} (NLPO uses 0.9)")
        interval = options.update_interval
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ConfigError(
                f"rollout.masked.update_interval (mu, rollouts between copies of the policy into the masking policy) "
                f"must be an integer >= 1, got {interval!r}"
            )
        needs_hf_engine(
            "masked", rollout,
            "needs the masking policy pi_psi's logits at every decoding step: on rollout.engine=vllm that is a second "
            "model's forward pass inside vLLM's sampler, whose own KV cache vLLM's continuously changing batch would "
            "force to re-prefill every row at most steps (docs/rollout-sampling.md, 'NLPO on vLLM'), so only the HF engine runs it",
        )
        return {"top_p": top_p, "update_interval": int(interval)}

    @property
    def policy(self) -> torch.nn.Module:
        """The model the engine samples from (the policy being trained)."""
        return self.setup.sampler.engine.model

    def refresh_masking_policy(self) -> None:
        """pi_psi <- pi_theta (a frozen copy of the current weights)."""
        if self.masking_policy is None:
            self.masking_policy = copy.deepcopy(self.policy).eval().requires_grad_(False)
        else:
            self.masking_policy.load_state_dict(self.policy.state_dict())

    def rollout(
        self, problems: list[Problem], draw_prompts: Callable[[int], list[Problem]] | None = None
    ) -> tuple[GradedGroups, dict[str, float]]:
        if self.rollouts % self.update_interval == 0 or self.masking_policy is None:
            self.refresh_masking_policy()
        self.rollouts += 1
        setup = self.setup
        transform = MaskedSampling(self.masking_policy, self.top_p, setup.sampler.engine.pad_id)
        params = dataclasses.replace(setup.params, logits_transform=transform)
        groups = setup.sampler(problems, setup.n, params, setup.generator)
        metrics = {"masked_policy_age": float((self.rollouts - 1) % self.update_interval)}
        if transform.allowed_counts:
            metrics["masked_allowed_tokens"] = float(torch.cat(transform.allowed_counts).double().mean())
        return groups, metrics

    def training_logits_transform(self) -> Callable[[torch.Tensor, Any], torch.Tensor] | None:
        """``(logits [B, T, V], batch) -> logits`` masked to pi_psi's top-p sets along the batch's
        responses, the sampled tokens always kept (module docstring); None before the first rollout."""
        if self.masking_policy is None:
            return None
        masking_policy, top_p = self.masking_policy, self.top_p

        def transform(logits: torch.Tensor, batch: Any) -> torch.Tensor:
            """``batch``: a rlbench.training.batch.TrainBatch (left-padded prompts, then the responses)."""
            T = logits.shape[1]
            with torch.no_grad():
                mask = batch.attention_mask
                psi_logits = masking_policy(
                    input_ids=batch.input_ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                    logits_to_keep=T + 1, use_cache=False,
                ).logits[:, -(T + 1) : -1]  # position t predicts response token t
                allowed = top_p_mask(psi_logits, top_p)
                targets = batch.input_ids[:, batch.prompt_width : batch.prompt_width + T]
                allowed.scatter_(-1, targets.unsqueeze(-1), True)
            return apply_mask(logits, allowed)

        return transform

    def state_dict(self) -> dict[str, Any]:
        weights = None
        if self.masking_policy is not None:
            weights = {k: v.detach().clone() for k, v in self.masking_policy.state_dict().items()}
        return {"rollouts": self.rollouts, "masking_policy": weights}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rollouts = int(state["rollouts"])
        if state["masking_policy"] is None:
            self.masking_policy = None
            return
        if self.masking_policy is None:
            self.masking_policy = copy.deepcopy(self.policy).eval().requires_grad_(False)
        self.masking_policy.load_state_dict(state["masking_policy"])
