"""Rollout engines: turn generation requests into completions with sampling log-probs."""

from rlbench.rollout.base import Completion, GenerationRequest, RolloutEngine, SamplingParams
from rlbench.rollout.hf_engine import HFGenerateEngine

__all__ = [
    "Completion",
    "GenerationRequest",
    "HFGenerateEngine",
    "RolloutEngine",
    "SamplingParams",
    "make_engine",
]


def make_engine(rollout_cfg, model, tokenizer, *, device=None, **vllm_kwargs) -> RolloutEngine:
    """Build the engine named by ``rollout_cfg.engine`` (``hf`` | ``vllm``) from a
    ``conf/rollout/*.yaml`` node."""
    from rlbench.errors import ConfigError

    engine = rollout_cfg.get("engine", "hf") if hasattr(rollout_cfg, "get") else getattr(rollout_cfg, "engine", "hf")
    batch_size = rollout_cfg.get("batch_size", 64) if hasattr(rollout_cfg, "get") else getattr(rollout_cfg, "batch_size", 64)
    if engine == "hf":
        return HFGenerateEngine(model, tokenizer, batch_size=int(batch_size), device=device)
    if engine == "vllm":
        from rlbench.rollout.vllm_engine import VLLMEngine

        return VLLMEngine(model, tokenizer, **vllm_kwargs)
    raise ConfigError(f"rollout.engine={engine!r} is unknown; use hf or vllm.")
