"""VinePPO's Monte-Carlo step values (rlbench/rollout/strategies/vine.py) and their advantage
(rlbench/algorithm/advantages/vine.py), and staged GRPO on tree-search prefixes
(rlbench/rollout/strategies/mcts_prefix.py): closed forms on hand-built steps, the strategies on the tiny model,
the refusals before loading, and a CLI run of each."""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from conftest import has_vllm_gpu, smoke_cli_steps, model_preset
from rlbench.config.typed import rollout_config
from rlbench.algorithm.advantages import dr_grpo_advantage
from rlbench.algorithm.advantages.vine import step_runs, vine_advantage
from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError
from rlbench.model import load_policy
from rlbench.reward.toy import EvenTokenReward
from rlbench.rollout import GroupSampler, HFGenerateEngine, RolloutSetup, SamplingParams, make_strategy, validate_strategy
from rlbench.rollout.engines.base import Completion
from rlbench.rollout.strategies.mcts_prefix import revealed_length
from rlbench.rollout.strategies.vine import VineOptions, step_starts, token_steps
from rlbench.training.batch import collate

ROOT = Path(__file__).resolve().parents[1]

# Two responses of one prompt. Row 0: steps of 2, 3 and 1 tokens, V^ = 0.5, 0.75, 0.25, reward 1.
# Row 1: one step of 3 tokens then padding, V^ = 0.4, reward 0.
STEP_INDEX = torch.tensor([[0, 0, 1, 1, 1, 2], [0, 0, 0, -1, -1, -1]])
STEP_VALUES = torch.tensor([[0.5, 0.5, 0.75, 0.75, 0.75, 0.25], [0.4, 0.4, 0.4, 0.0, 0.0, 0.0]])
MASK = torch.tensor([[1.0] * 6, [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]])
REWARDS = torch.tensor([1.0, 0.0])


def test_vine_advantage_by_hand():
    adv = vine_advantage(REWARDS, MASK, STEP_INDEX, STEP_VALUES)
    # row 0: 0.75 - 0.5, 0.25 - 0.75, then the last step R - V^ = 1 - 0.25; row 1: one step, 0 - 0.4
    expected = torch.tensor([[0.25, 0.25, -0.5, -0.5, -0.5, 0.75], [-0.4, -0.4, -0.4, 0.0, 0.0, 0.0]])
    assert torch.allclose(adv, expected)
    discounted = vine_advantage(REWARDS, MASK, STEP_INDEX, STEP_VALUES, gamma=0.5)
    # gamma V^(s_{t+1}) - V^(s_t): 0.375 - 0.5, 0.125 - 0.75; the last step is not discounted
    assert torch.allclose(discounted[0], torch.tensor([-0.125, -0.125, -0.625, -0.625, -0.625, 0.75]))
    assert torch.equal(discounted[1], adv[1])
    whitened = vine_advantage(REWARDS, MASK, STEP_INDEX, STEP_VALUES, whiten=True)
    valid = expected[MASK > 0].double()
    assert torch.allclose(whitened[MASK > 0].double(), (valid - valid.mean()) / (valid.std() + 1e-8), atol=1e-6)
    assert torch.equal(whitened[MASK == 0], torch.zeros(3))


def test_vine_advantages_telescope_to_the_outcome_advantage():
    """With gamma = 1 the step advantages sum to R - V^(s_0), whatever the intermediate values."""
    torch.manual_seed(0)
    values = torch.rand(2, 6)
    index = torch.tensor([[0, 0, 1, 2, 2, 3], [0, 1, 1, 1, 2, -1]])
    mask = (index >= 0).float()
    per_step_values = torch.stack([values[r][index[r].clamp(min=0)] for r in range(2)])  # constant within a step
    adv = vine_advantage(REWARDS, mask, index, per_step_values)
    for r in range(2):
        firsts = [positions[0] for _, positions in step_runs(index[r].tolist(), [True] * 6)]
        assert float(adv[r, firsts].sum()) == pytest.approx(float(REWARDS[r] - per_step_values[r, 0]))


def test_one_step_responses_give_the_outcome_advantage():
    """A response of one step gets R - V^(s_0); with the group's mean reward as V^(s_0) (root_value=group)
    that is Dr.GRPO's advantage."""
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.2, 0.8])
    groups = torch.tensor([0, 0, 0, 1, 1])
    mask = torch.ones(5, 4)
    mask[2, 3] = 0
    index = torch.where(mask > 0, 0, -1)
    means = torch.tensor([0.5, 0.5, 0.5, 0.5, 0.5])[:, None].expand(5, 4)
    assert torch.allclose(vine_advantage(rewards, mask, index, means), dr_grpo_advantage(rewards, groups, mask))


def test_split_steps_are_refused():
    with pytest.raises(ValueError, match="appears twice"):
        step_runs([0, 1, 0], [True] * 3)
    with pytest.raises(ConfigError, match="gamma"):
        vine_advantage(REWARDS, MASK, STEP_INDEX, STEP_VALUES, gamma=1.5)


class NewlineTokenizer:
    """Token 10 is a newline; every other id decodes to a letter."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join("\n" if t == 10 else "a" for t in ids)


def test_step_starts():
    tokens = VineOptions(boundary="tokens", step_tokens=3, max_steps=8)
    assert step_starts(list(range(8)), tokens, None) == [0, 3, 6]
    assert step_starts(list(range(6)), tokens, None) == [0, 3]  # no step starts at the response's end
    newline = VineOptions(boundary="newline", max_steps=8)
    response = [1, 10, 2, 2, 10, 3, 10]  # newlines end steps at tokens 1 and 4; the final one ends the response
    assert step_starts(response, newline, NewlineTokenizer()) == [0, 2, 5]
    assert step_starts([1, 2, 3], newline, NewlineTokenizer()) == [0]
    # 7 boundaries thinned to max_steps - 1 = 3, spread evenly: indices 0, 2, 4 of [1..7]
    assert step_starts(list(range(8)), VineOptions(boundary="tokens", step_tokens=1, max_steps=4), None) == [0, 1, 3, 5]


def steps_of(completion):
    """(first token, V^) of each step of a vine response, read back from its step inputs (Completion.extras)."""
    index, values = completion.extras["step_index"], completion.extras["step_values"]
    return [(t, values[t]) for t in range(len(index)) if t == 0 or index[t] != index[t - 1]]


def test_token_steps_lays_out_the_step_values_and_collate_pads_them():
    index, values = token_steps([(0, 0.5), (2, 0.25), (4, 1.0)], 5)
    assert index == [0, 0, 1, 1, 2] and values == [0.5, 0.5, 0.25, 0.25, 1.0]
    completion = Completion(0, (1,), [5, 6, 7, 8, 9], [0.0] * 5, True, extras={"step_index": index, "step_values": values})
    short_index, short_values = token_steps([(0, 0.75)], 2)
    short = Completion(1, (1,), [5, 6], [0.0] * 2, True, extras={"step_index": short_index, "step_values": short_values})
    batch = collate([[completion, short]], 0)
    assert batch.extras["step_index"].tolist() == [[0, 0, 1, 1, 2], [0, 0, -1, -1, -1]]  # padded with -1
    assert batch.extras["step_values"].dtype == torch.float64
    assert batch.extras["step_values"].tolist() == [[0.5, 0.5, 0.25, 0.25, 1.0], [0.75, 0.75, 0.0, 0.0, 0.0]]
    assert batch.select(torch.tensor([1])).extras["step_index"].tolist() == [[0, 0]]  # trimmed with the response
    completion.extras.clear()
    with pytest.raises(ValueError, match="without extras\\['step_index'\\]"):
        collate([[completion, short]], 0)


# ------------------------------------------------------------------ refusals before loading


def _vine_cfg(**vine):
    return rollout_config({"strategy": "vine", "n": 4, "max_new_tokens": 8, "vine": {"boundary": "tokens", "step_tokens": 2, "k": 2, **vine}})


def test_vine_options_refused():
    with pytest.raises(ConfigError, match=r"rollout.vine.k must be >= 1, got 0 \(K Monte-Carlo"):
        validate_strategy(_vine_cfg(k=0), "vine")
    with pytest.raises(ConfigError, match="boundary must be one of"):
        validate_strategy(_vine_cfg(boundary="sentence"), "vine")
    with pytest.raises(ConfigError, match="root_value must be one of"):
        validate_strategy(_vine_cfg(root_value="critic"), "vine")
    with pytest.raises(ConfigError, match=r"no key\(s\) \['K'\]"):
        validate_strategy(_vine_cfg(K=2), "vine")
    one = _vine_cfg(root_value="group")
    one.n = 1
    with pytest.raises(ConfigError, match="rollout.n >= 2"):
        validate_strategy(one, "vine")
    with pytest.raises(ConfigError, match=r"algorithm/advantage=<one of \['vine'\]>"):
        validate_strategy(_vine_cfg(), "grpo")
    validate_strategy(_vine_cfg(), "vine")


def _mcts_cfg(n=4, max_new_tokens=8, **options):
    block = {"search": {"segment_tokens": 2, "root_branching": 2, "branching": 2, "rounds": 0}, "stage_depths": [2, 1, 0],
             "steps_per_stage": 1, **options}  # the online search of one expansion pass
    return rollout_config({"strategy": "mcts_prefix", "n": n, "max_new_tokens": max_new_tokens, "mcts_prefix": block})


def test_mcts_prefix_options_refused():
    with pytest.raises(ConfigError, match=r"leaves nothing to generate.*depths below 4"):
        validate_strategy(_mcts_cfg(stage_depths=[4, 0]), "grpo")
    with pytest.raises(ConfigError, match="rollout.mcts_prefix.search.root_branching"):
        validate_strategy(_mcts_cfg(n=6), "grpo")
    with pytest.raises(ConfigError, match="rollout.n >= 2"):
        validate_strategy(_mcts_cfg(n=1, search={"root_branching": 1}), "grpo")
    with pytest.raises(ConfigError, match="non-empty list of stages"):
        validate_strategy(_mcts_cfg(stage_depths=[]), "grpo")
    with pytest.raises(ConfigError, match="distinct depths >= 0"):
        validate_strategy(_mcts_cfg(stage_depths=[[1, 1]]), "grpo")
    with pytest.raises(ConfigError, match=r"mixing 3 depths \[2, 1, 0\].*rollout.n=4"):
        validate_strategy(_mcts_cfg(stage_depths=[[2, 1, 0]]), "grpo")
    with pytest.raises(ConfigError, match="steps_per_stage must be >= 1"):
        validate_strategy(_mcts_cfg(steps_per_stage=0), "grpo")
    with pytest.raises(ConfigError, match=r"no key\(s\) \['depths'\]"):
        validate_strategy(_mcts_cfg(depths=[1]), "grpo")
    validate_strategy(_mcts_cfg(), "grpo")


def test_config_refusals(make_cfg):
    from rlbench.validation import validate_config

    with pytest.raises(ConfigError, match="Select rollout=vine"):
        validate_config(make_cfg("experiment=toy_learning/grpo", "algorithm/advantage=vine"))
    with pytest.raises(ConfigError, match="does not read"):
        validate_config(make_cfg("experiment=toy_learning/grpo", "rollout=vine"))
    with pytest.raises(ConfigError, match="needs one advantage per response"):  # a sequence-level loss
        validate_config(make_cfg("experiment=toy_learning/gspo", "rollout=vine", "algorithm/advantage=vine"))
    validate_config(make_cfg("experiment=toy_learning/grpo", "rollout=vine", "algorithm/advantage=vine"))
    with pytest.raises(ConfigError, match="leaves nothing to generate"):  # 2 segments of 4 tokens in 8
        validate_config(make_cfg("experiment=toy_learning/grpo", "rollout=mcts_prefix"))
    validate_config(make_cfg("experiment=toy_learning/grpo", "rollout=mcts_prefix", "rollout.max_new_tokens=12"))


def test_revealed_length():
    assert revealed_length(8, 2, 2) == 4
    assert revealed_length(8, 4, 2) == 6  # at most the whole segments before the last token
    assert revealed_length(5, 3, 2) == 4
    assert revealed_length(1, 1, 2) == 0
    assert revealed_length(8, 0, 2) == 0


# ------------------------------------------------------------------ the strategies on the tiny model


@pytest.fixture(scope="module")
def tiny():
    return load_policy(model_preset("tiny"), seed=0)


def _strategy(tiny, cfg, temperature=1.0, seed=0):
    model, tokenizer = tiny
    sampler = GroupSampler(
        HFGenerateEngine(model, tokenizer, progress=False), EvenTokenReward(), tokenizer,
        {"system": None, "user": "{problem}"}, lambda rewards, inputs: rewards,
    )
    params = SamplingParams(temperature=temperature, max_new_tokens=int(cfg.max_new_tokens))
    strategy = make_strategy(cfg, RolloutSetup(sampler, int(cfg.n), params, torch.Generator().manual_seed(seed)))
    problems = [Problem(uid=f"p{i}", prompt=q, answer="0") for i, q in enumerate(["1 + 2", "3 + 4"])]
    return strategy, sampler, problems


def even_share(ids):
    return sum(t % 2 == 0 for t in ids) / len(ids)


def test_vine_values_under_greedy_decoding_are_the_response_reward(tiny):
    """Greedy continuations of a greedy response's prefix are the response itself: every state's
    V^ is the response's reward, so each step's advantage is 0 (with V^(s_0) from rollouts)."""
    strategy, sampler, problems = _strategy(tiny, _vine_cfg(), temperature=0.0)
    graded, metrics = strategy.rollout(problems)
    for completion, reward in zip([c for g in graded.groups for c in g], graded.rewards.tolist()):
        assert [start for start, _ in steps_of(completion)] == [0, 2, 4, 6]  # 8 tokens in steps of 2
        assert [value for _, value in steps_of(completion)] == pytest.approx([reward] * 4)
    # one greedy response per prompt (all n equal): 1 root + 3 prefixes per prompt, k = 2 continuations each
    assert metrics["vine_states"] == 2 * 4 and metrics["vine_continuations"] == 2 * 4 * 2
    cost = sampler.cost.take()
    assert cost["generated_responses"] == 2 * 4 + 2 * 4 * 2
    assert cost["reused_tokens"] == 2 * 2 * (2 + 4 + 6)  # the prefixes, once per continuation


def test_vine_values_are_the_mean_reward_of_the_continuations(tiny):
    class Recording(HFGenerateEngine):
        def generate(self, requests, params, generator=None):
            out = super().generate(requests, params, generator)
            self.calls.append((list(requests), out))
            return out

    model, tokenizer = tiny
    strategy, sampler, problems = _strategy(tiny, _vine_cfg(k=3, step_tokens=3, root_value="group"), seed=1)
    sampler.engine = Recording(model, tokenizer, progress=False)
    sampler.engine.calls = []
    graded, _ = strategy.rollout(problems)
    continued = {}
    for requests, outs in sampler.engine.calls[1:]:  # the first call samples the responses
        for request, completions in zip(requests, outs):
            assert request.n == 3 and request.prefix_ids  # root_value=group: no rollouts from the prompt
            continued[(request.prompt_ids, request.prefix_ids)] = completions
    for p, group in enumerate(graded.groups):
        group_mean = float(graded.rewards[graded.group_index == p].mean())
        for c in group:
            steps = steps_of(c)
            assert [s for s, _ in steps] == [0, 3, 6]
            assert steps[0][1] == pytest.approx(group_mean)
            for start, value in steps[1:]:
                completions = continued[(c.prompt_ids, tuple(c.response_ids[:start]))]
                assert all(len(k.response_ids) == 8 and k.response_ids[:start] == c.response_ids[:start] for k in completions)
                assert value == pytest.approx(sum(even_share(k.response_ids) for k in completions) / 3)


def test_mcts_prefix_stages_reveal_the_best_search_leaf(tiny):
    cfg = _mcts_cfg(max_new_tokens=8, stage_depths=[2, 1, 0], steps_per_stage=1)
    strategy, sampler, problems = _strategy(tiny, cfg, seed=2)
    depths = []
    for expected_depth in (2, 1, 0, 0):
        graded, metrics = strategy.rollout(problems)
        depths.append(metrics["mcts_prefix_depth"])
        cost = sampler.cost.take()
        for group in graded.groups:
            assert len(group) == 4
            prefix = len(group[0].response_ids) - sum(group[0].loss_mask) if group[0].loss_mask else 0
            assert prefix == 2 * expected_depth
            for c in group:
                assert len(c.response_ids) <= 8
                assert c.response_ids[:prefix] == group[0].response_ids[:prefix]  # one state per group
                if prefix:
                    assert c.behaviour == "prefix" and c.loss_mask == [0] * prefix + [1] * (len(c.response_ids) - prefix)
        if expected_depth:
            assert metrics["mcts_prefix_tokens_mean"] == 2 * expected_depth and cost["reused_tokens"] > 0
        else:
            assert metrics["rollout_outcome_mean"] == pytest.approx(float(graded.outcome.mean()))
            assert cost["generated_tokens"] == 2 * 4 * 8  # no search
    assert depths == [2, 1, 0, 0]
    assert strategy.state_dict() == {"step": 4}
    strategy.load_state_dict({"step": 1})
    assert strategy.depths == (1,)


def test_mcts_prefix_is_the_best_leafs_prefix(tiny):
    """The revealed prefix is the start of a search leaf with the highest reward of its prompt."""
    from rlbench.rollout.strategies.tree import TreeSampling

    cfg = _mcts_cfg(stage_depths=[3], steps_per_stage=1)
    strategy, sampler, problems = _strategy(tiny, cfg, seed=4)
    grown = []
    original = TreeSampling.grow

    def grow(self, prompt_ids):
        leaves, metrics = original(self, prompt_ids)
        grown.append(leaves)
        return leaves, metrics

    TreeSampling.grow = grow
    try:
        graded, _ = strategy.rollout(problems)
    finally:
        TreeSampling.grow = original
    for leaves, group in zip(grown[0], graded.groups):
        best = max(even_share(leaf.response_ids) for leaf in leaves)
        prefix = group[0].response_ids[:6]
        assert any(leaf.response_ids[:6] == prefix and even_share(leaf.response_ids) == best for leaf in leaves)


@pytest.mark.gpu
@pytest.mark.skipif(not has_vllm_gpu(), reason="needs CUDA and vLLM")
@pytest.mark.parametrize("strategy", ["vine", "mcts_prefix"])
def test_strategy_on_the_vllm_engine_gpu(strategy):
    """Each strategy of this module through the vLLM engine (prefix caching serves the continuations):
    every group has its n responses within the budget; vine's values are rewards' means, in [0, 1]."""
    from rlbench.rollout.engines.vllm import VLLMEngine

    model, tokenizer = load_policy(model_preset("smollm2_135m"), device="cuda")
    engine = VLLMEngine(model, tokenizer, gpu_memory_utilization=0.2, enforce_eager=True)
    sampler = GroupSampler(engine, EvenTokenReward(), tokenizer, {"system": None, "user": "{problem}"}, lambda r, i: r)
    cfg = _vine_cfg() if strategy == "vine" else _mcts_cfg()
    cfg.max_new_tokens = 16
    params = SamplingParams(temperature=1.0, max_new_tokens=16)
    graded, _ = make_strategy(cfg, RolloutSetup(sampler, 4, params, torch.Generator().manual_seed(0))).rollout(
        [Problem(uid="p0", prompt="1 + 2", answer="3"), Problem(uid="p1", prompt="3 + 4", answer="7")]
    )
    assert [len(g) for g in graded.groups] == [4, 4]
    for c in (c for g in graded.groups for c in g):
        assert len(c.response_ids) <= 16
        if strategy == "vine":
            assert steps_of(c)[0][0] == 0 and all(0.0 <= v <= 1.0 for _, v in steps_of(c))


# ------------------------------------------------------------------ the command line


@pytest.mark.slow
def test_cli_vine_run_logs_its_values(tmp_path):
    steps = smoke_cli_steps(
        tmp_path / "run", "rollout=vine", "algorithm/advantage=vine", "rollout.vine.boundary=tokens",
        "rollout.vine.step_tokens=3", "rollout.vine.k=2",
    )
    for step in steps:  # 2 prompts x 2 responses of 8 tokens: steps at 0, 3, 6
        assert step["vine_steps_mean"] == 3 and step["vine_continuations"] == 2 * step["vine_states"]
        assert step["reused_tokens"] > 0 and step["generated_responses"] == 4 + step["vine_continuations"]


@pytest.mark.slow
def test_cli_mcts_prefix_run_goes_through_its_stages(tmp_path):
    """The online search (teacher_tree ''), with the preset's UCT rounds."""
    steps = smoke_cli_steps(
        tmp_path / "run", "rollout=mcts_prefix", "rollout.mcts_prefix.search.segment_tokens=2",
        "rollout.mcts_prefix.stage_depths=[1,0]", "rollout.mcts_prefix.steps_per_stage=1", "rollout.mcts_prefix.teacher_tree=''",
    )
    assert [step["mcts_prefix_depth"] for step in steps] == [1, 0]
    assert steps[0]["mcts_prefix_tokens_mean"] == 2 and steps[0]["reused_tokens"] > 0
    assert "mcts_teacher_tree_prompts" not in steps[0] and not (tmp_path / "run" / "teacher_tree.json").exists()


@pytest.mark.slow
def test_cli_mcts_prefix_default_is_the_teacher_tree(tmp_path):
    """The preset's default: the offline teacher tree in the run folder, grown at the first step with 2 UCT rounds."""
    steps = smoke_cli_steps(
        tmp_path / "run", "rollout=mcts_prefix", "rollout.mcts_prefix.search.segment_tokens=2",
        "rollout.mcts_prefix.stage_depths=[1,0]", "rollout.mcts_prefix.steps_per_stage=1",
    )
    assert steps[0]["mcts_teacher_tree_prompts"] > 0 and "mcts_teacher_tree_prompts" not in steps[1]
    tree = json.loads((tmp_path / "run" / "teacher_tree.json").read_text())
    for record in tree["prompts"].values():  # the smoke's 2 leaves, then 2 rounds: 2 new rollouts or a reselection each
        assert record["nodes"][0]["N"] == len(record["leaves"]) + (2 - (len(record["leaves"]) - 2) // 2) >= 2 + 2
