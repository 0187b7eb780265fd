"""Problem -> chat-formatted prompt token ids (one template per dataset)."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from rlbench.dataset import build_messages
from rlbench.dataset.base import Problem


def encode_prompts(tokenizer: Any, problems: Sequence[Problem], prompt_spec: Mapping[str, Any]) -> list[tuple[int, ...]]:
    """Apply the dataset's template and the model's chat template; return token ids per problem."""
    encoded = []
    for problem in problems:
        messages = build_messages(problem, prompt_spec)
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, Mapping) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        encoded.append(tuple(int(t) for t in ids))
    return encoded
