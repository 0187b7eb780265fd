"""The memory check before loading (rlbench/config/fit.py): every frozen model a run loads is counted."""

from __future__ import annotations

import pytest

from rlbench.config import fit
from rlbench.errors import ConfigError
from rlbench.validation import validate_config


def test_the_memory_check_counts_every_frozen_model_the_algorithm_loads(make_cfg, monkeypatch):
    """A loss that reads pi_ref (dpo) loads the reference model without a KL term: on a device with room
    for training alone (16 bytes per parameter) but not for a frozen copy beside it (20), sft validates and
    dpo is refused before loading; grpo without its KL term loads no reference and validates."""
    monkeypatch.setattr(fit, "device_memory_bytes", lambda device: 18 * 10**9)
    common = ["experiment=smoke", "model.parameters=1000000000"]
    validate_config(make_cfg(*common, "algorithm=sft"))
    validate_config(make_cfg(*common, "algorithm=grpo", "algorithm.kl.coef=0"))
    with pytest.raises(ConfigError, match=r"plus 4 for each of its 1 frozen model\(s\).*about 19 GiB, more than the 17 GiB"):
        validate_config(make_cfg(*common, "algorithm=dpo"))
