"""Engines: generation requests -> completions with their sampling log-probs.

``base.py`` is the interface every engine implements (``generate``, ``score_prefixes``, ``position_stats``,
``sync_weights``) and the values it exchanges; ``hf.py`` and ``vllm.py`` are the engines
(``rollout.engine``: hf | vllm); ``vllm_logits.py`` carries the engine's logits transform into vLLM;
``scoring.py`` the distribution statistics the engines return; ``cpu_linear.py``, ``lean_decode.py`` and
``prefix_cache.py`` are the HF engine's CPU paths (the few-rows kernel, decoding steps without
transformers' module wrappers, the KV kept across calls).
"""

from __future__ import annotations

from typing import Any

from rlbench.errors import ConfigError
from rlbench.rollout.engines.base import RolloutEngine
from rlbench.rollout.engines.hf import HFGenerateEngine

ENGINES = ("hf", "vllm")


def make_engine(rollout_cfg: Any, model, tokenizer, device=None) -> RolloutEngine:
    """Build the engine named by ``rollout_cfg.engine`` (``hf`` | ``vllm``) from a
    ``conf/rollout/*.yaml`` node (a DictConfig or a dict); ``rollout_cfg.vllm`` holds extra
    keyword arguments for the vLLM engine; ``rollout_cfg.prefix_cache_mb`` is the HF engine's KV
    budget across calls (vLLM keeps its own prefix cache)."""
    engine = rollout_cfg.get("engine", "hf")
    if engine == "hf":
        return HFGenerateEngine(
            model, tokenizer, batch_size=int(rollout_cfg.get("batch_size", 64)), device=device,
            prefix_cache_mb=float(rollout_cfg.get("prefix_cache_mb", 0) or 0),
        )
    if engine == "vllm":
        from rlbench.rollout.engines.vllm import VLLMEngine

        return VLLMEngine(model, tokenizer, **dict(rollout_cfg.get("vllm") or {}))
    raise ConfigError(f"rollout.engine={engine!r} is unknown; use one of {', '.join(ENGINES)}.")
