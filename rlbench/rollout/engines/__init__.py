"""Engines: generation requests -> completions with their sampling log-probs.

``base.py`` is the interface every engine implements (``generate``, ``score_prefixes``, ``position_stats``,
``sync_weights``) and the values it exchanges; ``hf.py`` and ``vllm.py`` are the engines
(``rollout.engine``: hf | vllm); ``vllm_logits.py`` carries the engine's logits transform into vLLM;
``scoring.py`` the distribution statistics the engines return; ``cpu_linear.py``, ``lean_decode.py`` and
``prefix_cache.py`` are the HF engine's CPU paths (the few-rows kernel, decoding steps without
transformers' module wrappers, the KV kept across calls).
"""

from __future__ import annotations

import dataclasses

from rlbench.config.schema import RolloutConfig
from rlbench.errors import ConfigError
from rlbench.rollout.engines.base import RolloutEngine
from rlbench.rollout.engines.hf import HFGenerateEngine

ENGINES = ("hf", "vllm")


def make_engine(rollout: RolloutConfig, model, tokenizer, device=None) -> RolloutEngine:
    """Build the engine named by ``rollout.engine`` (``hf`` | ``vllm``); ``rollout.batch_size`` and
    ``rollout.prefix_cache_mb`` (the KV kept across calls) are the HF engine's; vLLM keeps its own
    prefix cache."""
    if rollout.engine == "hf":
        return HFGenerateEngine(model, tokenizer, batch_size=rollout.batch_size, device=device,
                                prefix_cache_mb=rollout.prefix_cache_mb)
    if rollout.engine == "vllm":
        from rlbench.rollout.engines.vllm import VLLMEngine

        return VLLMEngine(model, tokenizer)
    raise ConfigError(f"rollout.engine={rollout.engine!r} is unknown; use one of {', '.join(ENGINES)}.")


def frozen_model_engine(rollout: RolloutConfig, model, tokenizer, device=None) -> RolloutEngine:
    """An engine of its own over a model that is not the policy (a judge's frozen copy or model, the rounds'
    pi_t, QRPO's pi_ref): always the HF engine on the run's device with the rollout's batch and prefix-cache
    settings, since a second vLLM engine would claim a second share of the GPU's memory."""
    return make_engine(dataclasses.replace(rollout, engine="hf"), model, tokenizer, device)
