"""LSPO's length filter (rollout=lspo, rlbench/rollout/strategies/dynamic_sampling.py): the kept groups against
the quantile formula, and the decision read from the step's own rollouts (not from earlier steps)."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_guidance import CharTokenizer

from rlbench.config.typed import rollout_config
from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError
from rlbench.reward.toy import EvenTokenReward
from rlbench.rollout import GroupSampler, RolloutSetup, make_strategy, validate_strategy
from rlbench.rollout.engines.base import Completion, SamplingParams
from rlbench.rollout.strategies.dynamic_sampling import length_extremes

LSPO = {"strategy": "dynamic_sampling", "n": 2, "dynamic_sampling": {"length_extremes": [0.3, 0.65, 0.95]}}


def test_length_extremes_keep_the_shortest_and_the_long_but_not_the_truncated():
    # lengths 1..100, linear quantiles: Q(0.3) = 30.7, Q(0.65) = 65.35, Q(0.95) = 95.05 -> kept: 1..30 and 66..95
    kept = length_extremes([float(x) for x in range(1, 101)], 0.3, 0.65, 0.95)
    assert [x for x in range(1, 101) if kept[x - 1]] == [*range(1, 31), *range(66, 96)]
    assert length_extremes([5.0, 5.0, 5.0], 0.3, 0.65, 0.95).tolist() == [True, True, True]  # ties: every quantile 5
    assert length_extremes([], 0.3, 0.65, 0.95).tolist() == []


class LengthEngine:
    """Prompt (u,) answers with ``lengths[u]`` tokens: the first response even tokens (toy reward 1), the second
    odd (reward 0), so every group is informative; ``lengths`` may change between calls (steps)."""

    def __init__(self, lengths):
        self.lengths, self.requests = lengths, []

    def generate(self, requests, params, generator=None):
        self.requests.append([r.prompt_ids[0] for r in requests])
        return [[Completion(i, r.prompt_ids, [2 if k == 0 else 3] * self.lengths[r.prompt_ids[0]], [-0.1] * self.lengths[r.prompt_ids[0]], True)
                 for k in range(r.n)] for i, r in enumerate(requests)]


class UidSampler(GroupSampler):
    def encode(self, problems):
        return [(int(p.uid),) for p in problems]


def lspo_rollout(engine, problems, more):
    setup = RolloutSetup(UidSampler(engine, EvenTokenReward(0.5), CharTokenizer(), {}, lambda r, _: r), 2,
                         SamplingParams(1.0, 1.0, 200), None)
    return make_strategy(rollout_config(LSPO), setup).rollout(problems, lambda count: more[:count])


def test_lspo_keeps_the_length_extremes_of_the_steps_own_rollouts_and_draws_until_the_batch_is_full():
    problems = [Problem(str(u), f"q{u}", "a") for u in range(20)]
    lengths = {u: u + 1 for u in range(40)}  # this step: prompt u answers with u + 1 tokens
    engine = LengthEngine(lengths)
    graded, metrics = lspo_rollout(engine, problems, [Problem(str(u), f"q{u}", "a") for u in range(20, 40)])
    # round 1, lengths 1..20: Q(0.3) = 6.7, Q(0.65) = 13.35, Q(0.95) = 19.05 -> 1..6 and 14..19 (12 groups);
    # round 2, lengths 21..40: 21..26 and 34..39; the batch takes the first 20 kept
    first = [u for u in range(20) if u + 1 <= 6 or 14 <= u + 1 <= 19]
    second = [u for u in range(20, 40) if u + 1 <= 26 or 34 <= u + 1 <= 39]
    assert [int(p.uid) for p in graded.problems] == (first + second)[:20]
    assert metrics["lspo_length_dropped_groups"] == 16.0 and metrics["dynamic_sampling_rounds"] == 2.0
    # the next step, prompts 0..5 (kept above as the shortest) answer with 13 tokens: lengths 13 x 6 and 7..20
    # give Q(0.3) = 12.7 and Q(0.65) = 13.35, so 13 is in the middle and they are left out, whatever the earlier
    # step measured for them
    lengths.update({u: 13 for u in range(6)})
    graded, _ = lspo_rollout(engine, problems, [Problem(str(u), f"q{u}", "a") for u in range(20, 40)])
    assert not {p.uid for p in graded.problems} & {str(u) for u in range(6)}
    assert length_extremes([13.0] * 6 + [float(u + 1) for u in range(6, 20)], 0.3, 0.65, 0.95)[:6].sum() == 0


def test_lspo_filters_after_the_accuracy_filter():
    """A group whose responses are all right never reaches the length quantiles (it is not a candidate)."""
    problems = [Problem(str(u), f"q{u}", "a") for u in range(4)]

    class Engine(LengthEngine):  # prompt 0: both responses even (all right): dropped by the accuracy filter
        def generate(self, requests, params, generator=None):
            groups = super().generate(requests, params, generator)
            for group, request in zip(groups, requests):
                if request.prompt_ids[0] == 0:
                    for c in group:
                        c.response_ids = [2] * len(c.response_ids)
            return groups

    engine = Engine({0: 1, 1: 2, 2: 3, 3: 4})
    graded, metrics = lspo_rollout(engine, problems, problems)
    # candidates 1, 2, 3 with lengths 2, 3, 4: Q(0.3) = 2.6, Q(0.65) = 3.3, Q(0.95) = 3.9 -> only prompt 1 (2 <= 2.6)
    assert metrics["dynamic_sampling_dropped_groups"] >= 3.0
    assert {p.uid for p in graded.problems} == {"1"}


@pytest.mark.parametrize("bounds, message", [([0.7, 0.65, 0.95], "0 < low < high < max <= 1"),
                                             ([0.3, 0.65, 1.5], "0 < low < high < max <= 1"),
                                             ([0.0, 0.5, 0.9], "0 < low < high < max <= 1"),
                                             ([0.3, 0.65], "is not a tuple")])
def test_bad_lspo_quantiles_are_refused(bounds, message):
    with pytest.raises(ConfigError, match=message):
        validate_strategy(rollout_config({**LSPO, "dynamic_sampling": {"length_extremes": bounds}}), "grpo")


def test_without_length_extremes_dynamic_sampling_keeps_every_informative_group():
    problems = [Problem(str(u), f"q{u}", "a") for u in range(5)]
    engine = LengthEngine({u: u + 1 for u in range(5)})
    setup = RolloutSetup(UidSampler(engine, EvenTokenReward(0.5), CharTokenizer(), {}, lambda r, _: r), 2,
                         SamplingParams(1.0, 1.0, 200), None)
    graded, metrics = make_strategy(rollout_config({"strategy": "dynamic_sampling", "n": 2}), setup).rollout(problems, lambda count: problems[:count])
    assert [p.uid for p in graded.problems] == ["0", "1", "2", "3", "4"] and "lspo_length_dropped_groups" not in metrics
    assert torch.equal(graded.rewards, torch.tensor([1.0, 0.0] * 5))


@pytest.mark.slow
def test_lspo_rollout_and_the_open_rs_recipe_run_from_the_cli(tmp_path):
    from conftest import smoke_cli_steps

    steps = smoke_cli_steps(tmp_path / "lspo", "rollout=lspo", "trainer.steps=3", "eval.before_training=false")
    assert len(steps) == 3 and all("lspo_length_dropped_groups" in s for s in steps)
    steps = smoke_cli_steps(tmp_path / "open_rs", "algorithm=open_rs", "trainer.steps=1", "trainer.prompts_per_step=2",
                            "trainer.micro_batch_size=6", "eval.before_training=false")
    assert steps[0]["generated_responses"] == 2 * 6  # Open-RS's group of 6
    # the cosine reward replaces the grader's: every reward lies in [0.5, 1] (correct) or [-1, -0.5] (wrong)
    acc = steps[0]["accuracy"]
    assert 0.5 * acc - (1 - acc) <= steps[0]["reward_mean"] <= acc - 0.5 * (1 - acc)
