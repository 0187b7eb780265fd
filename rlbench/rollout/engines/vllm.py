"""Rollout engine on vLLM (GPU only).

Version assumption: vLLM >= 0.10.2 (V1 engine), for

* ``LLM(..., logprobs_mode="processed_logprobs")``: returned log-probs are those of the
  distribution actually sampled from (after temperature and top-p), as the
  :class:`~rlbench.rollout.engines.base.Completion` contract requires (the default ``raw_logprobs`` would
  report the untempered model distribution; older versions without the option fall back to it
  with a warning);
* ``LLM.apply_model`` + ``LLM.reset_prefix_cache`` for :meth:`VLLMEngine.sync_weights`, with the
  engine core running in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set before vLLM is
  imported) so the model object can be reached without pickling the weights;
* ``generation_config="vllm"`` so the checkpoint's ``generation_config.json`` defaults (top-k,
  repetition penalty) do not alter sampling.

* ``LLM(logits_processors=[...])`` (V1 custom logits processors) for ``SamplingParams.logits_transform``
  (rlbench/rollout/engines/vllm_logits.py); a vLLM without them refuses a transform at generation.

Each request is expanded into ``n`` vLLM requests with ``n=1`` and their own seed drawn from the
passed ``torch.Generator`` (reproducible, and no reliance on how vLLM seeds ``n > 1`` fan-out);
prefix caching makes the shared prompts cheap.

Scoring (:meth:`VLLMEngine.score_prefixes`, :meth:`VLLMEngine.position_stats`, and the prefix tokens
of requests with ``prefix_ids``) runs on the Hugging Face policy model, the same code as
:class:`HFGenerateEngine` (``sync_weights`` keeps it in step: it is the trained model itself). Its
numerics are the trainer's, not vLLM's kernels': a token vLLM sampled is scored by the HF model
within bf16 noise of vLLM's own log-prob (rollout=speculative compares the two; docs/engines.md).

The pure conversion logic (:func:`requests_to_vllm_inputs`, :func:`vllm_sampling_kwargs`,
:func:`vllm_outputs_to_completions`) has no vLLM dependency and is tested on CPU.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from rlbench.rollout.engines.base import (
    Completion, GenerationRequest, PositionStats, SamplingParams, check_transform_requests, request_seeds, sample_seed,
)
from rlbench.model.lora import engine_weights
from rlbench.rollout.engines.hf import HFGenerateEngine
import rlbench.rollout.engines.vllm_logits as vllm_logits

log = logging.getLogger(__name__)


def requests_to_vllm_inputs(requests: Sequence[GenerationRequest]) -> tuple[list[dict], list[int]]:
    """Expand requests into one vLLM ``TokensPrompt`` (a dict ``{"prompt_token_ids": [...]}``)
    per completion: ``prompt_ids + prefix_ids``, repeated ``n`` times.

    Returns ``(prompts, row_to_request)`` where ``row_to_request[j]`` is the request index of
    ``prompts[j]``; rows of one request are consecutive and in order.
    """
    prompts: list[dict] = []
    rows: list[int] = []
    for i, req in enumerate(requests):
        ids = [int(t) for t in req.prompt_ids] + [int(t) for t in req.prefix_ids]
        for _ in range(req.n):
            prompts.append({"prompt_token_ids": list(ids)})
            rows.append(i)
    return prompts, rows


def vllm_sampling_kwargs(params: SamplingParams, seed: int | None, transform_key: int | None = None) -> dict[str, Any]:
    """Keyword arguments for ``vllm.SamplingParams`` of one completion: ``n=1``, temperature,
    top-p, ``max_tokens``, the sampled token's log-prob (``logprobs=0``) and a seed; every other
    sampling modifier is explicitly neutral. ``transform_key``: the registered logits transform the
    request's rows go through (rlbench/rollout/engines/vllm_logits.py)."""
    extra = {} if transform_key is None else {"extra_args": {vllm_logits.EXTRA_ARG: int(transform_key)}}
    return {
        "n": 1,
        "temperature": float(params.temperature),
        "top_p": float(params.top_p),
        "top_k": -1,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "max_tokens": int(params.max_new_tokens),
        "logprobs": 0,
        "seed": seed,
        "skip_special_tokens": True,
        **extra,
    }


def _logprob_value(entry: Any) -> float:
    """``Logprob(logprob=...)`` object or a bare float."""
    return float(getattr(entry, "logprob", entry))


def vllm_outputs_to_completions(
    requests: Sequence[GenerationRequest],
    outputs: Sequence[Any],
    row_to_request: Sequence[int],
    *,
    prefix_logprobs: dict[int, list[float]] | None = None,
    decode: Callable[[list[int]], str] | None = None,
    eos_ids: Sequence[int] = (),
) -> list[list[Completion]]:
    """Turn vLLM ``RequestOutput`` objects into completions grouped per request.

    ``outputs[j]`` (one per row from :func:`requests_to_vllm_inputs`) holds ``.outputs``, a list
    of ``CompletionOutput``-like objects with ``token_ids``, ``logprobs`` (a list with one
    ``{token_id: Logprob}`` dict per generated token), ``finish_reason`` (``"stop"`` at EOS,
    ``"length"`` at ``max_tokens``) and ``text``. The prefix (if any) is prepended to
    ``response_ids``, with ``prefix_logprobs[request_index]`` as its log-probs. ``decode`` turns
    the whole response into ``text`` (default: the prefix-less ``output.text``). A response is
    cut after its first token in ``eos_ids`` (normally vLLM already stopped there).
    """
    if len(outputs) != len(row_to_request):
        raise ValueError(f"{len(outputs)} vLLM outputs for {len(row_to_request)} rows")
    prefix_logprobs = prefix_logprobs or {}
    eos = {int(t) for t in eos_ids}
    result: list[list[Completion]] = [[] for _ in requests]
    for out, i in zip(outputs, row_to_request):
        req = requests[i]
        for comp in out.outputs:
            tokens = [int(t) for t in comp.token_ids]
            if comp.logprobs is None:
                raise ValueError("vLLM output has no logprobs; sample with logprobs=0")
            lps = [_logprob_value(d[t]) for t, d in zip(tokens, comp.logprobs)]
            if len(lps) != len(tokens):
                raise ValueError(f"vLLM output has {len(lps)} logprobs for {len(tokens)} tokens")
            finished = comp.finish_reason == "stop"
            for j, t in enumerate(tokens):
                if t in eos:
                    tokens, lps, finished = tokens[: j + 1], lps[: j + 1], True
                    break
            prefix = [int(t) for t in req.prefix_ids]
            plp = list(prefix_logprobs.get(i, [])) if prefix else []
            if len(plp) != len(prefix):
                raise ValueError(f"request {i}: {len(plp)} prefix logprobs for {len(prefix)} prefix tokens")
            response = prefix + tokens
            result[i].append(
                Completion(
                    request_index=i,
                    prompt_ids=tuple(int(t) for t in req.prompt_ids),
                    response_ids=response,
                    logprobs=[float(x) for x in plp] + lps,
                    finished=finished,
                    text=decode(response) if decode is not None else str(getattr(comp, "text", "")),
                    prefix_len=len(prefix),
                )
            )
    for i, req in enumerate(requests):
        if len(result[i]) != req.n:
            raise ValueError(f"request {i}: got {len(result[i])} completions from vLLM, expected {req.n}")
    return result


class VLLMEngine:
    """:class:`~rlbench.rollout.engines.base.RolloutEngine` on ``vllm.LLM`` (GPU).

    ``model`` is the Hugging Face policy (kept for weight sync and prefix scoring);
    ``model_path`` is the checkpoint vLLM starts from (default: the model's own directory when
    it has one, else the model and tokenizer are saved to a temp dir). ``llm`` and
    ``sampling_params_factory`` inject stand-ins (tests; ``logits_transforms`` says whether the
    stand-in runs rlbench/rollout/engines/vllm_logits.py's processor); other keyword arguments go to
    ``vllm.LLM``.
    """

    def __init__(
        self,
        model,
        tokenizer,
        *,
        model_path: str | Path | None = None,
        gpu_memory_utilization: float = 0.4,
        dtype: str = "auto",
        max_model_len: int | None = None,
        enable_prefix_caching: bool = True,
        seed: int = 0,
        batch_size: int = 64,
        llm: Any = None,
        sampling_params_factory: Callable[..., Any] | None = None,
        logits_transforms: bool = False,
        **llm_kwargs: Any,
    ):
        self.tokenizer = tokenizer
        self.scorer = HFGenerateEngine(model, tokenizer, batch_size=batch_size, progress=False)
        self.eos_ids = list(self.scorer.eos_ids)
        self._tmpdir: tempfile.TemporaryDirectory | None = None
        self.logits_transforms = logits_transforms
        if llm is None:
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            try:
                import vllm
            except ImportError as err:
                raise ImportError(
                    "rollout.engine=vllm needs vLLM (GPU only): pip install 'rlbench[gpu]' "
                    "(vllm>=0.10.2), or use rollout.engine=hf"
                ) from err
            path = self._checkpoint_path(model, tokenizer, model_path)
            kwargs: dict[str, Any] = dict(
                model=str(path),
                tokenizer=str(path),
                dtype=dtype,
                gpu_memory_utilization=gpu_memory_utilization,
                enable_prefix_caching=enable_prefix_caching,
                seed=seed,
                generation_config="vllm",
                logprobs_mode="processed_logprobs",
            )
            if max_model_len is not None:
                kwargs["max_model_len"] = max_model_len
            try:
                kwargs["logits_processors"] = [vllm_logits.processor_class()]
            except ImportError:  # a vLLM without V1 custom logits processors: transforms are refused
                log.warning("this vLLM (%s) has no V1 custom logits processors: rollout strategies with a logits "
                            "transform (adaptive_temperature) cannot run on it", getattr(vllm, "__version__", "?"))
            kwargs.update(llm_kwargs)
            try:
                llm = vllm.LLM(**kwargs)
            except TypeError as err:  # older vLLM without logprobs_mode / generation_config
                if not any(k in str(err) for k in ("logprobs_mode", "generation_config", "logits_processors")):
                    raise
                log.warning(
                    "this vLLM (%s) lacks logprobs_mode; logprobs will be the raw model "
                    "distribution, not the tempered/top-p one (needs vLLM >= 0.10.2)",
                    getattr(vllm, "__version__", "?"),
                )
                kwargs.pop("logprobs_mode", None)
                kwargs.pop("generation_config", None)
                kwargs.pop("logits_processors", None)
                llm = vllm.LLM(**kwargs)
            sampling_params_factory = sampling_params_factory or vllm.SamplingParams
            ours = vllm_logits.loaded_processor()
            self.logits_transforms = ours is not None and ours in (kwargs.get("logits_processors") or [])
        if sampling_params_factory is None:
            raise ValueError("an injected llm needs sampling_params_factory")
        self.llm = llm
        self._make_sp = sampling_params_factory

    def _checkpoint_path(self, model, tokenizer, model_path) -> Path:
        if model_path is not None:
            return Path(model_path)
        own = Path(str(getattr(model, "name_or_path", "") or ""))
        if own.is_dir() and (own / "config.json").is_file():
            return own
        self._tmpdir = tempfile.TemporaryDirectory(prefix="rlbench-vllm-")
        model.save_pretrained(self._tmpdir.name)
        tokenizer.save_pretrained(self._tmpdir.name)
        return Path(self._tmpdir.name)

    def generate(
        self,
        requests: Sequence[GenerationRequest],
        params: SamplingParams,
        generator: torch.Generator | None = None,
    ) -> list[list[Completion]]:
        """Return, for each request, its ``n`` completions in order. A logits transform runs inside
        vLLM's sampler (rlbench/rollout/engines/vllm_logits.py)."""
        check_transform_requests(requests, params)
        if params.logits_transform is not None and not self.logits_transforms:
            raise ValueError(
                "this vLLM engine was started without rlbench's logits processor (a vLLM without V1 custom logits "
                "processors, or logits_processors overridden): it cannot run a logits transform; use vLLM >= 0.10.2 "
                "or rollout.engine=hf"
            )
        prompts, rows = requests_to_vllm_inputs(requests)
        if not rows:
            return [[] for _ in requests]
        if request_seeds(requests):
            seen: dict[int, int] = {}
            seeds = []
            for i in rows:  # rows of one request are consecutive: k counts them
                seeds.append(sample_seed(requests[i].seed, seen.get(i, 0)))
                seen[i] = seen.get(i, 0) + 1
        elif generator is None:
            seeds = torch.randint(0, 2**31 - 1, (len(rows),)).tolist()
        else:
            seeds = torch.randint(0, 2**31 - 1, (len(rows),), generator=generator, device=generator.device).tolist()
        with_prefix = [i for i, r in enumerate(requests) if r.prefix_ids and r.n > 0 and r.score_prefix]
        prefix_lp: dict[int, list[float]] = {  # not scored: NaN (GenerationRequest.score_prefix)
            i: [float("nan")] * len(r.prefix_ids) for i, r in enumerate(requests) if not r.score_prefix
        }
        if with_prefix:
            scored = self.score_prefixes([(tuple(requests[i].prompt_ids), tuple(requests[i].prefix_ids)) for i in with_prefix], params)
            prefix_lp.update(zip(with_prefix, scored))
        if params.max_new_tokens == 0:
            outputs = [_EmptyOutput() for _ in rows]
        else:
            key = None if params.logits_transform is None else vllm_logits.register_transform(params.logits_transform)
            try:
                sps = [self._make_sp(**vllm_sampling_kwargs(params, s, key)) for s in seeds]
                outputs = self.llm.generate(prompts, sps, use_tqdm=len(rows) > 256)
            finally:
                if key is not None:
                    vllm_logits.release_transform(key)
        return vllm_outputs_to_completions(
            requests,
            outputs,
            rows,
            prefix_logprobs=prefix_lp,
            decode=lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True),
            eos_ids=self.eos_ids,
        )

    def score_prefixes(
        self, items: Sequence[tuple[tuple[int, ...], tuple[int, ...]]], params: SamplingParams
    ) -> list[list[float]]:
        """The HF scorer's :meth:`HFGenerateEngine.score_prefixes` (module docstring)."""
        return self.scorer.score_prefixes(items, params)

    def position_stats(
        self, items: Sequence[tuple[tuple[int, ...], tuple[int, ...]]], params: SamplingParams
    ) -> list[PositionStats]:
        """The HF scorer's :meth:`HFGenerateEngine.position_stats` (module docstring)."""
        return self.scorer.position_stats(items, params)

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Load ``model``'s current weights into the vLLM model (``load_weights`` takes Hugging
        Face parameter names) and drop the prefix cache computed with the old weights. The vLLM
        model shares the GPU with the trainer (colocation: ``gpu_memory_utilization`` leaves the
        rest to training) and receives the tensors in place, without a copy on disk."""
        self.scorer.sync_weights(model)
        state = engine_weights(model)  # a LoRA policy: base + adapters merged, under the base names

        def _load(vllm_model):
            vllm_model.load_weights(weights=iter(state.items()))

        self.llm.apply_model(_load)
        reset = getattr(self.llm, "reset_prefix_cache", None)
        if reset is not None:
            reset()


class _EmptyCompletionOutput:
    token_ids: tuple = ()
    logprobs: list = []
    finish_reason = "length"
    text = ""


class _EmptyOutput:
    """Stand-in output for ``max_new_tokens == 0`` (vLLM needs ``max_tokens >= 1``)."""

    outputs = [_EmptyCompletionOutput()]
