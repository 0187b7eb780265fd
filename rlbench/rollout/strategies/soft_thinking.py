"""SofT-GRPO's soft-thinking rollout (``rollout=soft_thinking``; Zheng et al. 2025, "SofT-GRPO: Surpassing
Discrete-Token LLM Reinforcement Learning via Gumbel-Reparameterized Soft-Thinking Policy Optimization",
arXiv:2511.06411, section 3): each response thinks in up to ``think_tokens`` soft steps, then answers in
discrete tokens.

A soft step feeds the model, instead of a sampled token, the Gumbel-Softmax mixture of the embeddings of
the top-k tokens of its next-token distribution (rlbench/algorithm/soft_thinking.py): with
``y = log pi_k(v) + g_v``, ``g_v ~ Gumbel(0, 1)``, the input is ``sum_v softmax(y / tau_g)_v E_v``. The
response records per soft step the top-k ids, ``y`` and the weights (step inputs ``soft_ids``,
``soft_noisy_logp``, ``soft_weights``), its token id is the top token of the mixture (argmax of ``y``; what
a reader of the response sees), and its log-prob is the step's reparameterised log-likelihood, the Gumbel
log-density of its noise. Thinking ends after ``think_tokens`` steps, or earlier when the top token is the
``end_of_thinking`` marker; the rest of the ``rollout.max_new_tokens`` budget is sampled as discrete
tokens at ``rollout.temperature`` until EOS. The grader sees the answer's text (the discrete tokens), and
the reward toy (``reward=even_tokens``) every token id of the response. The training forward
(rlbench/training/soft_tokens.py) rebuilds the mixtures under the current embeddings and scores the soft
steps by the Gumbel density, so the GRPO advantage and PPO clip apply to both parts.

``think_tokens: 0`` samples exactly what rollout=iid samples (the engine's own decoding). Only the HF
engine runs it: soft inputs need ``inputs_embeds`` at every decoding step, which the vLLM engine does not
take (the authors patch SGLang for it). Evaluation (pass@k) decodes discrete tokens through the engine:
soft thinking is a training-time rollout here.

Configuration (conf/rollout/soft_thinking.yaml):

    strategy: soft_thinking
    soft_thinking:
      think_tokens: 4          # soft steps per response at most
      top_k: 5                 # tokens mixed per soft step
      gumbel_temperature: 0.1  # tau_g
      end_of_thinking: ""      # a one-token marker that ends thinking when it is the top token ("" = budget only)
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from collections.abc import Callable, Sequence
from typing import Any

import torch

from rlbench.algorithm.soft_thinking import (
    SOFT_IDS, SOFT_INPUT_NAMES, SOFT_NOISY_LOGP, SOFT_WEIGHTS, gumbel_softmax_weights, sample_gumbel, soft_token_log_prob, top_k_log_probs,
)
from rlbench.config.schema import RolloutConfig
from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError
from rlbench.rollout.engines.base import Completion, SamplingParams
from rlbench.rollout.engines.hf import _cache_argument, _returned_cache, draw_seed, left_pad, sample_from_logprobs
from rlbench.rollout.engines.scoring import needs_hf_engine
from rlbench.rollout.groups import GradedGroups
from rlbench.rollout.strategy import RolloutSetup, RolloutStrategy, register_strategy, strategy_options


@dataclass(frozen=True)
class SoftThinkingOptions:
    """The ``rollout.soft_thinking`` block."""

    think_tokens: int = 4
    top_k: int = 5
    gumbel_temperature: float = 0.1
    end_of_thinking: str = ""


@dataclass(frozen=True)
class SoftDecoding:
    """What the soft-thinking decoder needs besides the model: the options, the EOS ids, the pad id and
    the end-of-thinking marker's id (None: budget only)."""

    options: SoftThinkingOptions
    eos_ids: tuple[int, ...]
    pad_id: int
    end_of_thinking_id: int | None


@torch.no_grad()
def soft_think_and_answer(
    model: torch.nn.Module,
    prompts: Sequence[tuple[int, ...]],
    params: SamplingParams,
    decoding: SoftDecoding,
    generator: torch.Generator,
) -> list[dict[str, Any]]:
    """One response per prompt of ``prompts``: up to ``think_tokens`` soft steps, then discrete tokens,
    ``params.max_new_tokens`` in all. Each response is a dict with ``ids`` (the soft steps' top tokens, then
    the answer), ``logprobs`` (the soft steps' Gumbel log-densities, then log pi of the answer tokens at
    ``params.temperature``), ``soft_steps``, ``answer`` (the discrete tokens), ``finished`` (the answer
    ended with EOS) and the step inputs (``soft_ids``, ``soft_noisy_logp``, ``soft_weights``: K values per
    token, zeros on the answer's tokens)."""
    opts, device = decoding.options, next(model.parameters()).device
    K, rows = opts.top_k, len(prompts)
    embedding = model.get_input_embeddings()
    input_ids, mask = left_pad(prompts, decoding.pad_id, device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache_argument = _cache_argument(model)
    out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1)
    cache, logits, position = _returned_cache(out), out.logits[:, -1], positions[:, -1]
    responses = [
        {"ids": [], "logprobs": [], "soft_steps": 0, "answer": [], "finished": False,
         SOFT_IDS.name: [], SOFT_NOISY_LOGP.name: [], SOFT_WEIGHTS.name: []}
        for _ in range(rows)
    ]
    thinking = torch.full((rows,), opts.think_tokens > 0, dtype=torch.bool, device=device)
    done = torch.zeros(rows, dtype=torch.bool, device=device)
    zeros = [0.0] * K
    for _ in range(params.max_new_tokens):
        scaled = logits.float() / params.temperature
        ids = scaled.topk(K, dim=-1).indices
        log_pk = top_k_log_probs(scaled, ids)
        noisy = log_pk + sample_gumbel(log_pk.shape, generator, device)
        weights = gumbel_softmax_weights(noisy, opts.gumbel_temperature)
        density = soft_token_log_prob(log_pk, noisy)
        top = ids.gather(-1, noisy.argmax(-1, keepdim=True)).squeeze(-1)
        log_probs = torch.log_softmax(scaled, dim=-1)
        tokens = sample_from_logprobs(log_probs, generator)
        token_logp = log_probs.gather(-1, tokens[:, None]).squeeze(-1)
        soft_inputs = (weights.unsqueeze(-1) * embedding(ids).float()).sum(-2)
        token_inputs = embedding(torch.where(done, decoding.pad_id, tokens)).float()
        next_inputs = torch.where(thinking.unsqueeze(-1), soft_inputs, token_inputs)
        for row in range(rows):
            if done[row]:
                continue
            r = responses[row]
            if thinking[row]:
                r["ids"].append(int(top[row]))
                r["logprobs"].append(float(density[row]))
                r[SOFT_IDS.name].append(ids[row].tolist())
                r[SOFT_NOISY_LOGP.name].append(noisy[row].tolist())
                r[SOFT_WEIGHTS.name].append(weights[row].tolist())
                r["soft_steps"] += 1
                if r["soft_steps"] >= opts.think_tokens or int(top[row]) == decoding.end_of_thinking_id:
                    thinking[row] = False
            else:
                token = int(tokens[row])
                r["ids"].append(token)
                r["answer"].append(token)
                r["logprobs"].append(float(token_logp[row]))
                for name in (SOFT_IDS.name, SOFT_NOISY_LOGP.name, SOFT_WEIGHTS.name):
                    r[name].append([0] * K if name == SOFT_IDS.name else zeros)
                if token in decoding.eos_ids:
                    r["finished"], done[row] = True, True
        if bool(done.all()):
            break
        mask = torch.cat([mask, mask.new_ones((rows, 1))], dim=-1)
        position = position + 1
        out = model(
            inputs_embeds=next_inputs[:, None].to(embedding.weight.dtype), attention_mask=mask,
            position_ids=position[:, None], use_cache=True, logits_to_keep=1, **{cache_argument: cache},
        )
        cache, logits = _returned_cache(out), out.logits[:, -1]
    return responses


@register_strategy("soft_thinking")
class SoftThinking(RolloutStrategy):
    """SofT-GRPO's rollout (module docstring)."""

    provides = frozenset(SOFT_INPUT_NAMES)  # read by the training forward (rlbench/training/soft_tokens.py)

    def __init__(self, setup: RolloutSetup, options: SoftThinkingOptions):
        super().__init__(setup)
        self.options = options
        self._end_of_thinking_id: int | None = None

    @classmethod
    def config_options(cls, rollout: RolloutConfig) -> dict[str, Any]:
        opts = strategy_options(rollout, "soft_thinking", SoftThinkingOptions)
        where = "rollout.soft_thinking"
        if not isinstance(opts.think_tokens, int) or opts.think_tokens < 0:
            raise ConfigError(f"{where}.think_tokens must be an integer >= 0 (0 = rollout=iid), got {opts.think_tokens!r}")
        if not isinstance(opts.top_k, int) or opts.top_k < 2:
            raise ConfigError(
                f"{where}.top_k must be an integer >= 2, got {opts.top_k!r}: a soft step over one token is that token, "
                "and its Gumbel likelihood would not depend on the policy"
            )
        if not opts.gumbel_temperature > 0:
            raise ConfigError(f"{where}.gumbel_temperature (tau_g) must be > 0, got {opts.gumbel_temperature!r}")
        needs_hf_engine(
            "soft_thinking", rollout,
            "feeds soft tokens (mixtures of embeddings) through inputs_embeds at every decoding step, which the vLLM "
            "engine does not take (the authors patch SGLang for it; docs/soft-thinking.md)",
        )
        if opts.think_tokens > 0:
            if opts.think_tokens >= rollout.max_new_tokens:
                raise ConfigError(
                    f"{where}.think_tokens ({opts.think_tokens}) must be below rollout.max_new_tokens "
                    f"({rollout.max_new_tokens}): the answer needs a token at least"
                )
            if not rollout.temperature > 0:
                raise ConfigError(f"rollout=soft_thinking samples its thinking: rollout.temperature must be > 0, got {rollout.temperature}")
            if rollout.top_p < 1.0:
                raise ConfigError(
                    f"rollout=soft_thinking restricts each soft step to its top-k tokens ({where}.top_k); "
                    f"rollout.top_p must be 1, got {rollout.top_p}"
                )
        return {"options": opts}

    def _decoding(self) -> SoftDecoding:
        engine = self.setup.sampler.engine
        marker = self.options.end_of_thinking
        if marker and self._end_of_thinking_id is None:
            ids = engine.tokenizer.encode(marker, add_special_tokens=False)
            if len(ids) != 1:
                raise ConfigError(
                    f"rollout.soft_thinking.end_of_thinking={marker!r} is {len(ids)} tokens for this tokenizer; it must be one"
                )
            self._end_of_thinking_id = int(ids[0])
        return SoftDecoding(self.options, tuple(engine.eos_ids), int(engine.pad_id), self._end_of_thinking_id)

    def rollout(
        self, problems: list[Problem], draw_prompts: Callable[[int], list[Problem]] | None = None
    ) -> tuple[GradedGroups, dict[str, float]]:
        setup = self.setup
        if self.options.think_tokens == 0:  # discrete only: the engine's own sampling, as rollout=iid
            return setup.sample(problems), {}
        sampler, engine = setup.sampler, setup.sampler.engine
        started = time.perf_counter()
        prompts = sampler.encode(problems)
        generator = torch.Generator(device=engine.device).manual_seed(draw_seed(setup.generator))
        model, was_training = engine.model, engine.model.training
        model.eval()
        try:
            rows = [(i, k) for i in range(len(problems)) for k in range(setup.n)]
            responses = []
            for start in range(0, len(rows), engine.batch_size):
                chunk = rows[start : start + engine.batch_size]
                responses += soft_think_and_answer(model, [prompts[i] for i, _ in chunk], setup.params, self._decoding(), generator)
        finally:
            model.train(was_training)
        groups: list[list[Completion]] = [[] for _ in problems]
        for (i, _), r in zip(rows, responses):
            groups[i].append(Completion(
                request_index=i, prompt_ids=tuple(prompts[i]), response_ids=r["ids"], logprobs=r["logprobs"],
                finished=r["finished"], text=engine.tokenizer.decode(r["answer"], skip_special_tokens=True),
                extras={name: r[name] for name in (SOFT_IDS.name, SOFT_NOISY_LOGP.name, SOFT_WEIGHTS.name)},
            ))
        sampler.cost.add(groups, time.perf_counter() - started)
        graded = sampler.grade(problems, groups, setup.params.max_new_tokens)
        steps = torch.tensor([float(r["soft_steps"]) for r in responses])
        top_weight = [max(w) for r in responses for w in r[SOFT_WEIGHTS.name][: r["soft_steps"]]]
        return graded, {
            "soft_thinking_steps": float(steps.mean()),
            "soft_weight_top_mean": float(sum(top_weight) / len(top_weight)) if top_weight else 0.0,
        }
