"""Rollout engine on Hugging Face ``model.generate`` (CPU and GPU).

How it works:

* every request is expanded into ``n`` rows whose input is ``prompt_ids + prefix_ids``; rows are
  sorted by input length and generated in batches of at most ``batch_size`` sequences, left
  padded;
* the sampling distribution is defined by ``temperature`` and ``top_p`` alone: the engine runs
  ``generate`` under a clean generation config (greedy selection, no repetition penalty, no
  n-gram blocking, ...) with the model's own ``generation_config`` swapped out meanwhile, so
  that a checkpoint's ``generation_config.json`` defaults (e.g. Qwen's ``top_k=20``,
  ``repetition_penalty=1.05``) cannot alter it;
* the next token is chosen inside ``generate`` by the last logits processor
  (``_TokenSampler``): transformers' own ``TemperatureLogitsWarper`` and ``TopPLogitsWarper``
  run first, then the sampler draws from ``log_softmax`` of the warped scores (inverse CDF,
  about 10x faster on CPU than ``generate``'s ``torch.multinomial`` for a 49k vocabulary),
  records the chosen token's log-prob and masks every other token, so ``generate`` (run in
  greedy mode) takes it. The log-probs are therefore exactly those of the distribution sampled
  from, with ``O(batch x vocab)`` memory per step, where ``output_scores=True`` would keep
  ``steps x batch x vocab`` floats (40 GB for 64 x 1024 tokens of a 152k vocabulary);
* greedy decoding (``temperature == 0``) reports ``log_softmax(logits)`` at temperature 1;
* prefix tokens are scored with one forward pass per batch of requests under the same
  temperature / top-p warping;
* sampling is a function of the passed ``torch.Generator``: a seed is drawn from it, seeds the
  sampler's own generator, and ``generate`` runs inside ``torch.random.fork_rng()`` seeded with
  it too, so the global RNG state is left untouched and the same generator state gives the same
  completions (given the same batch composition and device); requests that carry their own
  ``seed`` (the evaluation's) instead draw each sample's tokens from a generator of its own,
  seeded with ``sample_seed(seed, k)``, so that a sample does not depend on the other requests of
  the call (up to the float effects of padding in a differently composed batch).
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch

from rlbench.utils import Progress
from rlbench.rollout.base import Completion, GenerationRequest, SamplingParams, request_seeds, sample_seed

log = logging.getLogger(__name__)


def sample_from_logprobs(
    logprobs: torch.Tensor, generator: torch.Generator | Sequence[torch.Generator] | None = None
) -> torch.Tensor:
    """One token per row of ``logprobs`` (``[B, V]``, normalised, ``-inf`` = excluded), drawn by
    inverse-CDF sampling with ``generator`` (or one generator per row).

    Equivalent to ``torch.multinomial(logprobs.exp(), 1)`` in distribution but about ten times
    faster on CPU for large vocabularies; the CDF is accumulated in float64 so that tail tokens
    keep their probability next to a dominant token.
    """
    # convert, then accumulate: the same float64 sums as ``cumsum(dtype=torch.float64)``, several times
    # faster on CPU (the converting cumsum takes a slow path)
    cdf = logprobs.exp().double().cumsum(-1)
    if isinstance(generator, (list, tuple)):
        u = torch.cat([torch.rand((1, 1), generator=g, device=cdf.device, dtype=torch.float64) for g in generator])
    else:
        u = torch.rand((cdf.shape[0], 1), generator=generator, device=cdf.device, dtype=torch.float64)
    tokens = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(-1)
    tokens = tokens.clamp_(max=cdf.shape[-1] - 1)
    # guard against float rounding landing on an excluded token
    bad = ~torch.isfinite(logprobs.gather(-1, tokens[:, None]).squeeze(-1))
    if bad.any():
        tokens = torch.where(bad, logprobs.argmax(-1), tokens)
    return tokens


class _TokenSampler:
    """The last logits processor: picks the next token itself and records its log-prob.

    It receives the scores after temperature / top-p warping (transformers' own warpers, placed
    before it), samples from ``log_softmax(scores)`` (:func:`sample_from_logprobs`; the argmax
    when ``greedy``), records the log-prob of the chosen token and returns scores that are
    ``-inf`` everywhere else, so that ``generate``'s greedy selection takes exactly that token.
    This replaces ``generate``'s ``torch.multinomial`` (slow on CPU) and its
    ``output_scores=True`` (which keeps ``steps x batch x vocab`` floats) with ``O(batch x vocab)``
    work and memory per step.
    """

    def __init__(self, greedy: bool, generator: torch.Generator | Sequence[torch.Generator] | None) -> None:
        self.greedy = greedy
        self.generator = generator
        self.logprobs: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        logp = torch.log_softmax(scores.float(), dim=-1)
        tokens = logp.argmax(-1) if self.greedy else sample_from_logprobs(logp, self.generator)
        self.logprobs.append(logp.gather(-1, tokens[:, None]).squeeze(-1))
        # ``scores`` is generate's private copy of the logits: overwrite it in place
        return scores.fill_(float("-inf")).scatter_(-1, tokens[:, None], 0.0)

    def finish(self, new_tokens: torch.Tensor) -> torch.Tensor:
        """``[B, T]`` log-probs of the generated tokens ``new_tokens`` (``[B, T]``); steps that
        ``generate`` ran and then undid (deferred stop checks) are dropped."""
        steps = new_tokens.shape[1]
        if len(self.logprobs) < steps:
            raise RuntimeError(f"recorded {len(self.logprobs)} log-prob steps for {steps} generated tokens")
        if steps == 0:
            return new_tokens.new_zeros(new_tokens.shape, dtype=torch.float32)
        return torch.stack(self.logprobs[:steps], dim=1)


def _warpers(params: SamplingParams) -> list:
    """transformers' warpers for ``params`` (the ones ``generate`` would build itself)."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

    out: list = []
    if params.temperature > 0:
        if params.temperature != 1.0:
            out.append(TemperatureLogitsWarper(float(params.temperature)))
        if params.top_p < 1.0:
            out.append(TopPLogitsWarper(float(params.top_p)))
    return out


def _check_params(params: SamplingParams) -> None:
    if params.temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {params.temperature}")
    if not 0.0 < params.top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {params.top_p}")
    if params.max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {params.max_new_tokens}")


def draw_seed(generator: torch.Generator | None) -> int:
    """A 62-bit seed drawn from ``generator`` (from the global torch RNG when ``None``)."""
    if generator is None:
        return int(torch.randint(0, 2**62, (1,)).item())
    return int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device).item())


def left_pad(seqs: Sequence[Sequence[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists into ``(input_ids, attention_mask)`` tensors."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, width - len(s) :] = torch.tensor(list(s), dtype=torch.long)
            mask[i, width - len(s) :] = 1
    return ids.to(device), mask.to(device)


class HFGenerateEngine:
    """:class:`~rlbench.rollout.base.RolloutEngine` on ``model.generate``.

    ``batch_size`` is the number of sequences (rows) per ``generate`` call. The engine samples
    from the model object it holds; :meth:`sync_weights` swaps that object.
    """

    def __init__(self, model, tokenizer, *, batch_size: int = 64, device=None, progress: bool = True):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = int(batch_size)
        self._device = torch.device(device) if device is not None else None
        self.progress = progress
        # FSDP: every forward is collective, so generate runs until every rank's sequences ended
        # (transformers' synced_gpus); set by rlbench.training.step.make_step_context.
        self.synced_gpus = False
        self.eos_ids = self._eos_ids(model, tokenizer)
        if not self.eos_ids:
            raise ValueError("neither the tokenizer nor the model's generation_config defines an EOS token")
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad) if pad is not None else self.eos_ids[0]

    # ---------------------------------------------------------------- helpers

    @staticmethod
    def _eos_ids(model, tokenizer) -> list[int]:
        ids: list[int] = []
        for value in (tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id", None)):
            if value is None:
                continue
            for v in value if isinstance(value, (list, tuple)) else [value]:
                if int(v) not in ids:
                    ids.append(int(v))
        return ids

    @property
    def device(self) -> torch.device:
        """Where inputs go: the ``device`` argument, else the model's parameters' device."""
        if self._device is not None:
            return self._device
        return next(self.model.parameters()).device

    def _generation_config(self, params: SamplingParams):
        """A generation config under which ``generate`` changes nothing in the scores: greedy
        selection of the token ``_TokenSampler`` picked (the warpers for temperature and top-p
        are passed as logits processors, see the module docstring)."""
        from transformers import GenerationConfig

        return GenerationConfig(
            do_sample=False,  # _TokenSampler samples; generate takes its choice greedily
            # greedy mode: generate adds no temperature / top-k / top-p / min-p / typical-p /
            # epsilon / eta warpers whatever their values; the processors below stay neutral
            repetition_penalty=1.0,
            encoder_repetition_penalty=1.0,
            no_repeat_ngram_size=0,
            encoder_no_repeat_ngram_size=0,
            length_penalty=1.0,
            min_length=0,
            num_beams=1,
            num_return_sequences=1,
            max_new_tokens=int(params.max_new_tokens),
            eos_token_id=list(self.eos_ids),
            pad_token_id=self.pad_id,
            bos_token_id=getattr(self.model.generation_config, "bos_token_id", None),
            output_scores=False,
            return_dict_in_generate=False,
            use_cache=True,
            renormalize_logits=False,
            remove_invalid_values=False,
        )

    def _run_generate(
        self, seqs: list[tuple[int, ...]], params: SamplingParams, generator: torch.Generator | Sequence[torch.Generator] | None
    ):
        """Generate for one batch of input rows (one generator, or one per row); returns
        ``(new_tokens [B, T], logprobs [B, T])`` (on CPU)."""
        from transformers import GenerationConfig, LogitsProcessorList

        input_ids, mask = left_pad(seqs, self.pad_id, self.device)
        sampler = _TokenSampler(greedy=params.temperature == 0, generator=generator)
        processors = LogitsProcessorList([*_warpers(params), sampler])
        # The model's own generation_config fills every field left None in ours (e.g. min_p,
        # bad_words_ids, suppress_tokens of a checkpoint); swap in a neutral one meanwhile.
        saved = self.model.generation_config
        self.model.generation_config = GenerationConfig(
            bos_token_id=getattr(saved, "bos_token_id", None),
            eos_token_id=list(self.eos_ids),
            pad_token_id=self.pad_id,
        )
        try:
            out = self.model.generate(
                input_ids=input_ids,
                attention_mask=mask,
                generation_config=self._generation_config(params),
                logits_processor=processors,
                **({"synced_gpus": True} if self.synced_gpus else {}),
            )
        finally:
            self.model.generation_config = saved
        sequences = out if isinstance(out, torch.Tensor) else out.sequences
        new = sequences[:, input_ids.shape[1] :]
        return new.cpu(), sampler.finish(new).cpu()

    def score_prefixes(
        self, items: Sequence[tuple[tuple[int, ...], tuple[int, ...]]], params: SamplingParams
    ) -> list[list[float]]:
        """Log-probs of each ``prefix`` given its ``prompt`` (``items`` = ``(prompt, prefix)``
        pairs) under the sampling distribution of ``params`` (temperature and top-p warping;
        temperature 0 scores at temperature 1). One forward pass per batch."""
        if any(len(p) == 0 for p, _ in items):
            raise ValueError("prefix scoring needs a non-empty prompt")
        warpers = _warpers(params)
        results: list[list[float]] = []
        for start in range(0, len(items), self.batch_size):
            chunk = items[start : start + self.batch_size]
            seqs = [tuple(p) + tuple(x) for p, x in chunk]
            input_ids, mask = left_pad(seqs, self.pad_id, self.device)
            position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
            # only the last ``keep`` positions' logits are needed (not ``B x L x vocab``)
            keep = max(len(x) for _, x in chunk) + 1
            logits = self.model(
                input_ids=input_ids, attention_mask=mask, position_ids=position_ids, logits_to_keep=keep
            ).logits[:, -keep:]
            width = keep
            for row, (prompt, prefix) in enumerate(chunk):
                if not prefix:
                    results.append([])
                    continue
                # logits at position j predict token j + 1; the prefix occupies the last len(prefix)
                lo, hi = width - len(prefix) - 1, width - 1
                scores = logits[row, lo:hi].float()
                targets = input_ids[row, input_ids.shape[1] - len(prefix) :]
                for w in warpers:
                    scores = w(targets[None], scores)
                lp = torch.log_softmax(scores, dim=-1).gather(-1, targets[:, None]).squeeze(-1)
                results.append(lp.cpu().tolist())
        return results

    # ---------------------------------------------------------------- RolloutEngine

    def generate(
        self,
        requests: Sequence[GenerationRequest],
        params: SamplingParams,
        generator: torch.Generator | None = None,
    ) -> list[list[Completion]]:
        """Return, for each request, its ``n`` completions in order (see the module docstring)."""
        _check_params(params)
        for i, req in enumerate(requests):
            if req.n < 0:
                raise ValueError(f"request {i}: n must be >= 0, got {req.n}")
            if len(req.prompt_ids) == 0:
                raise ValueError(f"request {i}: prompt_ids is empty")
        rows = [(i, k) for i, req in enumerate(requests) for k in range(req.n)]
        results: list[list[Completion | None]] = [[None] * req.n for req in requests]
        if not rows:
            return [[] for _ in requests]
        own_seeds = request_seeds(requests)
        seed = sample_seed(requests[0].seed, 0) if own_seeds else draw_seed(generator)

        model = self.model
        was_training = model.training
        model.eval()
        fork_devices = [self.device] if self.device.type == "cuda" else []
        try:
            # FSDP's all-gathered weights are reused by the training forwards: no inference tensors then
            no_grad = torch.no_grad() if self.synced_gpus else torch.inference_mode()
            with no_grad, torch.random.fork_rng(devices=fork_devices):
                torch.manual_seed(seed)
                sample_gen = torch.Generator(device=self.device)
                sample_gen.manual_seed(seed)
                with_prefix = [i for i, req in enumerate(requests) if req.prefix_ids and req.n > 0]
                prefix_lp = dict(
                    zip(
                        with_prefix,
                        self.score_prefixes(
                            [(tuple(requests[i].prompt_ids), tuple(requests[i].prefix_ids)) for i in with_prefix],
                            params,
                        ),
                    )
                )
                order = sorted(
                    rows, key=lambda r: -(len(requests[r[0]].prompt_ids) + len(requests[r[0]].prefix_ids))
                )
                progress = Progress("rollout", len(order), min_interval=2.0, enabled=self.progress and len(order) > self.batch_size)
                for start in range(0, len(order), self.batch_size):
                    batch = order[start : start + self.batch_size]
                    seqs = [tuple(requests[i].prompt_ids) + tuple(requests[i].prefix_ids) for i, _ in batch]
                    if params.max_new_tokens > 0:
                        gens = (
                            [torch.Generator(device=self.device).manual_seed(sample_seed(requests[i].seed, k)) for i, k in batch]
                            if own_seeds
                            else sample_gen
                        )
                        new, lps = self._run_generate(seqs, params, gens)
                    else:
                        new = torch.zeros((len(batch), 0), dtype=torch.long)
                        lps = torch.zeros((len(batch), 0))
                    for row, (i, k) in enumerate(batch):
                        results[i][k] = self._make_completion(i, requests[i], new[row], lps[row], prefix_lp.get(i, []))
                    progress.update(len(batch))
        finally:
            model.train(was_training)
        return results  # type: ignore[return-value]

    def _make_completion(self, index, req, new: torch.Tensor, lps: torch.Tensor, prefix_lp) -> Completion:
        tokens = new.tolist()
        logprobs = lps.tolist()
        finished = False
        eos = set(self.eos_ids)
        for j, t in enumerate(tokens):
            if t in eos:
                tokens, logprobs, finished = tokens[: j + 1], logprobs[: j + 1], True
                break
        response = list(req.prefix_ids) + tokens
        return Completion(
            request_index=index,
            prompt_ids=tuple(req.prompt_ids),
            response_ids=response,
            logprobs=[float(x) for x in prefix_lp] + [float(x) for x in logprobs],
            finished=finished,
            text=self.tokenizer.decode(response, skip_special_tokens=True),
            prefix_len=len(req.prefix_ids),
        )

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Sample from ``model`` from now on (the engine holds the object itself, no copy)."""
        self.model = model
