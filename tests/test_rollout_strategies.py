"""The rollout-strategy seam: the registry, both strategies built from config, and group ids."""

import pytest
import torch

from rlbench.config.typed import rollout_config
from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError
from rlbench.reward.math import Grade
from rlbench.reward.toy import EvenTokenReward
from rlbench.rollout import STRATEGIES, GroupSampler, RolloutSetup, make_strategy, validate_strategy
from rlbench.rollout.engines.base import Completion, SamplingParams
from rlbench.rollout.strategies.dynamic_sampling import DynamicSampling, DynamicSamplingOptions, sample_informative_groups
from rlbench.rollout.groups import GradedGroups
from rlbench.rollout.strategies.iid import IIDSampling


class ScriptedEngine:
    """An engine whose response to prompt (k,) is n copies of the token list ``script[k]``."""

    def __init__(self, script):
        self.script = script
        self.requests = []

    def generate(self, requests, params, generator=None):
        self.requests.append([(r.prompt_ids, r.n) for r in requests])
        return [
            [Completion(i, r.prompt_ids, list(self.script[r.prompt_ids[0]]), [0.0] * len(self.script[r.prompt_ids[0]]), True)
             for _ in range(r.n)]
            for i, r in enumerate(requests)
        ]


class Tokenizer:
    def decode(self, ids):
        return " ".join(map(str, ids))


def problems(*uids):
    return [Problem(uid, "q", "a") for uid in uids]


def setup_for(script, n=2):
    """A RolloutSetup whose prompt ids are (k,) for problem uid "k" (toy reward: share of even tokens)."""

    class Sampler(GroupSampler):
        def __call__(self, problems, n, params, generator, prompt_ids=None):
            return super().__call__(problems, n, params, generator, [(int(p.uid),) for p in problems])

    sampler = Sampler(ScriptedEngine(script), EvenTokenReward(threshold=0.75), Tokenizer(), {}, lambda r, _: r)
    return RolloutSetup(sampler, n, SamplingParams(1.0, 1.0, 4), None)


def test_both_strategies_are_registered():
    assert {"iid", "dynamic_sampling"} <= set(STRATEGIES)


def test_unknown_strategy_is_refused_listing_the_options():
    with pytest.raises(ConfigError, match=r"rollout.strategy='unknown' is unknown; choose one of \[.*'dynamic_sampling', .*'iid'.*\]"):
        validate_strategy(rollout_config({"strategy": "unknown", "n": 4}), "grpo")
    with pytest.raises(ConfigError, match="choose one of"):
        make_strategy(rollout_config({"strategy": "unknown", "n": 4}), setup_for({}))


def test_strategies_come_from_the_rollout_config(make_cfg):
    default = rollout_config(make_cfg().rollout)
    assert default.strategy == "iid" and isinstance(make_strategy(default, setup_for({})), IIDSampling)
    dapo = rollout_config(make_cfg("algorithm=dapo", "rollout.dynamic_sampling.max_rounds=3").rollout)
    strategy = make_strategy(dapo, setup_for({}))
    assert isinstance(strategy, DynamicSampling)
    assert strategy.options == DynamicSamplingOptions(max_rounds=3, metric="correct")
    assert rollout_config(make_cfg("algorithm=dapo", "rollout=iid").rollout).strategy == "iid"  # the preset's choice is overridable
    assert rollout_config(make_cfg("rollout=dynamic_sampling").rollout).strategy == "dynamic_sampling"  # any preset can use it


def test_iid_groups_are_numbered_in_prompt_order():
    # toy reward: the share of even tokens
    setup = setup_for({0: [2, 4], 1: [1, 3], 2: [2, 3]}, n=3)
    groups, metrics = make_strategy(rollout_config({"strategy": "iid", "n": 3}), setup).rollout(problems("0", "1", "2"))
    assert metrics == {}
    assert groups.group_ids == [0, 1, 2]
    assert groups.response_group_ids.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert groups.group_index.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert groups.rewards.tolist() == [1.0] * 3 + [0.0] * 3 + [0.5] * 3
    assert setup.sampler.engine.requests == [[((0,), 3), ((1,), 3), ((2,), 3)]]


def test_dynamic_sampling_groups_keep_the_id_of_their_generation():
    # the rewards of each prompt's two responses; a group is informative when they differ
    rewards = {"0": [1.0, 1.0], "1": [1.0, 0.0], "2": [0.0, 0.0], "3": [0.0, 1.0], "4": [1.0, 0.0]}

    def sample(batch):
        groups = [[Completion(g, (g,), [g], [0.0], True) for _ in rewards[p.uid]] for g, p in enumerate(batch)]
        flat = torch.tensor([r for p in batch for r in rewards[p.uid]])
        grades = [Grade(correct=r > 0.5, extracted=None, reward=float(r), format_ok=True) for r in flat.tolist()]
        return GradedGroups(list(batch), groups, grades, flat, flat.clone(), torch.ones(len(flat), dtype=torch.bool),
                            list(range(len(groups))))

    queue = problems("3", "4", "0")
    batch, _ = sample_informative_groups(sample, lambda k: [queue.pop(0) for _ in range(k)], problems("0", "1", "2"),
                                         DynamicSamplingOptions(4, "correct"))
    # round 1 generated ids 0-2 (kept: "1" = id 1), round 2 ids 3-5 (kept: "3" = id 3, "4" = id 4)
    assert [p.uid for p in batch.problems] == ["1", "3", "4"]
    assert batch.group_ids == [1, 3, 4]
    assert batch.group_index.tolist() == [0, 0, 1, 1, 2, 2]  # positions in the batch, for the advantage
    assert batch.response_group_ids.tolist() == [1, 1, 3, 3, 4, 4]


def test_selection_and_concatenation_keep_group_ids():
    setup = setup_for({0: [2], 1: [1], 2: [4]}, n=2)
    groups = setup.sample(problems("0", "1", "2")).with_group_ids(10)
    assert groups.group_ids == [10, 11, 12]
    picked = groups.select([2, 0])
    assert picked.group_ids == [12, 10] and [p.uid for p in picked.problems] == ["2", "0"]
    joined = GradedGroups.concat([picked, groups.select([1])])
    assert joined.group_ids == [12, 10, 11] and joined.response_group_ids.tolist() == [12, 12, 10, 10, 11, 11]


def test_dynamic_sampling_needs_draw_prompts_and_groups_that_can_differ():
    strategy = DynamicSampling(setup_for({0: [2]}), DynamicSamplingOptions())
    with pytest.raises(ValueError, match="draws more prompts"):
        strategy.rollout(problems("0"), None)
    with pytest.raises(ConfigError, match="rollout.n >= 2"):
        validate_strategy(rollout_config({"strategy": "dynamic_sampling", "n": 1}), "grpo")
