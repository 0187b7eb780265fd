"""algorithm=dapo_multi_turn (conf/algorithm/dapo_multi_turn.yaml; multi-turn DAPO for SWE agents, Golubev et al.
2025, arXiv:2508.03501): the preset composes DAPO's loss with rollout=multi_turn_filtered and env=code_repair, and
its spec's CPU checks on scripted toy-env episodes run through the preset's own rollout options and loss: the loss
mask excludes observation tokens, the reward sits at the final token, the DAPO loss ignores masked tokens (changing
observation tokens' log-probs does not change it; changing a policy token's does), and zero-advantage groups are
filtered (more prompts drawn until the batch holds groups whose episodes differ)."""

from __future__ import annotations

import pytest
import torch
from conftest import algorithm_from, compose_config
from test_env_multi_turn import EOS, Factory, ScriptedEngine, Tokens

from rlbench.config.typed import typed_config
from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError
from rlbench.rollout import GroupSampler, RolloutSetup
from rlbench.rollout.engines.base import SamplingParams
from rlbench.rollout.strategies.multi_turn import MultiTurnOptions, MultiTurnRollout
from rlbench.training.batch import collate


@pytest.fixture(scope="module")
def preset(tmp_path_factory):
    return compose_config(["algorithm=dapo_multi_turn"], tmp_path_factory.mktemp("dapo_multi_turn"))


def test_the_preset_composes_dapo_with_filtered_multi_turn_episodes(preset):
    algorithm = preset.algorithm
    assert algorithm.name == "dapo_multi_turn" and algorithm.advantage.name == "grpo" and algorithm.kl.coef == 0.0
    assert (algorithm.loss.name, algorithm.loss.clip_low, algorithm.loss.clip_high) == ("ppo_clip", 0.2, 0.28)
    assert algorithm.aggregation.name == "token_mean" and algorithm.fidelity.status == "partial"
    assert preset.rollout.strategy == "multi_turn" and preset.rollout.multi_turn.dynamic_sampling is True
    assert preset.env.name == "code_repair"


def run(preset, script, problems, draw=()):
    """The preset's rollout strategy (its typed rollout node) on a scripted engine and the scripted toy env
    (tests/test_env_multi_turn.py: "win" ends with reward 1, any other word answers "ok" and goes on)."""
    rollout = typed_config(preset).rollout
    sampler = GroupSampler(ScriptedEngine(script), None, Tokens(), {"user": "{problem}"}, lambda r, _: r)
    setup = RolloutSetup(sampler, 2, SamplingParams(1.0, 1.0, 16), None, env=Factory())
    strategy = MultiTurnRollout.from_config(rollout, setup)
    extra = iter(draw)
    return strategy.rollout([Problem(p, p, "0") for p in problems],
                            lambda k: [Problem(p, p, "0") for p in [next(extra) for _ in range(k)]])


def test_zero_advantage_groups_are_filtered(preset):
    # round 1: group "a" solves both (zero advantage), group "b" neither (zero advantage); round 2: "c" differs, "d" too
    script = [["win\n", "win\n", "x$", "y$"], ["win\n", "z$", "q$", "win\n"]]  # one engine call a round
    groups, metrics = run(preset, script, ["a", "b"], draw=["c", "d"])
    assert [p.prompt for p in groups.problems] == ["c", "d"] and groups.outcome.tolist() == [1.0, 0.0, 0.0, 1.0]
    assert metrics["dynamic_sampling_rounds"] == 2.0 and metrics["dynamic_sampling_dropped_groups"] == 2.0
    assert metrics["multi_turn_ended_goal"] == 4  # the episode metrics count both rounds


def test_masks_final_token_reward_and_a_loss_blind_to_observation_tokens(preset):
    script = [["go\n", "stay$", "win\n", "nope$"], ["win\n"]]
    groups, _ = run(preset, script, ["a", "b"])
    won = groups.groups[0][0]
    assert won.text == "go\nok\nwin\n" and won.loss_mask == [1, 1, 1, 0, 0, 0, 1, 1, 1, 1]
    assert won.extras["turn_rewards"][-1] == 1.0 and sum(won.extras["turn_rewards"][:-4]) == 0.0  # reward on the last turn
    batch = collate(groups.groups, pad_token_id=EOS)
    mask = batch.response_mask
    assert mask[0].tolist()[:10] == [1, 1, 1, 0, 0, 0, 1, 1, 1, 1]  # the observation tokens are out of the loss mask
    algorithm = algorithm_from(preset.algorithm)
    advantages = algorithm.compute_advantages(groups.rewards, groups.group_index, mask)
    assert advantages[0, 0].item() > 0 > advantages[1, 0].item()  # the episode's reward reaches its first turn too
    assert (advantages[mask == 0] == 0).all()
    torch.manual_seed(0)
    logp, old = -torch.rand(mask.shape), -torch.rand(mask.shape)

    def loss(lp, o):
        norms = {"batch_tokens": int(mask.sum()), "batch_sequences": mask.shape[0], "norm_length": 16}
        return algorithm.compute_loss(logp=lp, old_logp=o, ref_logp=None, entropy=torch.zeros(mask.shape),
                                      advantages=advantages, response_mask=mask, norms=norms)[0]

    full = loss(logp, old)
    observation = (mask == 0).float()
    assert loss(logp + 3.0 * observation, old - 2.0 * observation).item() == pytest.approx(full.item(), abs=1e-7)
    policy_token = torch.zeros(mask.shape)
    policy_token[0, 0] = 1.0
    assert loss(logp + 0.1 * policy_token, old).item() != pytest.approx(full.item(), abs=1e-7)


def test_the_filter_needs_groups_and_independent_episodes():
    from rlbench.config.schema import RolloutConfig

    with pytest.raises(ConfigError, match="needs rollout.n >= 2"):
        MultiTurnOptions.from_config(RolloutConfig(strategy="multi_turn", n=1, settings={"multi_turn": {"dynamic_sampling": True}}))
    with pytest.raises(ConfigError, match="needs branch=none"):
        MultiTurnOptions.from_config(RolloutConfig(strategy="multi_turn", n=2, settings={"multi_turn": {"dynamic_sampling": True, "branch": "random_turn"}}))
    with pytest.raises(ConfigError, match="max_rounds must be >= 1"):
        MultiTurnOptions.from_config(RolloutConfig(strategy="multi_turn", n=2, settings={"multi_turn": {"dynamic_sampling": True, "max_rounds": 0}})).filter_options()
    filtered = RolloutConfig(strategy="multi_turn", n=2, settings={"multi_turn": {"dynamic_sampling": True}})
    with pytest.raises(ConfigError, match="advantage 'spo' does not combine with rollout.multi_turn.dynamic_sampling"):
        MultiTurnRollout.validate(filtered, "spo")
    MultiTurnRollout.validate(filtered, "grpo")
    MultiTurnRollout.validate(RolloutConfig(strategy="multi_turn", n=2), "spo")  # without the filter SPO is fine


def test_spo_is_refused_by_both_filters_with_one_message(make_cfg):
    from rlbench.validation import validate_config

    for overrides in (["rollout=dynamic_sampling"], ["rollout=multi_turn_filtered", "env=gridworld"]):
        with pytest.raises(ConfigError, match="advantage 'spo' does not combine with rollout.*the tracker baseline"):
            validate_config(make_cfg("experiment=smoke", "algorithm=spo", "rollout.n=4", *overrides))
