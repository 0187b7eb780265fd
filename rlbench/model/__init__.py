"""Policy models: load a model and its tokenizer from a ``conf/model/*.yaml`` config."""

from rlbench.model.loading import (
    SOURCES,
    build_tiny_model,
    convert_gguf_to_hf,
    count_parameters,
    find_gguf_file,
    load_policy,
    resolve_cache_dir,
    strip_quantization,
    validate_model_config,
)

__all__ = [
    "SOURCES",
    "build_tiny_model",
    "convert_gguf_to_hf",
    "count_parameters",
    "find_gguf_file",
    "load_policy",
    "resolve_cache_dir",
    "strip_quantization",
    "validate_model_config",
]
