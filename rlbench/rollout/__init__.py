"""Rollout: engines turn generation requests into completions with sampling log-probs (base.py,
hf_engine.py, vllm_engine.py; the HF engine's CPU paths: cpu_linear.py, its products, lean_decode.py, its
decoding steps, prefix_cache.py, its KV kept across calls); strategies turn a step's prompts into graded groups (strategy.py,
the seam; iid.py, dynamic_sampling.py, tree.py and micro_groups.py, the strategies; groups.py, what they return)."""

from rlbench.rollout.base import Completion, GenerationRequest, RolloutEngine, SamplingParams
from rlbench.rollout.hf_engine import HFGenerateEngine
from rlbench.rollout.groups import GradedGroups, GroupSampler
from rlbench.rollout.strategy import STRATEGIES, RolloutSetup, RolloutStrategy, make_strategy, validate_strategy
from rlbench.rollout import (  # noqa: F401  (register the strategies; guided_prefix also dataset_reset)
    adaptive, adaptive_temperature, difficulty_adaptive, dynamic_sampling, edits, entropy_branch, equivalent_states,
    experience_library, guided_prefix, hints, iid, lookahead, masked, mcts_prefix, micro_groups, mixed_traces,
    multiround, replay, rethink, speculative, tree, vine,
)

__all__ = [
    "STRATEGIES",
    "Completion",
    "GenerationRequest",
    "GradedGroups",
    "GroupSampler",
    "HFGenerateEngine",
    "RolloutEngine",
    "RolloutSetup",
    "RolloutStrategy",
    "SamplingParams",
    "make_engine",
    "make_strategy",
    "validate_strategy",
]


def make_engine(rollout_cfg, model, tokenizer, device=None) -> RolloutEngine:
    """Build the engine named by ``rollout_cfg.engine`` (``hf`` | ``vllm``) from a
    ``conf/rollout/*.yaml`` node (a DictConfig or a dict); ``rollout_cfg.vllm`` holds extra
    keyword arguments for the vLLM engine; ``rollout_cfg.prefix_cache_mb`` is the HF engine's KV
    budget across calls (vLLM keeps its own prefix cache)."""
    from rlbench.errors import ConfigError

    engine = rollout_cfg.get("engine", "hf")
    if engine == "hf":
        return HFGenerateEngine(
            model, tokenizer, batch_size=int(rollout_cfg.get("batch_size", 64)), device=device,
            prefix_cache_mb=float(rollout_cfg.get("prefix_cache_mb", 0) or 0),
        )
    if engine == "vllm":
        from rlbench.rollout.vllm_engine import VLLMEngine

        return VLLMEngine(model, tokenizer, **dict(rollout_cfg.get("vllm") or {}))
    raise ConfigError(f"rollout.engine={engine!r} is unknown; use hf or vllm.")
