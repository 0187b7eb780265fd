"""EIS-GRPO equivalent states pooled in one group (rlbench/rollout/strategies/equivalent_states.py, arXiv:2505.13346)."""

from __future__ import annotations

import pytest

from rlbench.config.typed import rollout_config
from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError
from rlbench.reward.toy import EvenTokenReward
from rlbench.rollout import GroupSampler, RolloutSetup, make_strategy, validate_strategy
from rlbench.rollout.engines.base import Completion, SamplingParams
from rlbench.rollout.strategies.equivalent_states import EquivalentStatesRollout, state_prompt_spec
from rlbench.training.batch import collate

from conftest import CharTokenizer, smoke_cli_steps


class Engine:
    """A response's tokens: 2 if the prompt starts with "!" else 1 (the toy reward: share of even ids)."""

    def __init__(self):
        self.requests = []

    def generate(self, requests, params, generator=None):
        self.requests.append([(r.prompt_ids, r.n) for r in requests])
        return [[Completion(i, r.prompt_ids, [2 if r.prompt_ids[0] == ord("!") else 1] * 3, [0.0] * 3, True)
                 for _ in range(r.n)] for i, r in enumerate(requests)]


def setup(n=4):
    sampler = GroupSampler(Engine(), EvenTokenReward(), CharTokenizer(), {"system": None, "user": "Q: {problem}"}, lambda r, _: r)
    return RolloutSetup(sampler, n, SamplingParams(1.0, 1.0, 3), None)


def test_each_state_gets_its_share_and_the_group_pools_them():
    s = setup(n=4)
    groups, metrics = EquivalentStatesRollout(s, ["", "!"]).rollout([Problem("1", "x", "0"), Problem("2", "yz", "0")])
    prompts = {"": [ord(c) for c in "Q: x"], "!": [ord(c) for c in "!Q: x"]}
    assert s.sampler.engine.requests == [[(tuple(prompts[""]), 2), (tuple(ord(c) for c in "Q: yz"), 2),
                                          (tuple(prompts["!"]), 2), (tuple(ord(c) for c in "!Q: yz"), 2)]]
    assert groups.group_ids == [0, 1] and [len(g) for g in groups.groups] == [4, 4]
    first = groups.groups[0]
    assert [list(c.prompt_ids) for c in first] == [prompts[""]] * 2 + [prompts["!"]] * 2  # each keeps its prompt
    assert groups.rewards.tolist() == [0.0, 0.0, 1.0, 1.0] * 2  # the "!" state answers with even tokens
    assert metrics == {"equivalent_states_reward_gap": 1.0}
    # the pooled group is one advantage group: the batch's group index does not split it by prompt
    batch = collate(groups.groups, pad_token_id=0)
    assert batch.group_index.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]


def test_state_prompt_keeps_the_system_message_and_the_template():
    spec = state_prompt_spec({"system": "Be brief.", "user": "Compute {problem}."}, "Note: ")
    assert spec == {"system": "Be brief.", "user": "Note: Compute {problem}."}


def test_settings_are_checked_before_the_model_loads(make_cfg):
    cfg = rollout_config(make_cfg("rollout=equivalent_states").rollout)
    validate_strategy(cfg, "grpo")
    assert isinstance(make_strategy(cfg, setup()), EquivalentStatesRollout)
    base = {"strategy": "equivalent_states", "n": 6, "equivalent_states": {"prefixes": ["", "a", "b", "c"]}}
    with pytest.raises(ConfigError, match=r"rollout.n=6 is not a multiple of the 4 equivalent states"):
        validate_strategy(rollout_config(base), "grpo")
    with pytest.raises(ConfigError, match="at least two distinct prefixes"):
        validate_strategy(rollout_config({**base, "n": 4, "equivalent_states": {"prefixes": ["", ""]}}), "grpo")
    with pytest.raises(ConfigError, match="must not contain braces"):
        validate_strategy(rollout_config({**base, "n": 4, "equivalent_states": {"prefixes": ["", "{x}"]}}), "grpo")


@pytest.mark.slow
def test_cli_run_pools_two_states(tmp_path):
    steps = smoke_cli_steps(tmp_path / "run", "rollout=equivalent_states", "rollout.n=4")
    assert all("equivalent_states_reward_gap" in s and s["generated_responses"] == 8 for s in steps)
